"""Loads the cuDNN paged-prefill FFI library (``jaxattn._cudnn_paged``) and registers it with JAX.

The library is built by the pip install when CUDA, cuDNN, cudnn-frontend and XLA FFI headers are
found (see CMakeLists.txt); it runs on the ``libcudnn.so.9`` of the ``nvidia-cudnn-cu13`` wheel, the
copy JAX itself loads. Everything here is lazy and cached: importing this module needs no GPU.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any

import jax

from jaxattn.backends import base

TARGET = "jaxattn_cudnn_paged_prefill"
STATE_TYPE = "jaxattn_cudnn_paged_prefill_state"
# Paged K/V with packed ragged Q works from 9.10.2 (9.10.0/9.10.1 have known SDPA bugs).
MIN_CUDNN_VERSION = 91002


def format_version(version: int) -> str:
    """91900 -> '9.19.0'."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def _wheel_file(package: str, *parts: str) -> str | None:
    """A file inside an installed (namespace) package, e.g. nvidia.cudnn/lib/libcudnn.so.9."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, *parts)
        if os.path.isfile(path):
            return path
    return None


@functools.cache
def import_library() -> tuple[ModuleType | None, str | None]:
    """(module, None) when the handler library was built and imports (no GPU needed), else
    (None, why not). It links libcudnn.so.9 and libnvrtc.so.13: the wheels' copies, the ones JAX
    uses, are loaded first (by soname otherwise)."""
    try:
        build = importlib.import_module("jaxattn._cudnn_build")
    except ImportError:
        return None, ("jaxattn's native library was not built: install jaxattn with pip "
                      "(pip install -e .) on a machine with nvcc and the cuDNN headers")
    if not build.BUILT:
        return None, f"the cuDNN paged-prefill library was not built: {build.REASON}"
    for package, name in (("nvidia.cudnn", "libcudnn.so.9"), ("nvidia.cu13", "libnvrtc.so.13")):
        try:
            ctypes.CDLL(_wheel_file(package, "lib", name) or name, mode=ctypes.RTLD_GLOBAL)
        except OSError as err:
            return None, f"cannot load {name} (install nvidia-cudnn-cu13 / nvidia-cuda-nvrtc): {err}"
    try:
        return importlib.import_module("jaxattn._cudnn_paged"), None
    except ImportError as err:
        return None, f"cannot import the cuDNN paged-prefill library jaxattn._cudnn_paged: {err}"


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    """(library, None) when the backend can run here, else (None, the reason it cannot)."""
    if not base.gpu_devices():   # first: without a GPU, how the library was built does not matter
        return None, base.NO_GPU
    lib, reason = import_library()
    if lib is None:
        return None, reason
    version = lib.backend_version()
    if version < MIN_CUDNN_VERSION or version in (91000, 91001):
        return None, (f"cuDNN {format_version(version)} is too old: paged prefill with packed ragged "
                      f"queries needs >= {format_version(MIN_CUDNN_VERSION)}")
    jax.ffi.register_ffi_type(STATE_TYPE, lib.state_type(), platform="CUDA")
    jax.ffi.register_ffi_target(TARGET, lib.handlers(), platform="CUDA")
    return lib, None


def unavailable_reason() -> str | None:
    """None when the cuDNN paged prefill can run here, else the exact reason it cannot."""
    return _load()[1]


def library() -> ModuleType:
    """The loaded and registered library; RuntimeError when unavailable."""
    lib, reason = _load()
    if lib is None:
        raise RuntimeError(reason)
    return lib


def cudnn_version() -> int | None:
    """Version of the cuDNN library the backend runs (e.g. 91900), None when unavailable."""
    lib, _ = _load()
    return None if lib is None else lib.backend_version()


def workspace_size(config: dict[str, Any]) -> int:
    """Workspace bytes of the plan for ``config`` (the FFI attributes), building it now on the
    current device; ValueError with cuDNN's reason when it cannot be built."""
    try:
        return library().workspace_size(config)
    except RuntimeError as err:
        raise ValueError(f"paged_attention(backend='cudnn'): cuDNN cannot run this configuration: {err}") from None
