"""MLA latents expanded to per-head keys and values, for backends that run ``mla_prefill`` as
ordinary multi-head attention (``jaxattn.mla`` has the formulas): as page pools of K and V
(``expanded_pages``), or as one KVCache with V padded to K's width (``expanded_pool``)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxattn.backends.base import AttentionParams
from jaxattn.kv_cache import KVCache, MLACache
from jaxattn.metadata import AttentionMetadata


def expand_latents(cache: MLACache, meta: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array,
                   dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Every sequence's keys ``k = [c_kv W_UK[:, h], k_rope]`` ``[B, P, page, Hq, Dn + Dr]`` and
    values ``v = c_kv W_UV[:, h]`` ``[B, P, page, Hq, Dv]`` from the latents of its table's pages
    (sanitized ``meta``), in ``dtype`` (float32 accumulation), zero past its ``kv_lens`` (stale
    slots never reach a kernel): ``expand`` of ``step_latents``."""
    return expand(step_latents(cache, meta, dtype), w_uk, w_uv, cache.rope_dim, dtype)


def step_latents(cache: MLACache, meta: AttentionMetadata, dtype: jnp.dtype) -> jax.Array:
    """The latents of every sequence's table pages ``[B, P, page, R + Dr]`` in ``dtype`` (FP8
    pages dequantized), zero past the sequence's ``kv_lens``."""
    pages = cache.pages[meta.block_tables]                                   # [B, P, page, R + Dr]
    if cache.scale is not None:
        pages = pages.astype(jnp.float32) * cache.scale
    _, num_pages, page_size, _ = pages.shape
    slot = jnp.arange(num_pages * page_size, dtype=jnp.int32).reshape(num_pages, page_size)
    return jnp.where((slot[None] < meta.kv_lens[:, None, None])[..., None], pages.astype(dtype), 0)


