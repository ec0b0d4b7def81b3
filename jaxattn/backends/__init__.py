"""Backend registry: the kernels ``paged_attention`` can dispatch to, and why one cannot run here."""

from __future__ import annotations

import importlib
from types import ModuleType

from jaxattn.backends.base import AttentionParams

BACKENDS: tuple[str, ...] = ("xla", "cudnn", "trtllm", "triton")

def get(name: str) -> ModuleType:
    """The backend module ``jaxattn.backends.<name>``; ValueError if it cannot run here."""
    if name not in BACKENDS:
        raise ValueError(f"paged_attention: backend must be one of {('auto',) + BACKENDS}, got {name!r}")
    reason = unavailable_reason(name)
    if reason is not None:
        raise ValueError(f"paged_attention: backend {name!r} is not available: {reason}")
    return importlib.import_module(f"jaxattn.backends.{name}")


def unavailable_reason(name: str) -> str | None:
    """None when backend ``name`` can run on this machine, else the exact reason it cannot."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {BACKENDS}")
    return importlib.import_module(f"jaxattn.backends.{name}").unavailable_reason()


__all__ = ["AttentionParams", "BACKENDS", "get", "unavailable_reason"]
