#!/usr/bin/env bash
# Fetches, into DIR (default: the git-ignored .whl_moe), tokamax and the pure-Python dependencies the
# GPU machine's image lacks (Python 3.12, x86-64; about 38 MiB, one carry), for benchmarks/bench_moe.py's
# "tokamax" row (tokamax.ragged_dot; tokamax needs jax >= 0.11.1, as the GPU machine has, not the CPU
# machines' 0.10.2). `import tokamax` imports its benchmarking and TPU modules too, hence xprof
# (>= 2.23.1: xprof.cli.tools, which imports fire, which needs termcolor), tensorboardx, qwix and pydantic (with the
# typing-extensions it needs). Not yet tried on the GPU machine: a module still missing there
# names itself in bench_moe's ImportError.
# On the GPU machine, with DIR carried:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_moe DIR/*.whl
#   PYTHONPATH=/tmp/site_moe:$PWD python3 -m benchmarks.bench_moe ...
set -euo pipefail
dir=${1:-.whl_moe}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$dir" tokamax==0.0.17 einshape qwix immutabledict tensorboardx \
  "xprof>=2.23.1" fire termcolor pydantic pydantic-core annotated-types typing-inspection "typing-extensions>=4.16"
du -sh "$dir"
