#!/usr/bin/env bash
# On the GPU machine: brings the fa4 backend's wheels (scripts/fetch_fa4_wheels.sh) over several
# carries and installs them where every later call of a warm machine finds them.
#
#   scripts/device_fa4.sh stash      # copies the carried parts and wheels of DIR to /tmp/fa4_stash
#   scripts/device_fa4.sh install    # joins the cu13 parts, installs everything to /tmp/site_fa4
#                                    # (its import check needs apache-tvm-ffi, from .whl, on PYTHONPATH)
#   scripts/device_fa4.sh path       # prints what PYTHONPATH needs (cutlass's .pth is not read there)
set -euo pipefail
dir=${FA4_DIR:-.whl/fa4}
stash=/tmp/fa4_stash
site=/tmp/site_fa4
for step in "$@"; do
  case "$step" in
    stash)
      mkdir -p "$stash"
      cp "$dir"/part.* "$stash"/ 2>/dev/null || true
      cp "$dir"/wheels/* "$stash"/ 2>/dev/null || true
      ls "$stash" ;;
    install)
      name=$(cat "$stash/cu13.name")
      cat "$stash"/part.* > "$stash/$name"
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$stash"/*.whl
      PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH} \
        python3 -c "import cutlass.jax, flash_attn.cute.flash_fwd_sm90; print('fa4 backend wheels installed')" ;;
    path)
      echo "$site:$site/nvidia_cutlass_dsl/dsl_packages" ;;
    *)
      echo "usage: $0 stash|install|path ..." >&2; exit 2 ;;
  esac
done
