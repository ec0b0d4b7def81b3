#!/usr/bin/env bash
# Runs on the lent GPU machine, from the repository root, with the wheels it lacks carried as .whl/
# (fetch them here with ../shared/device/fetch_wheels.sh). Installs them and jaxattn (building the
# FFI handlers), then runs the GPU tests and whatever command follows, logging under $OUT.
#
#   scripts/device_run.sh                                   # GPU tests only
#   scripts/device_run.sh python -m benchmarks.bench_xxx    # GPU tests, then a benchmark
#   PYTEST_ARGS="--shard 2/3" scripts/device_run.sh         # the second third of the GPU tests
#   GPU_SHARDS="1/6 2/6" scripts/device_run.sh              # 2 GPUs: shards 1/6 and 2/6 at once, one per GPU
#   GPU_SHARDS="1/8 ... 8/8" SHARD_LIMIT=540 scripts/device_run.sh  # 4 GPUs, two shards each, each cut at 540 s
#   PYTEST_ARGS="-m multigpu" scripts/device_run.sh         # the tests that need 2 or more GPUs
#
# On a fresh machine the whole GPU suite outlasts one 10-minute call (the first use of each XQA
# variant compiles it): run it in shards, one call each, on the same warm machine.
#
# JAXATTN_PREBUILT=dir uses a handler module built elsewhere (e.g. by Bazel: _cudnn_paged.so and
# _cudnn_build.py from bazel-bin/jaxattn/, carried) instead of building one with pip.
#
# At most 8 files come back from the device's $OUT: on exit, more than that are packed into
# $OUT/out.tgz (a run the device tool's limit kills never reaches that: keep SHARD_LIMIT and the
# command's own limits below the call's).
set -uo pipefail
OUT=${OUT:-/tmp/jaxattn_out}
mkdir -p "$OUT"
pack() {
  if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
    (cd "$OUT" && tar czf /tmp/jaxattn_out.tgz . && find . -mindepth 1 -delete && mv /tmp/jaxattn_out.tgz out.tgz)
  fi
}
trap pack EXIT
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -n "${JAXATTN_PREBUILT:-}" ]; then
  cp "$JAXATTN_PREBUILT"/_cudnn_paged*.so "$JAXATTN_PREBUILT"/_cudnn_build.py jaxattn/ || exit 1
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
    || { tail -40 "$OUT/install.log"; echo "jaxattn install failed"; exit 1; }
fi
python3 -m jaxattn.info 2>&1 | tee "$OUT/info.txt"
if [ -n "${GPU_SHARDS:-}" ]; then
  # Shards of the GPU tests side by side, dealt round-robin over the GPUs: device time is the
  # machine's held time whatever its GPUs do, and the suite is mostly compile time (CPU), so a GPU
  # may take two shards; then each process gets a share of its memory instead of XLA's 75%.
  # Each test is logged (-v) so that a shard cut at SHARD_LIMIT seconds still says what ran.
  num_gpus=$(nvidia-smi -L | wc -l)
  read -ra shards <<< "$GPU_SHARDS"
  per_gpu=$(( (${#shards[@]} + num_gpus - 1) / num_gpus ))
  if [ "$per_gpu" -gt 1 ]; then
    export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / $per_gpu, 2))")
  fi
  pids=()
  i=0
  for shard in "${shards[@]}"; do
    log="$OUT/gpu_tests_${shard//\//_of_}.log"
    CUDA_VISIBLE_DEVICES=$(( i % num_gpus )) timeout "${SHARD_LIMIT:-0}" \
      python3 -m pytest -m gpu -v -rs --shard "$shard" ${PYTEST_ARGS:-} > "$log" 2>&1 &
    pids+=($!)
    i=$((i + 1))
  done
  status=0
  for pid in "${pids[@]}"; do
    wait "$pid" || status=1
  done
  for shard in "${shards[@]}"; do
    echo "== shard $shard: $(tail -1 "$OUT/gpu_tests_${shard//\//_of_}.log")"
  done
else
  python3 -m pytest -m gpu -q -rs ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if [ $# -gt 0 ]; then
  "$@" 2>&1 | tee "$OUT/command.log"
  status=$(( status | PIPESTATUS[0] ))
fi
exit $status
