#!/usr/bin/env bash
# On the GPU machine: benchmarks/bench_http.py across device calls (a 32-layer engine's first
# warm-up compiles for about 500 s, longer than a call), its compilation cache kept in /tmp for the
# next call of a warm machine; its log unbuffered, so a run still going shows how far it got. Carry
# .whl_serve (scripts/fetch_serve_wheels.sh).
#
#   scripts/device_bench_http.sh start NAME [bench_http flags...]   # installs the serve wheels once,
#                                      # runs bench_http in the background (log /tmp/NAME.log)
#   scripts/device_bench_http.sh wait NAME SECONDS                   # waits for it to end, at most
#                                      # SECONDS; copies its log, section and RESULTS.md to $OUT
set -euo pipefail
site=/tmp/site_serve
export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
step=${1:-}
name=${2:-}
[ -n "$name" ] || { echo "usage: $0 start NAME [flags...] | wait NAME SECONDS" >&2; exit 2; }
case "$step" in
  start)
    shift 2
    [ -d "$site" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl_serve/*.whl
    rm -f "/tmp/$name.done"
    setsid nohup bash -c "PYTHONUNBUFFERED=1 python3 -m benchmarks.bench_http $* --section $name > /tmp/$name.log 2>&1; \
      echo \$? > /tmp/$name.done" > /dev/null 2>&1 &
    echo "bench_http started: /tmp/$name.log" ;;
  wait)
    end=$((SECONDS + ${3:?seconds}))
    while [ ! -f "/tmp/$name.done" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    if [ -f "/tmp/$name.done" ]; then echo "bench_http ended with status $(cat "/tmp/$name.done")"; else echo "still running"; fi
    grep '^|\|x;\|x (' "/tmp/$name.log" | tail -8 || true
    cp "/tmp/$name.log" "$OUT/"
    cp benchmarks/RESULTS.md "$OUT/" ;;
  *)
    echo "usage: $0 start NAME [flags...] | wait NAME SECONDS" >&2; exit 2 ;;
esac
