"""The ``cudnn`` backend: cuDNN's paged SDPA (cudnn-frontend graph) as a typed XLA FFI custom call.

Packed ragged queries ``[T, Hq, D]`` attend over the page pools in place (HND or NHD, expressed
to cuDNN by strides: the pool is never copied). Query/KV lengths, offsets and page tables are
device buffers, so one compiled step serves every batch of the same static shapes, and the
call is captured into XLA command buffers (CUDA graphs). The cuDNN plan is built once per
configuration and device, at trace time (to size the workspace output) and in the handler's
initialize stage; execute only binds pointers.

Supported: bfloat16/float16 q and pages, GQA/MQA, bottom-right causal or no mask, sliding
windows, sinks (cuDNN >= 9.13), head_dim a multiple of 8 up to 256, power-of-2 page sizes.
Not supported (ValueError): float32, FP8 pages, softcap.

``mla_prefill`` runs MLA prefill on the same graph: the step's latents are expanded into a pool of
per-head keys and values of their own (``latents.attend_expanded``; V zero-padded to the keys'
Dn + Dr, since the graph takes one head_dim), and the output keeps its first Dv columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import _ffi_cudnn
from jaxattn.backends.base import (RANK_FIRST, RANK_GENERAL, AttentionParams, Backend, Call, Capabilities, OpSupport,
                                   constant_rank)
from jaxattn.backends.latents import attend_expanded
from jaxattn.kv_cache import KVCache, MLACache
from jaxattn.metadata import AttentionMetadata

DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 256
MIN_SINKS_VERSION = 91300
_DTYPE_CODES = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float16): 1}
_LAYOUT_CODES = {"HND": 0, "NHD": 1}


def check(call: Call) -> str | None:
    """The graph's limits that ``CAPABILITIES`` do not express (``paged_attention``)."""
    reason = _shape_reason("head_dim", call.q.shape, call.q.shape[2], call.cache.page_size)
    version = _ffi_cudnn.cudnn_version()
    if reason is None and call.params.has_sinks and version is not None and version < MIN_SINKS_VERSION:
        reason = (f"sinks need cuDNN >= {_ffi_cudnn.format_version(MIN_SINKS_VERSION)}, "
                  f"this is cuDNN {_ffi_cudnn.format_version(version)}")
    return reason


def prepare(call: Call) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The per-step operands of a ``paged_attention`` call: ``lengths``."""
    return lengths(call.meta, call.q.shape[0], call.cache.page_size)


def lengths(meta: AttentionMetadata, num_tokens: int, page_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The graph's lengths for sanitized ``meta``: ``(seq_len_q int32[B], seq_len_kv int32[B],
    q_offsets int32[B+1])``. Queries bounded by the step's ``max_q_len`` (as the xla reference
    does) and by the tokens that exist, none for sequences without keys (cuDNN writes exactly these
    rows; the handler zeroes the rest); keys bounded by the block tables' width; each sequence's
    first query token (times ``Hq * D``, the ragged offsets in elements)."""
    max_q = num_tokens if meta.max_q_len is None else min(meta.max_q_len, num_tokens)
    q_start = jnp.clip(meta.cu_q_lens[:-1], 0, num_tokens)
    seq_len_kv = jnp.clip(meta.kv_lens, 0, meta.max_pages_per_seq * page_size)
    seq_len_q = jnp.where(seq_len_kv > 0, jnp.clip(jnp.minimum(meta.q_lens, num_tokens - q_start), 0, max_q), 0)
    return seq_len_q, seq_len_kv, jnp.clip(meta.cu_q_lens, 0, num_tokens)


def attention(q: jax.Array, cache: KVCache, meta: AttentionMetadata, params: AttentionParams,
              sinks: jax.Array | None, *, prepared: tuple[jax.Array, ...] | None = None) -> jax.Array:
    """``q: [T, Hq, D]`` -> ``[T, Hq, D]`` in ``q.dtype``; ``prepared``: ``lengths`` (made here when None)."""
    return _paged_prefill(q, cache, meta, params, sinks, return_lse=False, prepared=prepared)[0]


def mla_prefill_check(call: Call) -> str | None:
    """The graph's limits on ``mla_prefill`` over the expanded pool (K of Dn + Dr, V padded to it)."""
    width = max(call.q.shape[2], call.w_uv.shape[2])
    return _shape_reason("max(Dn + Dr, Dv)", call.q.shape, width, call.cache.page_size)


def _shape_reason(dim_name: str, q_shape: tuple[int, ...], head_dim: int, page_size: int) -> str | None:
    """The graph's limits on the head width (``dim_name``), page size and packed query size."""
    num_tokens, num_q_heads = q_shape[:2]
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"{dim_name}={head_dim} is not supported; supported: multiples of 8 up to {MAX_HEAD_DIM}"
    if page_size & (page_size - 1):
        return f"page_size={page_size} is not supported; supported: powers of 2"
    if num_tokens * num_q_heads * head_dim >= 2**31:
        return (f"T * Hq * D = {num_tokens * num_q_heads * head_dim} elements is not supported "
                f"(int32 ragged offsets); supported: T * Hq * D < 2**31")
    return None


def mla_prefill(q: jax.Array, cache: MLACache, meta: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array,
                params: AttentionParams) -> jax.Array:
    """MLA prefill on cuDNN's paged graph over the expanded pool (see the module docstring):
    ``q: [T, Hq, Dn + Dr]`` (whole) -> ``[T, Hq, Dv]`` in ``q.dtype``."""
    return attend_expanded(attention, q, cache, meta, w_uk, w_uv, params)


def attention_with_lse(q: jax.Array, cache: KVCache, meta: AttentionMetadata, params: AttentionParams,
                       sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Like ``attention``, plus the log-sum-exp of each query row's scaled logits.

    Returns:
      out: ``[T, Hq, D]`` in ``q.dtype``.
      lse: float32 ``[B, Hq, Q]`` (Q = ``meta.max_q_len`` or T), natural log; ``lse[b, h, r]``
        belongs to the r-th query token of sequence b; rows past its query length and
        sequences with no keys hold ``-inf``.
    """
    call = Call("paged_attention", q, cache, meta, params)
    reason = CAPABILITIES.reason(call) or check(call)
    if reason is not None:
        raise ValueError(f"attention_with_lse: backend 'cudnn' cannot take this call: {reason}")
    return _paged_prefill(q, cache, meta, params, sinks, return_lse=True)


def _paged_prefill(q: jax.Array, cache: KVCache, meta: AttentionMetadata, params: AttentionParams,
                   sinks: jax.Array | None, return_lse: bool,
                   prepared: tuple[jax.Array, ...] | None = None) -> tuple[jax.Array, jax.Array | None]:
    num_tokens, num_q_heads, head_dim = q.shape
    batch, pages_per_seq = meta.block_tables.shape
    max_q = num_tokens if meta.max_q_len is None else min(meta.max_q_len, num_tokens)
    seq_len_q, seq_len_kv, q_offsets = lengths(meta, num_tokens, cache.page_size) if prepared is None else prepared
    # In elements of this call's q (under head sharding, one shard's heads): the one per-call op.
    ragged_offsets = q_offsets * (num_q_heads * head_dim)

    config = dict(
        dtype=_DTYPE_CODES[jnp.dtype(q.dtype)],
        batch=batch,
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=cache.num_kv_heads,
        head_dim=head_dim,
        num_pages=cache.num_pages,
        page_size=cache.page_size,
        pages_per_seq=pages_per_seq,
        layout=_LAYOUT_CODES[cache.layout],
        max_q_len=max_q,
        scale=np.float32(params.scale),
        causal=params.causal,
        sliding_window=params.sliding_window or 0,
        has_sinks=sinks is not None,
        return_lse=return_lse,
    )
    workspace = _ffi_cudnn.workspace_size(config)
    result_types = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((workspace,), jnp.uint8)]
    if return_lse:
        result_types.append(jax.ShapeDtypeStruct((batch, num_q_heads, max_q), jnp.float32))
    args = [q, cache.k_pages, cache.v_pages, seq_len_q, seq_len_kv, ragged_offsets, meta.block_tables]
    if sinks is not None:
        args.append(sinks.astype(jnp.float32))
    results = jax.ffi.ffi_call(_ffi_cudnn.TARGET, result_types)(*args, **config)
    if not return_lse:
        return results[0], None
    rows = jnp.arange(max_q, dtype=jnp.int32)
    has_row = rows[None, :] < seq_len_q[:, None]                                    # [B, Q]
    return results[0], jnp.where(has_row[:, None, :], results[2], -jnp.inf)


# FP8 pages: cuDNN's FP8 SDPA with a bottom-right causal mask needs Blackwell. softcap: cuDNN caps
# logits only through a score modifier, which excludes the padding and causal masks paged
# attention needs.
CAPABILITIES = Capabilities(dtypes=DTYPES, options=("non_causal", "sliding_window", "sinks"))
# cuDNN's grid covers every (sequence, query tile of the static max_q_len). Where those padded query
# rows outnumber the step's tokens by more than this (an engine's mixed step: 156 rows, 284-2048
# tokens, max_q_len 512), most tiles are empty and cuDNN ranks behind triton and fa4 (H100,
# tune_auto's "engine mixed" workloads: cuDNN whole 0.12-0.40 ms, the decodes split off to triton
# 0.10-0.23 ms, triton whole 0.10-0.19 ms, fa4 whole 0.08-0.16 ms).
MAX_PADDED_ROWS_PER_TOKEN = 4


def rank(call: Call) -> int | None:
    """auto's rank of a paged_attention call: prefill first, unless its padded grid is mostly empty
    (``MAX_PADDED_ROWS_PER_TOKEN``); behind triton for speculative decode; never for decodes (the
    decode kernels read pages at the copy rate, cuDNN's prefill graph not)."""
    if call.phase == "prefill":
        bound = call.meta.max_q_len
        sparse = bound is not None and call.meta.batch_size * bound > MAX_PADDED_ROWS_PER_TOKEN * call.q.shape[0]
        return RANK_GENERAL + 2 if sparse else RANK_FIRST
    return 3 * RANK_GENERAL if call.phase == "spec_decode" else None


BACKEND = Backend(
    name="cudnn",
    kernel="cuDNN paged SDPA (cudnn-frontend graph) via XLA FFI",
    archs=("sm_80+",),
    requirements=_ffi_cudnn.unavailable_reason,
    ops={
        "paged_attention": OpSupport(run=attention, capabilities=CAPABILITIES, check=check, rank=rank,
                                     prepare=prepare),
        "mla_prefill": OpSupport(run=mla_prefill, capabilities=Capabilities(dtypes=DTYPES, fp8_pages=True, layouts=(),
                                                                           options=("non_causal",)),
                                 check=mla_prefill_check, rank=constant_rank(RANK_FIRST)),
    },
)