def expand(latents: jax.Array, w_uk: jax.Array, w_uv: jax.Array, rope_dim: int, dtype: jnp.dtype,
           width: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Keys ``[..., Hq, Dn + Dr]`` and values ``[..., Hq, Dv]`` of latents ``[..., R + Dr]``, in
    ``dtype``; with ``width``, both ``[..., Hq, width]``, zero past their own widths (the weights
    padded with zero columns, so the GEMMs write the padded arrays: no copy). K is one GEMM of the
    whole latent with ``key_weight``, which writes the RoPE part to every head's last Dr columns
    itself (no concatenation, no broadcast)."""
    w_k, w_v = key_weight(w_uk, rope_dim), w_uv
    if width is not None:
        w_k, w_v = (jnp.pad(w, ((0, 0), (0, 0), (0, width - w.shape[-1]))) for w in (w_k, w_v))
    # Products straight in ``dtype`` (accumulated in float32 by the GEMM, rounded once): a float32
    # result would be written, read back and converted, several times the bytes of K and V.
    k = jnp.einsum("...l,lhd->...hd", latents, w_k.astype(dtype), preferred_element_type=dtype)
    v = jnp.einsum("...r,rhv->...hv", latents[..., :w_uv.shape[0]], w_v.astype(dtype), preferred_element_type=dtype)
    return k, v


def key_weight(w_uk: jax.Array, rope_dim: int) -> jax.Array:
    """``W_k = [[W_UK, 0], [0, I]]`` ``[R + Dr, Hq, Dn + Dr]`` in ``w_uk``'s dtype: a latent
    ``[c_kv, k_rope]`` times ``W_k[:, h]`` is head h's key ``[c_kv W_UK[:, h], k_rope]``: the RoPE
    columns ``k_rope * 1`` plus zeros (exact), the others ``c_kv W_UK[:, h]`` plus zeros (the same
    float32 sum, so the same bits wherever the GEMM keeps its summation order).
    It costs ``(R + Dr)(Dn + Dr) / (R Dn)`` the no-RoPE GEMM's FLOPs (1.69x at DeepSeek's dims)."""
    rank, heads, nope_dim = w_uk.shape
    eye = jnp.broadcast_to(jnp.eye(rope_dim, dtype=w_uk.dtype)[:, None], (rope_dim, heads, rope_dim))
    return (jnp.zeros((rank + rope_dim, heads, nope_dim + rope_dim), w_uk.dtype)
            .at[:rank, :, :nope_dim].set(w_uk).at[rank:, :, nope_dim:].set(eye))


def expanded_pages(cache: MLACache, meta: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array,
                   dtype: jnp.dtype, page_size: int | None = None) -> tuple[jax.Array, jax.Array, AttentionMetadata]:
    """The expanded keys and values (``expand_latents``) as NHD page pools of their own, for a
    paged kernel that takes K and V of different widths: ``[B * N, page_size, Hq, Dn + Dr]`` and
    ``[B * N, page_size, Hq, Dv]``, and ``meta`` with block tables into them (sequence b's page j
    is ``b * N + j``). ``page_size`` (default: the cache's) must divide a sequence's P x page
    slots: a sequence's expanded slots are contiguous, so any such regrouping is free."""
    k, v = expand_latents(cache, meta, w_uk, w_uv, dtype)
    batch, slots, heads = k.shape[0], k.shape[1] * k.shape[2], k.shape[3]
    page_size = page_size or cache.page_size
    if slots % page_size:
        raise ValueError(f"expanded_pages: page_size {page_size} does not divide a sequence's {slots} slots")
    num_pages = batch * (slots // page_size)
    tables = jnp.arange(num_pages, dtype=jnp.int32).reshape(batch, slots // page_size)
    return (k.reshape(num_pages, page_size, heads, k.shape[-1]),
            v.reshape(num_pages, page_size, heads, v.shape[-1]),
            dataclasses.replace(meta, block_tables=tables, page_size=page_size, num_pages=num_pages))


def expanded_pool(cache: MLACache, meta: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array,
                  dtype: jnp.dtype) -> tuple[KVCache, AttentionMetadata]:
    """``expanded_pages`` as one KVCache, for a paged kernel that takes one head_dim: NHD
    ``[1 + B * P, page, Hq, max(Dn + Dr, Dv)]`` each (page 0 null and zero; the narrower of K and
    V zero-padded, which changes no logit and adds only zero output columns past Dv), and ``meta``
    with block tables into it (sequence b's page j is ``1 + b * P + j``). The expansion's GEMMs
    write the pool itself: the null page is a zero latent page in front of the step's, and the
    padding zero columns of the weights (``expand``'s ``width``)."""
    latents = step_latents(cache, meta, dtype)
    batch, num_pages = latents.shape[:2]
    latents = jnp.concatenate([jnp.zeros((1, *latents.shape[2:]), dtype),
                               latents.reshape(batch * num_pages, *latents.shape[2:])])
    width = max(w_uk.shape[2] + cache.rope_dim, w_uv.shape[2])
    k, v = expand(latents, w_uk, w_uv, cache.rope_dim, dtype, width)
    tables = 1 + jnp.arange(batch * num_pages, dtype=jnp.int32).reshape(batch, num_pages)
    return KVCache(k, v, layout="NHD"), dataclasses.replace(meta, block_tables=tables, num_pages=1 + batch * num_pages)


def attend_expanded(attention: Callable[..., jax.Array], q: jax.Array, cache: MLACache, meta: AttentionMetadata,
                    w_uk: jax.Array, w_uv: jax.Array, params: AttentionParams) -> jax.Array:
    """MLA prefill through a backend's paged ``attention(q, cache, meta, params, sinks)`` that takes
    one head_dim: over ``expanded_pool``, with the whole query zero-padded to the pool's width; the
    output's first Dv columns. ``q: [T, Hq, Dn + Dr]`` -> ``[T, Hq, Dv]``."""
    pool, pool_meta = expanded_pool(cache, meta, w_uk, w_uv, q.dtype)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pool.head_dim - q.shape[2])))
    return attention(q, pool, pool_meta, params, None)[..., :w_uv.shape[2]]
