#!/usr/bin/env bash
# Runs pytest cases one per process under compute-sanitizer's memcheck, on the GPU machine after
# scripts/device_run.sh has installed jaxattn (same shell environment: PYTHONPATH=/tmp/site...).
# Logs go to $OUT/memcheck_<case>.log; prints each case's sanitizer summary.
#
#   scripts/memcheck.sh SECONDS 'tests/test_metadata.py::test_x[xla-4]' ...
#
# XLA's autotuner would launch thousands of candidate kernels under the sanitizer: it is off, and
# the platform allocator lets memcheck see each buffer's bounds instead of one BFC arena. Failed
# CUDA API calls are not reported: the CuTe DSL's cuda-python driver bindings (fa4) probe
# cuGetProcAddress for entry points this driver lacks, which memcheck would count as errors.
# Each case first runs once without the sanitizer: kernels compiled on first use (XQA's nvcc run)
# are then cached, and nvcc run under the sanitizer crashes it.
set -uo pipefail
OUT=${OUT:-/tmp/jaxattn_out}
limit=$1
shift
sanitizer=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
status=0
for case in "$@"; do
  python3 -m pytest -q -p no:cacheprovider "$case" > /dev/null 2>&1
  log="$OUT/memcheck_$(echo "$case" | sed 's/.*:://; s/[^A-Za-z0-9_-]/_/g').log"
  XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="--xla_gpu_autotune_level=0 ${XLA_FLAGS:-}" \
    timeout "$limit" "$sanitizer" --tool memcheck --report-api-errors no --error-exitcode 99 ${MEMCHECK_ARGS:-} \
    python3 -m pytest -q -p no:cacheprovider "$case" > "$log" 2>&1
  rc=$?
  echo "== $case: exit $rc; $(grep -E 'ERROR SUMMARY|passed|failed|skipped' "$log" | tr '\n' ' ')"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
