#!/usr/bin/env bash
# On the GPU machine: a benchmark module run across device calls (a 32-layer engine's first warm-up
# compiles for minutes, and a whole trace may outlast a call), its compilation cache kept in /tmp
# for the next call of a warm machine; its log unbuffered, so a run still going shows how far it
# got. Carry .whl_serve (scripts/fetch_serve_wheels.sh) for bench_http.
#
#   scripts/device_bench.sh start NAME MODULE [flags...]   # installs the serve wheels once (when
#                                      # carried), runs `python3 -m benchmarks.MODULE flags --section
#                                      # NAME` in the background (log /tmp/NAME.log)
#   scripts/device_bench.sh wait NAME SECONDS              # waits for it to end, at most SECONDS;
#                                      # copies its log and RESULTS.md to $OUT
set -euo pipefail
site=/tmp/site_serve
export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
usage="usage: $0 start NAME MODULE [flags...] | wait NAME SECONDS"
step=${1:-}
name=${2:-}
[ -n "$name" ] || { echo "$usage" >&2; exit 2; }
case "$step" in
  start)
    module=${3:?$usage}
    shift 3
    if [ ! -d "$site" ] && compgen -G ".whl_serve/*.whl" > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl_serve/*.whl
    fi
    rm -f "/tmp/$name.done"
    setsid nohup bash -c "PYTHONUNBUFFERED=1 python3 -m benchmarks.$module $* --section $name > /tmp/$name.log 2>&1; \
      echo \$? > /tmp/$name.done" > /dev/null 2>&1 &
    echo "$module started: /tmp/$name.log" ;;
  wait)
    end=$((SECONDS + ${3:?$usage}))
    while [ ! -f "/tmp/$name.done" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    if [ -f "/tmp/$name.done" ]; then echo "ended with status $(cat "/tmp/$name.done")"; else echo "still running"; fi
    tail -c 6000 "/tmp/$name.log" || true
    cp "/tmp/$name.log" "$OUT/"
    cp benchmarks/RESULTS.md "$OUT/" ;;
  *)
    echo "$usage" >&2; exit 2 ;;
esac
