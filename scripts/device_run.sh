#!/usr/bin/env bash
# Runs on the lent GPU machine, from the repository root, with the wheels it lacks carried as .whl/
# (fetch them here with ../shared/device/fetch_wheels.sh). Installs them and jaxattn (building the
# FFI handlers), then runs the GPU tests and whatever command follows, logging under $OUT.
#
#   scripts/device_run.sh                                   # GPU tests only
#   scripts/device_run.sh python -m benchmarks.bench_xxx    # GPU tests, then a benchmark
set -uo pipefail
OUT=${OUT:-/tmp/jaxattn_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
  || { tail -40 "$OUT/install.log"; echo "jaxattn install failed"; exit 1; }
python3 -m jaxattn.info 2>&1 | tee "$OUT/info.txt"
python3 -m pytest -m gpu -q -rs ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
status=${PIPESTATUS[0]}
if [ $# -gt 0 ]; then
  "$@" 2>&1 | tee "$OUT/command.log"
  status=$(( status | PIPESTATUS[0] ))
fi
exit $status
