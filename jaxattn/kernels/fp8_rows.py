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
    scale = scales_of(jnp.max(jnp.abs(padded), axis=2))
    return round_rows(rows, scale), scale


def round_rows(rows: jax.Array, scale: jax.Array) -> jax.Array:
    """float8_e4m3fn ``rows [R, K]`` over their ``scale float32[R, G]`` (each scale covering
    ``ceil(K / G)`` columns), clipped to the finite range, rounded to nearest."""
    num_rows, k = rows.shape
    group = -(-k // scale.shape[1])
    padded = jnp.pad(rows.astype(jnp.float32), ((0, 0), (0, scale.shape[1] * group - k)))
    values = jnp.clip(padded.reshape(num_rows, -1, group) / scale[:, :, None], -FP8_MAX, FP8_MAX)
    return values.reshape(num_rows, -1)[:, :k].astype(jnp.float8_e4m3fn)


def scales_of(amax: jax.Array) -> jax.Array:
    """The float32 scales of values whose largest magnitudes are ``amax`` (any shape): ``amax /
    448``, 1 where it is 0. ``grouped_gemm`` rounds rows by such scales in the kernel (rows in the
    model's dtype with ``row_scale``) exactly as ``quantize_rows`` does."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0)
