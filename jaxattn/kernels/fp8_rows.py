"""FP8 activations of the FP8 GEMMs (the Triton grouped GEMM's FP8 rows, ``Fp8Linear``'s W8A8):
rows quantized to float8_e4m3fn with their own scales. Plain jnp, so the models import it without
Triton (``grouped_gemm`` re-exports it beside its kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)      # 448


def quantize_rows(rows: jax.Array, group: int | None = None) -> tuple[jax.Array, jax.Array]:
    """``(float8_e4m3fn [R, K], float32 scales [R, ceil(K / group)])`` of ``rows [R, K]``: each
    ``group`` columns of a row (default: the whole row) over their largest magnitude / 448 (1 where
    all are zero), the FP8 rows of a ``row_scale``d ``grouped_gemm`` (``fp8_row_group``)."""
    num_rows, k = rows.shape
    if group is not None and group < 1:
        raise ValueError(f"quantize_rows: group must be a positive number of columns, got {group}")
    group = min(group or k, k)
    groups = -(-k // group)
    padded = jnp.pad(rows.astype(jnp.float32), ((0, 0), (0, groups * group - k))).reshape(num_rows, groups, group)
    amax = jnp.max(jnp.abs(padded), axis=2)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    values = jnp.clip(padded / scale[:, :, None], -FP8_MAX, FP8_MAX).reshape(num_rows, -1)[:, :k]
    return values.astype(jnp.float8_e4m3fn), scale
