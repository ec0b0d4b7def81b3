"""What every backend module provides, and the static parameters they share.

A backend module defines:
  NAME: str
  unavailable_reason() -> str | None       # None when it can run here
  check_supported(q, cache, meta, params)  # raises ValueError naming the unsupported parameter
  attention(q, cache, meta, params, sinks) -> [T, Hq, D]

``paged_attention`` hands ``attention`` sanitized metadata (``AttentionMetadata.sanitize``): offsets
non-decreasing within ``[0, T]``, ``kv_lens`` within the block tables' width and 0 for sequences
that broke the contract, and every block-table entry a page id in ``[0, num_pages)``. Backends
rely on this; only the Triton kernels keep an in-kernel bound on page ids, a guard that costs one
select per tile.
"""

from __future__ import annotations

import dataclasses

import jax

NO_GPU = "no NVIDIA GPU is visible to JAX (jax.devices('gpu') is empty)"


def gpu_devices() -> list[jax.Device]:
    """JAX's GPU devices; empty on a machine (or a jax install) without one."""
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """Static (hashable) attention options, already validated by ``paged_attention``."""

    scale: float
    causal: bool
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool
