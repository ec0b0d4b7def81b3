"""The reference backend: gather each sequence's pages, then masked softmax attention in XLA.
Also the reference for multi-head latent attention (``jaxattn.mla``): absorbed over the latent
pool, and over K/V expanded from it.

Runs anywhere XLA does. Work per step is ``B x Q x S`` logits per head, where ``Q`` is the
static bound on query length (``meta.max_q_len`` or T) and ``S = P * page_size`` the block
tables' width; queries are processed in chunks so the logits stay within a fixed budget.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn.backends.base import RANK_REFERENCE, AttentionParams, Backend, Capabilities, OpSupport, constant_rank
from jaxattn.backends.latents import expand_latents
from jaxattn.kv_cache import KVCache, MLACache
from jaxattn.metadata import AttentionMetadata

# Upper bound on the float32 logits materialized at once (bytes).
_LOGITS_BUDGET = 1 << 28


def attention(q: jax.Array, cache: KVCache, meta: AttentionMetadata, params: AttentionParams,
              sinks: jax.Array | None) -> jax.Array:
    """``q: [T, Hq, D]`` -> ``[T, Hq, D]`` in ``q.dtype``."""
    k, v = _gather_kv(cache, meta, _compute_dtype(q.dtype))
    return _attention(q, k, v, meta, params, sinks)


def mla_attention(q_latent: jax.Array, q_rope: jax.Array, cache: MLACache, meta: AttentionMetadata,
                  params: AttentionParams) -> jax.Array:
    """Absorbed MLA: MQA over the latents, ``[q_latent, q_rope] . latent`` logits and ``c_kv``
    values. ``q_latent: [T, Hq, R]``, ``q_rope: [T, Hq, Dr]`` -> ``[T, Hq, R]`` in ``q_latent.dtype``."""
    dtype = _compute_dtype(q_latent.dtype)
    latents = _gather_latents(cache, meta, dtype)[:, :, None]               # [B, S, 1, R + Dr]
    q = jnp.concatenate([q_latent, q_rope], axis=-1)
    return _attention(q, latents, latents[..., :cache.kv_lora_rank], meta, params, None)


def mla_prefill(q: jax.Array, cache: MLACache, meta: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array,
                params: AttentionParams) -> jax.Array:
    """MLA over per-head K/V expanded from the latents: ``k = [c_kv W_UK[:, h], k_rope]``,
    ``v = c_kv W_UV[:, h]``. ``q: [T, Hq, Dn + Dr]`` (whole), ``w_uk: [R, Hq, Dn]``,
    ``w_uv: [R, Hq, Dv]`` -> ``[T, Hq, Dv]`` in ``q.dtype``."""
    k, v = expand_latents(cache, meta, w_uk, w_uv, _compute_dtype(q.dtype))   # [B, P, page, Hq, D]
    batch, num_pages, page_size = k.shape[:3]
    k, v = (x.reshape(batch, num_pages * page_size, *x.shape[3:]) for x in (k, v))
    return _attention(q, k, v, meta, params, None)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, meta: AttentionMetadata, params: AttentionParams,
               sinks: jax.Array | None) -> jax.Array:
    """``q: [T, Hq, Dk]`` against each sequence's gathered ``k: [B, S, Hkv, Dk]``,
    ``v: [B, S, Hkv, Dv]`` -> ``[T, Hq, Dv]`` in ``q.dtype``."""
    num_tokens, num_q_heads, _ = q.shape
    value_dim = v.shape[-1]
    batch = meta.batch_size
    max_q = num_tokens if meta.max_q_len is None else min(meta.max_q_len, num_tokens)
    seq_width = k.shape[1]
    q_start = meta.cu_q_lens[:-1]
    q_lens = jnp.clip(meta.q_lens, 0, max_q)
    kv_lens = jnp.clip(meta.kv_lens, 0, seq_width)
    # Slots past kv_len hold stale data (another tenant's, or NaN): never let them reach a sum.
    in_seq = (jnp.arange(seq_width)[None, :] < kv_lens[:, None])[:, :, None, None]
    k, v = jnp.where(in_seq, k, 0), jnp.where(in_seq, v, 0)

    chunk = max(1, min(max_q, _LOGITS_BUDGET // (4 * batch * num_q_heads * seq_width)))
    num_chunks = -(-max_q // chunk)

    def attend_chunk(first_row: jax.Array) -> jax.Array:
        rows = first_row + jnp.arange(chunk, dtype=jnp.int32)          # [C]
        token = q_start[:, None] + rows[None, :]                          # [B, C]
        q_chunk = q[jnp.clip(token, 0, num_tokens - 1)]                   # [B, C, Hq, Dk]
        positions = (kv_lens - q_lens)[:, None] + rows[None, :]          # [B, C]
        row_valid = rows[None, :] < q_lens[:, None]
        return _attend(q_chunk, k, v, positions, row_valid, kv_lens, params, sinks)

    starts = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
    if num_chunks == 1:
        out = attend_chunk(starts[0])
    else:
        out = jax.lax.map(attend_chunk, starts)                           # [NC, B, C, Hq, Dv]
        out = jnp.moveaxis(out, 0, 1).reshape(batch, num_chunks * chunk, num_q_heads, value_dim)

    # Back to packed tokens: token t is row t - cu_q_lens[b] of sequence b.
    seq = meta.token_to_seq(num_tokens)
    seq_c = jnp.minimum(seq, batch - 1)
    row = jnp.arange(num_tokens, dtype=jnp.int32) - q_start[seq_c]
    valid = (seq < batch) & (row >= 0) & (row < q_lens[seq_c])
    packed = out[seq_c, jnp.clip(row, 0, out.shape[1] - 1)]
    return jnp.where(valid[:, None, None], packed, 0).astype(q.dtype)


def _compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype)


def _gather_kv(cache: KVCache, meta: AttentionMetadata, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """K, V of every sequence as ``[B, P * page_size, Hkv, D]``."""

    def gather(pages: jax.Array, scale: jax.Array | None) -> jax.Array:
        x = _gather_pages(pages, meta)                                     # [B, P, ...]
        if cache.layout == "HND":
            x = jnp.swapaxes(x, 2, 3)                                      # [B, P, page, Hkv, D]
        x = x.reshape(x.shape[0], -1, cache.num_kv_heads, cache.head_dim)
        if scale is not None:
            x = x.astype(jnp.float32) * scale
        return x.astype(dtype)

    return gather(cache.k_pages, cache.k_scale), gather(cache.v_pages, cache.v_scale)


def _gather_latents(cache: MLACache, meta: AttentionMetadata, dtype: jnp.dtype) -> jax.Array:
    """The latents of every sequence as ``[B, P * page_size, R + Dr]``."""
    x = _gather_pages(cache.pages, meta)                                   # [B, P, page, R + Dr]
    if cache.scale is not None:
        x = x.astype(jnp.float32) * cache.scale
    return x.reshape(x.shape[0], -1, cache.head_dim).astype(dtype)


def _gather_pages(pages: jax.Array, meta: AttentionMetadata) -> jax.Array:
    """``pages[block_tables]``: ``[B, P, ...]`` (sanitized tables: every id is in the pool)."""
    return pages[meta.block_tables]


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, row_valid: jax.Array,
            kv_lens: jax.Array, params: AttentionParams, sinks: jax.Array | None) -> jax.Array:
    """``q: [B, C, Hq, Dk]`` against ``k: [B, S, Hkv, Dk]``, ``v: [B, S, Hkv, Dv]`` -> ``[B, C, Hq, Dv]`` float32.

    ``positions[b, c]`` is the absolute position of query row c; rows with no visible key give 0.
    """
    batch, rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    qg = q.astype(k.dtype).reshape(batch, rows, num_kv_heads, group, head_dim)
    logits = jnp.einsum("bckgd,bskd->bkgcs", qg, k, preferred_element_type=jnp.float32)
    logits = logits * params.scale
    if params.softcap is not None:
        logits = params.softcap * jnp.tanh(logits / params.softcap)

    key = jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, :]           # [1, 1, S]
    pos = positions[:, :, None]                                            # [B, C, 1]
    visible = row_valid[:, :, None] & (key < kv_lens[:, None, None])
    if params.causal:
        visible &= key <= pos
    if params.sliding_window is not None:
        visible &= (key > pos - params.sliding_window) & (key <= pos)
    visible = visible[:, None, None]                                       # [B, 1, 1, C, S]

    masked = jnp.where(visible, logits, -jnp.inf)
    row_max = jnp.max(masked, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.where(visible, jnp.exp(masked - row_max), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    any_visible = jnp.any(visible, axis=-1, keepdims=True)
    probs = jnp.where(any_visible, probs / jnp.where(denom > 0, denom, 1.0), 0.0)
    out = jnp.einsum("bkgcs,bskd->bckgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(batch, rows, num_q_heads, v.shape[-1])


# The reference: every call each op accepts, on any device; auto's last resort.
_DTYPES = ("float32", "bfloat16", "float16")
_MLA = Capabilities(dtypes=_DTYPES, fp8_pages=True, layouts=(), options=("non_causal",))
_LAST = constant_rank(RANK_REFERENCE)
BACKEND = Backend(
    name="xla",
    kernel="gather pages + masked softmax in XLA (the reference)",
    archs=("cpu", "gpu"),
    ops={
        "paged_attention": OpSupport(run=attention, capabilities=Capabilities(dtypes=_DTYPES, fp8_pages=True),
                                     rank=_LAST),
        "mla_paged_attention": OpSupport(run=mla_attention, capabilities=_MLA, rank=_LAST),
        "mla_prefill": OpSupport(run=mla_prefill, capabilities=_MLA, rank=_LAST),
    },
)
