"""Backend registry: the kernels ``paged_attention`` can dispatch to, and why one cannot run here."""

from __future__ import annotations

import importlib
from types import ModuleType

from jaxattn.backends.base import AttentionParams

BACKENDS: tuple[str, ...] = ("xla", "cudnn", "trtllm", "triton")
# Backends of jaxattn.mla only (no paged_attention).
MLA_ONLY_BACKENDS: tuple[str, ...] = ("flashinfer",)
ALL_BACKENDS = BACKENDS + MLA_ONLY_BACKENDS


def get(name: str) -> ModuleType:
    """The backend module ``jaxattn.backends.<name>``; ValueError if it cannot run here."""
    if name not in ALL_BACKENDS:
        raise ValueError(f"paged_attention: backend must be one of {('auto',) + BACKENDS}, got {name!r}")
    reason = unavailable_reason(name)
    if reason is not None:
        raise ValueError(f"paged_attention: backend {name!r} is not available: {reason}")
    return importlib.import_module(f"jaxattn.backends.{name}")


def unavailable_reason(name: str) -> str | None:
    """None when backend ``name`` can run on this machine, else the exact reason it cannot."""
    if name not in ALL_BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {ALL_BACKENDS}")
    return importlib.import_module(f"jaxattn.backends.{name}").unavailable_reason()


OPS: tuple[str, ...] = ("paged_attention", "mla_paged_attention", "mla_prefill")


def check_serves(backend: str, ops, *, where: str) -> None:
    """ValueError (prefixed by ``where``) unless ``backend`` ("auto" or a backend's name) can run
    every op of ``ops`` on this machine. (Interim: the registry replaces this body.)"""
    if backend == "auto":
        return
    if not isinstance(backend, str) or backend not in ALL_BACKENDS:
        raise ValueError(f"{where}: backend must be 'auto' or one of {ALL_BACKENDS}, got {backend!r}")
    reason = unavailable_reason(backend)
    if reason is not None:
        raise ValueError(f"{where}: backend {backend!r} cannot run here: {reason}")


__all__ = ["OPS", "check_serves", "ALL_BACKENDS", "AttentionParams", "BACKENDS", "MLA_ONLY_BACKENDS", "get", "unavailable_reason"]
