#!/usr/bin/env bash
# Fetches, into DIR (default: the git-ignored .whl_serve), the `serve` extra's packages that the GPU
# machine's image lacks (KINDS.md's list: it has uvloop, h11, anyio, httpx, jinja2, tokenizers,
# prometheus-client, click, annotated-doc), for Python 3.12 / x86-64: what `python -m jaxattn.serve`
# and benchmarks/bench_http.py import there (fastapi 0.165 imports opentelemetry-api). About 7 MiB, one carry.
#
#   scripts/fetch_serve_wheels.sh
#   device call, carry [.whl_serve]:
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_serve .whl_serve/*.whl
#     export PYTHONPATH=/tmp/site_serve:$PYTHONPATH
set -euo pipefail
dir=${1:-.whl_serve}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$dir" fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.7.1 pydantic==2.13.4 \
  pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0 \
  opentelemetry-api==1.45.2 importlib-metadata==10.2.0 "llguidance>=1.0,<2"
du -sh "$dir"
