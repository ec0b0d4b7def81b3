#!/usr/bin/env bash
# Fetches, into DIR (default: the git-ignored .whl_peers), what benchmarks/bench_jax_peers.py needs
# on the GPU machine (Python 3.12, x86-64), in one carry of under 64 MiB:
#   * the JAX peers and their pure-Python dependencies the machine lacks: flash-attn3-jax (its
#     own CUDA 12 runtime inside), ejkernel, fa4-jax (with cutejax and jax-tvm-ffi 0.1.2, the
#     release cutejax's pin resolves to), beartype, jaxtyping, chex, einops, pydantic, tqdm...;
#   * jaxattn's own needs from .whl (../shared/device/fetch_wheels.sh): flashinfer-python (XQA
#     sources), and cudnn-frontend's headers alone (DIR/headers/include) for the cuDNN
#     handler's build, without its 11 MiB of Python modules.
# Not here (the carry would pass 64 MiB), installed on the machine beforehand: the CuTe DSL that
# fa4-jax and jaxattn's fa4 backend compile with, nvidia-cutlass-dsl[cu13]==4.8.1 (its CUDA 13
# libraries alone are 88 MiB), apache-tvm-ffi (.whl; jax-tvm-ffi loads it), and the fa4 backend's
# flash-attn-4, quack-kernels and torch-c-dlpack-ext.
# On the GPU machine, with DIR carried:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site:$PWD/DIR/headers      # then pip install --no-deps --no-build-isolation -e .
set -euo pipefail
dir=${1:-.whl_peers}
whl=$(cd "${WHL:-.whl}" && pwd)
mkdir -p "$dir"
pyargs=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir")
python3 -m pip download -q "${pyargs[@]}" flash-attn3-jax==0.2.3 ejkernel==0.0.80.3 beartype jaxtyping wadler-lindig \
  einops pydantic==2.14.3 pydantic-core==2.50.4 annotated-types typing-inspection typing-extensions tqdm chex toolz absl-py \
  fa4-jax==0.1.0 cutejax==0.1.5 jax-tvm-ffi==0.1.2
cp "$whl"/flashinfer_python-*.whl "$dir"/
mkdir -p "$dir/headers"
(cd "$dir/headers" && python3 -m zipfile -e "$whl"/nvidia_cudnn_frontend-*.whl . && \
  find . -mindepth 1 -maxdepth 1 ! -name include -exec rm -rf {} +)
du -sh "$dir"
