"""What every backend module provides, and the static parameters they share.

A backend module defines:
  NAME: str
  unavailable_reason() -> str | None       # None when it can run here
  check_supported(q, cache, meta, params)  # raises ValueError naming the unsupported parameter
  attention(q, cache, meta, params, sinks) -> [T, Hq, D]
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """Static (hashable) attention options, already validated by ``paged_attention``."""

    scale: float
    causal: bool
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool
