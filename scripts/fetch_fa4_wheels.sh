#!/usr/bin/env bash
# Fetches, into DIR (default: the git-ignored .whl/fa4), the fa4 backend's wheels for the GPU
# machine (Python 3.12, x86-64): flash-attn-4, quack-kernels, torch-c-dlpack-ext and
# nvidia-cutlass-dsl[cu13] without the cu12 libraries (the machine's driver and JAX are CUDA 13;
# it already has cuda-bindings, cuda-pathfinder and einops). The cu13 libraries are one 88 MiB
# wheel, over one carry's 64 MiB, so it is split into parts of 30 MiB (DIR/part.*) that go over in
# separate calls while the machine stays warm; scripts/device_fa4.sh puts them back together.
#
#   scripts/fetch_fa4_wheels.sh
#   device call 1, carry [DIR/part.aa, DIR/wheels, ...]:  scripts/device_fa4.sh stash
#   device call 2, carry [DIR/part.ab, ...]:              scripts/device_fa4.sh stash
#   device call 3, carry [DIR/part.ac, ...]:              scripts/device_fa4.sh stash install && <command>
# The "..." share each carry with .whl's other wheels (../shared/device/fetch_wheels.sh), which stay
# on the warm machine once carried: e.g. call 1 also the cudnn-frontend, jax-triton and tvm-ffi
# wheels, call 2 flashinfer's, call 3 .whl_peers without its flashinfer copy and headers (52, 57 and
# 59 MiB). A warm machine goes back 30 s after a call ends: send the three calls back to back.
#   (then, in every call: export PYTHONPATH=$(scripts/device_fa4.sh path):$PYTHONPATH)
set -euo pipefail
dir=${1:-.whl/fa4}
mkdir -p "$dir/wheels"
pyargs=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q "${pyargs[@]}" -d "$dir/wheels" flash-attn-4==4.0.0b36 quack-kernels==0.6.5 \
  torch-c-dlpack-ext==0.1.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
  nvidia-cutlass-dsl-libs-base==4.8.1
tmp=$(mktemp -d)
python3 -m pip download -q "${pyargs[@]}" -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
rm -f "$dir"/part.*
split -b 30M "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl "$dir/part."
basename "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl > "$dir/wheels/cu13.name"
rm -rf "$tmp"
du -sh "$dir"/wheels "$dir"/part.*
