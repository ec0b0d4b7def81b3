"""The backend registry: every backend, the ops it implements, and whether it can take a call.

Each backend is one module of this package that defines ``BACKEND`` (a ``base.Backend``: where it
runs, and for each op it implements the kernel entry, capabilities as data, the remaining limits
and ``auto``'s rank); ``REGISTRY`` lists them. Adding a backend is that module plus one entry
below. ``jaxattn.dispatch`` chooses among them for every op.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from jaxattn.backends import cudnn, fa4, flashinfer, triton, trtllm, xla
from jaxattn.backends.base import OPS, AttentionParams, Backend, Call, arch_reason

REGISTRY: dict[str, Backend] = {
    backend.name: backend
    for backend in (xla.BACKEND, cudnn.BACKEND, trtllm.BACKEND, triton.BACKEND, flashinfer.BACKEND, fa4.BACKEND)
}
ALL_BACKENDS: tuple[str, ...] = tuple(REGISTRY)


def names(op: str) -> tuple[str, ...]:
    """The backends that implement ``op``, in registry order."""
    return tuple(name for name, backend in REGISTRY.items() if op in backend.ops)


def get(name: str) -> Backend:
    """The registry entry of ``name``; ValueError for an unknown name."""
    if name not in REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known: {ALL_BACKENDS}")
    return REGISTRY[name]


@functools.cache
def unavailable_reason(name: str) -> str | None:
    """None when backend ``name`` can run on this machine, else the exact reason it cannot."""
    backend = get(name)
    return arch_reason(backend.archs) or backend.requirements()


def check(name: str, call: Call) -> str | None:
    """None when backend ``name`` runs here and takes ``call``, else why not (no prefix)."""
    return unavailable_reason(name) or takes(name, call)


def takes(name: str, call: Call) -> str | None:
    """None when backend ``name`` takes ``call`` wherever it runs (its op, capabilities and
    limits; not whether it runs on this machine), else why not."""
    support = get(name).ops.get(call.op)
    if support is None:
        return f"it does not implement {call.op} (it implements {', '.join(get(name).ops)})"
    return support.capabilities.reason(call) or support.check(call)


def check_serves(backend: str, ops: Iterable[str], *, where: str) -> None:
    """ValueError (prefixed by ``where``) unless ``backend`` ("auto" or a backend's name) implements
    every op of ``ops`` and can run on this machine. A call's shapes are checked when it is traced."""
    if backend == "auto":
        return
    if not isinstance(backend, str) or backend not in REGISTRY:
        raise ValueError(f"{where}: backend must be 'auto' or one of {ALL_BACKENDS}, got {backend!r}")
    missing = [op for op in ops if op not in REGISTRY[backend].ops]
    if missing:
        raise ValueError(f"{where}: backend {backend!r} does not implement {', '.join(missing)}, which the model "
                         f"runs (it implements {', '.join(REGISTRY[backend].ops)}); use 'auto' or one of "
                         f"{tuple(n for n in ALL_BACKENDS if all(op in REGISTRY[n].ops for op in ops))}")
    reason = unavailable_reason(backend)
    if reason is not None:
        raise ValueError(f"{where}: backend {backend!r} cannot run here: {reason}")


__all__ = ["ALL_BACKENDS", "OPS", "REGISTRY", "AttentionParams", "Backend", "Call", "check", "check_serves", "get",
           "names", "takes", "unavailable_reason"]
