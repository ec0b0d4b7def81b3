"""``python -m jaxattn.info``: versions, GPU, and which backends can run here (and why not).

Paste its output into bug reports.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import jax

from jaxattn import __version__, _ffi_cudnn, backends, choice_table
from jaxattn.backends.base import gpu_devices

# (label, distribution names tried in order)
_PACKAGES = (
    ("jax", ("jax",)),
    ("jaxlib", ("jaxlib",)),
    ("jax CUDA plugin", ("jax-cuda13-plugin", "jax-cuda12-plugin")),
    ("cuDNN (pip)", ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")),
    ("cudnn-frontend", ("nvidia-cudnn-frontend",)),
    ("flashinfer", ("flashinfer-python",)),
    ("triton", ("triton",)),
    ("flax", ("flax",)),
    ("torch", ("torch",)),
)


def package_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return f"{importlib.metadata.version(name)} ({name})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cuda_library_versions() -> dict[str, str]:
    """Versions of the CUDA libraries JAX loaded (empty without the CUDA plugin)."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return {}
    if cuda_versions is None:
        return {}
    # name -> (probe, decoding of its integer version)
    probes = {
        "cuDNN (loaded)": ("cudnn_get_version", lambda v: f"{v // 10000}.{v // 100 % 100}.{v % 100}"),
        "CUDA runtime": ("cuda_runtime_get_version", lambda v: f"{v // 1000}.{v % 1000 // 10}"),
        "CUDA driver": ("cuda_driver_get_version", lambda v: f"{v // 1000}.{v % 1000 // 10}"),
    }
    found = {}
    for label, (fn, decode) in probes.items():
        try:
            found[label] = decode(int(getattr(cuda_versions, fn)()))
        except Exception as err:  # a missing library is information, not a failure
            found[label] = f"unavailable ({err})"
    return found


def gpus() -> list[str]:
    return [f"{d.id}: {d.device_kind}, compute capability {getattr(d, 'compute_capability', '?')}"
            for d in gpu_devices()]


def report() -> str:
    lines = [f"jaxattn {__version__}", f"Python {sys.version.split()[0]} on {platform.platform()}", ""]
    lines.append("Packages:")
    for label, names in _PACKAGES:
        lines.append(f"  {label:<16} {package_version(names) or 'not installed'}")
    for label, version in cuda_library_versions().items():
        lines.append(f"  {label:<16} {version}")
    lines.append(f"  {'cuDNN handler':<16} {cudnn_handler_status()}")
    lines += ["", f"JAX default backend: {jax.default_backend()}", "GPUs:"]
    lines += [f"  {g}" for g in gpus()] or ["  none"]
    lines += ["", "jaxattn backends:"]
    for name, backend in backends.REGISTRY.items():
        reason = backends.unavailable_reason(name)
        lines.append(f"  {name:<10} {'available' if reason is None else 'unavailable: ' + reason}")
        lines.append(f"  {'':<10} {backend.kernel}; runs on {', '.join(backend.archs)}")
    lines += ["", f"auto's measured table: {choice_table.describe_current_table()}"]
    lines += ["", "Ops x backends (what each takes; auto ranks them per call):"]
    for op in backends.OPS:
        lines.append(f"  {op}:")
        for name in backends.names(op):
            lines.append(f"    {name:<10} {backends.REGISTRY[name].ops[op].capabilities.describe()}")
    return "\n".join(lines)


def cudnn_handler_status() -> str:
    """Whether the cuDNN paged-prefill handler was built and loads; install advice only where a GPU
    could run it."""
    _, not_built = _ffi_cudnn.import_library()
    if not_built is None:
        return "built"
    if not gpu_devices():
        return "not loaded (only needed on a machine with an NVIDIA GPU)"
    return not_built


if __name__ == "__main__":
    print(report())
