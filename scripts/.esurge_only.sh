#!/usr/bin/env bash
# eSurge chat alone on a fresh machine (git-ignored)
python3 -m pip install -q --no-index --no-deps --target /tmp/site_esurge .whl_esurge/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=/tmp/site_esurge:$PWD/benchmarks/esurge_stubs:$PWD PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout -k 5 "$1" python3 -m benchmarks.bench_esurge --trace chat --against .whl_esurge/serving_chat_results.md > $OUT/esurge.log 2>&1
echo "rc=$? wall=$(( $(date +%s) - t0 ))s" | tee -a $OUT/esurge.log
cp benchmarks/RESULTS.md $OUT/; tail -25 $OUT/esurge.log
