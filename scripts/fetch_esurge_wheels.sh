#!/usr/bin/env bash
# Fetches, into DIR (default: the git-ignored .whl_esurge), what EasyDeL's eSurge needs on the GPU
# machine (Python 3.12, x86-64) beyond what it has, for benchmarks/esurge_smoke.py: easydel 0.3.0,
# eformer, ejkernel 0.0.78 and the packages their import reaches that the machine's image lacks
# (KINDS.md's list; fastapi, uvicorn and pydantic come from easydel's tool-calling and server
# modules, which eSurge's import loads: checked on CPU with the image's missing packages made
# unimportable, after pydantic then fastapi stopped the 2026-11-28 device run; fastapi imports
# opentelemetry-api, which stopped the next run) (about 20 MiB). Not fetched:
# ray, wandb, datasets, gcsfs, grain (never imported for eSurge; ray and google.cloud.storage are
# imported at the top and stand in from benchmarks/esurge_stubs), flax 0.12.3 (the smoke patches
# the one hash that 0.12.3 has and later flax lacks).
#   scripts/fetch_esurge_wheels.sh
#   device call, carry [.whl_esurge, ...]:
#     pip install -q --no-index --no-deps --target /tmp/site_esurge .whl_esurge/*.whl
#     PYTHONPATH=/tmp/site_esurge:benchmarks/esurge_stubs:$PYTHONPATH python3 -m benchmarks.esurge_smoke
set -euo pipefail
dir=${1:-.whl_esurge}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dir" \
  easydel==0.3.0 eformer==0.0.99.12 ejkernel==0.0.78 contextlib2==21.6.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 \
  beartype==0.23.1 chex==0.1.92 toolz==1.2.0 einops==0.8.2 msgspec==0.19.0 pyzmq==27.3.0 \
  partial-json-parser==0.2.1.1.post7 pillow==13.0.0 plum-dispatch==2.3.2 braceexpand==0.1.7 \
  fastapi==0.165.0 annotated-doc==0.0.7 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4 \
  annotated-types==0.7.0 typing-inspection==0.4.2 typing-extensions==4.16.0 opentelemetry-api==1.45.2
du -sh "$dir"
