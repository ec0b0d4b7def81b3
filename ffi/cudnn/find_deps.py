"""Locates the headers the cuDNN paged-prefill handler builds against.

Run by CMake with the interpreter of the build. Prints ``NAME=PATH`` lines for what it finds:
  xla_ffi_include         jaxlib/include (xla/ffi/api/ffi.h), from the jaxlib that will load the handler
  cudnn_include           nvidia/cudnn/include (cudnn.h), from the nvidia-cudnn-cu13 wheel JAX loads
  cudnn_frontend_include  include/ (cudnn_frontend.h) of the nvidia-cudnn-frontend wheel
  nvrtc_include           nvidia/cu13/include (nvrtc.h; cudnn-frontend includes it), from nvidia-cuda-nvrtc
The installation's own site-packages (sysconfig) come first, so an isolated pip build still builds
against the packages installed next to jaxattn rather than newer ones in its build environment;
then, in a virtual environment that sees the system site-packages, the base Python's.
"""

from __future__ import annotations

import os
import sys
import sysconfig

WANTED = {
    "xla_ffi_include": ("jaxlib/include", "xla/ffi/api/ffi.h"),
    "cudnn_include": ("nvidia/cudnn/include", "cudnn.h"),
    "cudnn_frontend_include": ("include", "cudnn_frontend.h"),
    "nvrtc_include": ("nvidia/cu13/include", "nvrtc.h"),
}


def _sees_system_site_packages() -> bool:
    """A virtual environment made with --system-site-packages also imports the base Python's."""
    cfg = os.path.join(sys.prefix, "pyvenv.cfg")
    if sys.prefix == sys.base_prefix or not os.path.isfile(cfg):
        return False
    with open(cfg) as f:
        return any(line.split("=")[0].strip() == "include-system-site-packages" and
                   line.split("=", 1)[1].strip().lower() == "true" for line in f if "=" in line)


def search_roots() -> list[str]:
    keys = ("platlib", "purelib")
    roots = [sysconfig.get_paths()[key] for key in keys]
    if _sees_system_site_packages():
        base = {"base": sys.base_prefix, "platbase": sys.base_prefix}
        roots += [sysconfig.get_paths(vars=base)[key] for key in keys]
    roots += sys.path
    unique = []
    for root in roots:
        if root and os.path.isdir(root) and root not in unique:
            unique.append(root)
    return unique


def main() -> None:
    roots = search_roots()
    for name, (folder, marker) in WANTED.items():
        for root in roots:
            path = os.path.join(root, folder)
            if os.path.isfile(os.path.join(path, marker)):
                print(f"{name}={path}")
                break


if __name__ == "__main__":
    main()
