"""TensorRT-LLM XQA paged decode (from flashinfer-python's sources) as an XLA FFI custom call.

SM90 only. Two kinds of step, chosen by the static ``meta.max_q_len``:

* Decode (``max_q_len == 1``). Each query token is one XQA request: its sequence's KV length
  and page-table row are gathered per token (padding tokens get length 0), so any ``cu_q_lens``
  packing works. The output rows of tokens with no keys are zero without an extra pass for
  bf16/fp16 pages (see ``_sinks``); the fp8 (Hopper) kernel's handler zeroes them after the kernel.
* Speculative decode (``2 <= max_q_len <= MAX_SPEC_Q_LEN``): XQA's ``SPEC_DEC`` build of its
  generic kernel (mha.cu, for bf16/fp16 and fp8 pages alike), one request per sequence with its
  query tokens packed by ``cu_q_lens`` (XQA's ragged-q mode), so lengths may differ per
  sequence and step: any length ``0..max_q_len`` is computed exactly, with the usual
  bottom-right causal mask (query row r of a sequence with q_len tokens sits at position
  ``kv_len - q_len + r``), passed to XQA as a bit mask built here, plus the sliding window and
  sinks. ``max_q_len`` sizes the launch (XQA's grid covers ``max_q_len`` tokens per request), so
  the step costs the same for any lengths up to it. Rows XQA does not compute are zero (a small
  kernel after XQA zeroes them): padding tokens, and every token of a sequence that breaks the
  step's contract: ``q_len > max_q_len`` (the ``max_q_len`` promise), ``kv_len < q_len`` (kv_lens
  include the step's tokens), or ``cu_q_lens`` decreasing or outside ``[0, T]``. (The ``xla``
  reference computes something for the first two; no valid step has them.)
  Unsupported (ValueError at trace time): ``max_q_len`` None or above ``MAX_SPEC_Q_LEN``, and
  sinks with a group size that does not divide 32 when ``max_q_len * group > 32`` (XQA's
  spec-decode sink lookup indexes heads within a 32-row block, which is wrong there).

Kernels are compiled with nvcc on first use (see ``_xqa_build``).

``JAXATTN_TRTLLM_PDL=0`` (read when a call is traced) launches XQA without programmatic
dependent launch, for comparisons; it is on by default, as in flashinfer.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.backends import _nvcc, _xqa_build
from jaxattn.backends.base import (RANK_FIRST, RANK_GENERAL, AttentionParams, Backend, Call, Capabilities,
                                    OpSupport, sm_count)
from jaxattn.kv_cache import KVCache
from jaxattn.metadata import SPEC_DECODE_MAX_Q_LEN, AttentionMetadata, token_sequences

DTYPES = ("bfloat16", "float16")
PAGE_SIZES = (16, 32, 64, 128)
HEAD_DIMS = (64, 128, 256)
MAX_GROUP_SIZE = 16
MAX_TOKENS = 65535  # XQA puts requests on the grid's z dimension
MAX_SPEC_Q_LEN = SPEC_DECODE_MAX_Q_LEN  # speculative decode: query tokens per sequence (the tested range)
SPEC_TILE_ROWS = 32  # XQA spec decode's (query token, head) rows per CTA (M_TILESIZE)
# XQA starts each row's running max at -1e5 (utils.cuh: safeInitRowMax). A sink of -9e4 adds
# exp(-9e4 - max) == 0.0 exactly to every row with keys (any max above -89,900), and exp(1e4) = inf
# to a row without keys, whose output then is 0 * (1 / inf) = 0 where it would be 0/0.
SINK_FLOOR = -9e4
# fp8 decode: XQA's Hopper kernel gets twice the SM count only while that keeps the launch within
# this many CTAs per SM, each covering at least this many keys (split_sm_count).
_FP8_MAX_CTAS_PER_SM = 1.6
_FP8_MIN_KEYS_PER_CTA = 320


def check(call: Call) -> str | None:
    """XQA's limits that ``CAPABILITIES`` do not express."""
    num_tokens, num_q_heads, head_dim = call.q.shape
    group = call.group_size
    if call.cache.page_size not in PAGE_SIZES:
        return f"page_size must be one of {PAGE_SIZES}, got {call.cache.page_size}"
    if head_dim not in HEAD_DIMS:
        return f"head_dim must be one of {HEAD_DIMS}, got {head_dim}"
    if not 1 <= group <= MAX_GROUP_SIZE:
        return (f"query heads per KV head (Hq // Hkv) must be in 1..{MAX_GROUP_SIZE}, "
                f"got {num_q_heads} // {call.cache.num_kv_heads} = {group}")
    if not 1 <= num_tokens <= MAX_TOKENS:
        return f"the number of query tokens T must be in 1..{MAX_TOKENS}, got {num_tokens}"
    max_q_len = call.meta.max_q_len
    if max_q_len > 1:
        if not 1 <= call.meta.batch_size <= MAX_TOKENS:
            return f"speculative decode needs 1..{MAX_TOKENS} sequences, got {call.meta.batch_size}"
        if call.params.has_sinks and SPEC_TILE_ROWS % group and min(max_q_len, num_tokens) * group > SPEC_TILE_ROWS:
            return (f"sinks with speculative decode need query heads per KV head (Hq // Hkv = {group}) "
                    f"dividing {SPEC_TILE_ROWS}, or meta.max_q_len * {group} <= {SPEC_TILE_ROWS}; got "
                    f"max_q_len={max_q_len} (XQA looks sinks up by the row within a block of "
                    f"{SPEC_TILE_ROWS} (token, head) rows)")
    return None


def rank(call: Call) -> int | None:
    """auto: decodes first; speculative decode first while each sequence's (token, head) rows fit
    one XQA tile (one CTA each, each reading the keys), behind triton when they do not
    (benchmarks/RESULTS.md, speculative decode)."""
    if call.phase != "spec_decode":
        return RANK_FIRST if call.phase == "decode" else None
    rows = call.meta.max_q_len * call.group_size
    return RANK_FIRST if rows <= SPEC_TILE_ROWS else 2 * RANK_GENERAL


def variant(q: jax.Array, cache: KVCache, params: AttentionParams, spec_dec: bool = False) -> _xqa_build.Variant:
    """The compiled kernel variant this call needs (``spec_dec``: ``meta.max_q_len > 1``)."""
    return _xqa_build.Variant(
        dtype=q.dtype.name,
        cache_dtype=cache.dtype.name,
        page_size=cache.page_size,
        head_dim=q.shape[2],
        group_size=q.shape[1] // cache.num_kv_heads,
        sliding_window=params.sliding_window is not None,
        spec_dec=spec_dec,
    )


def prepare(call: Call) -> tuple[jax.Array, ...]:
    """The per-step operands of a call (the same for every layer): ``decode_inputs`` for a decode
    step, ``spec_inputs`` for a speculative-decode step."""
    num_tokens, capacity = call.q.shape[0], call.meta.max_pages_per_seq * call.cache.page_size
    if call.meta.max_q_len == 1:
        return decode_inputs(call.meta, num_tokens, capacity)
    causal = call.params.causal or call.params.sliding_window is not None  # a window also bounds keys by position
    return spec_inputs(call.meta, num_tokens, min(call.meta.max_q_len, num_tokens), capacity, causal)


def attention(q: jax.Array, cache: KVCache, meta: AttentionMetadata, params: AttentionParams,
              sinks: jax.Array | None, *, prepared: tuple[jax.Array, ...] | None = None) -> jax.Array:
    """``q: [T, Hq, D]`` -> ``[T, Hq, D]`` in ``q.dtype``; ``prepared``: ``prepare``'s operands for
    this call (made here when None)."""
    if prepared is None:
        prepared = prepare(Call("paged_attention", q, cache, meta, params))
    if meta.max_q_len != 1:
        return _spec_attention(q, cache, meta, params, sinks, prepared)
    kernel = _xqa_build.load(variant(q, cache, params))
    num_tokens, num_q_heads, head_dim = q.shape
    max_pages = meta.max_pages_per_seq
    seq_lens, tables = prepared

    split_sms = split_sm_count(kernel.variant, num_tokens, cache.num_kv_heads, max_pages)
    semaphores, scratch = kernel.workspace(split_sms, num_tokens, cache.num_kv_heads, max_pages)
    stride_page, stride_token, stride_head = _strides(cache)
    call = jax.ffi.ffi_call(
        kernel.target_name,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((max(scratch, 1),), jnp.uint8)),
    )
    out, _ = call(
        q, cache.k_pages, cache.v_pages, tables, seq_lens, _scales(cache, params, head_dim),
        _sinks(sinks, num_q_heads, kernel.variant.hopper),
        num_kv_heads=np.int64(cache.num_kv_heads),
        stride_page=np.int64(stride_page),
        stride_token=np.int64(stride_token),
        stride_head=np.int64(stride_head),
        sliding_window=np.int64(params.sliding_window or 0),
        semaphore_count=np.int64(semaphores),  # persistent per call site, zeroed once (handler)
        enable_pdl=np.int64(os.environ.get("JAXATTN_TRTLLM_PDL", "1") != "0"),
        split_sm_count=np.int64(split_sms),
    )
    return out


def decode_inputs(meta: AttentionMetadata, num_tokens: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """XQA's decode operands: ``(seq_lens int32[T], tables int32[T, P])``. Token t is a request of
    its own: the first token of sequence seq[t] attends to all its keys (at most ``capacity``), the
    others (and padding tokens) to none."""
    batch = meta.batch_size
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.sum(meta.cu_q_lens[None, 1:] <= token[:, None], axis=1, dtype=jnp.int32)
    seq_c = jnp.minimum(seq, batch - 1)
    first = (seq < batch) & (token == meta.cu_q_lens[seq_c])
    seq_lens = jnp.where(first, jnp.clip(meta.kv_lens[seq_c], 0, capacity), 0)
    return seq_lens, meta.block_tables[seq_c]


def _spec_attention(q: jax.Array, cache: KVCache, meta: AttentionMetadata, params: AttentionParams,
                    sinks: jax.Array | None, prepared: tuple[jax.Array, ...]) -> jax.Array:
    """Speculative decode: one XQA request per sequence, its tokens packed by ``cu_q_lens``."""
    kernel = _xqa_build.load(variant(q, cache, params, spec_dec=True))
    num_tokens, num_q_heads, _ = q.shape
    batch, max_pages = meta.block_tables.shape
    max_q = min(meta.max_q_len, num_tokens)
    seq_lens, cu, mask, row_valid = prepared

    semaphores, scratch = kernel.workspace(sm_count(), batch, cache.num_kv_heads, max_pages, max_q)
    stride_page, stride_token, stride_head = _strides(cache)
    call = jax.ffi.ffi_call(
        kernel.target_name,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((max(scratch, 1),), jnp.uint8)),
    )
    out, _ = call(
        q, cache.k_pages, cache.v_pages, meta.block_tables, seq_lens, _scales(cache, params, q.shape[2]),
        jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32),
        cu, mask, row_valid,
        num_kv_heads=np.int64(cache.num_kv_heads),
        stride_page=np.int64(stride_page),
        stride_token=np.int64(stride_token),
        stride_head=np.int64(stride_head),
        sliding_window=np.int64(params.sliding_window or 0),
        semaphore_count=np.int64(semaphores),
        enable_pdl=np.int64(os.environ.get("JAXATTN_TRTLLM_PDL", "1") != "0"),
        q_seq_len=np.int64(max_q),
        split_sm_count=np.int64(sm_count()),
    )
    return out


def spec_inputs(meta: AttentionMetadata, num_tokens: int, max_q: int, capacity: int, causal: bool = True
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """XQA's speculative-decode operands: ``(seq_lens int32[B], q_cu_seq_lens int32[B+1],
    mask uint32[T, ceil(max_q / 32)], row_valid int32[T])``.

    XQA computes request b's tokens ``cu[b] .. cu[b+1]`` against its ``seq_lens[b]`` keys; all
    keys but the last ``q_len`` are visible, and token row r sees the last ones where bit j of its
    mask row (little-endian words) is set: the causal mask sets bits ``0..r``, so row r sees
    keys ``0 .. kv_len - q_len + r`` (``causal=False``: every bit set, every row sees all
    ``kv_len`` keys; the kernel applies a sliding window itself). A sequence that breaks the
    step's contract (q_len above ``max_q``, ``kv_len < q_len``, offsets out of order or outside
    ``[0, T]``) gets no keys, and rows with ``row_valid == 0`` (those and padding tokens) are
    zeroed after the kernel."""
    batch = meta.batch_size
    cu_in = meta.cu_q_lens.astype(jnp.int32)
    cu = jnp.clip(jax.lax.cummax(cu_in), 0, num_tokens)          # non-decreasing, in [0, T]
    q_lens = cu[1:] - cu[:-1]
    kv_lens = jnp.clip(meta.kv_lens, 0, capacity)
    valid = (cu[:-1] == cu_in[:-1]) & (cu[1:] == cu_in[1:]) & (q_lens <= max_q) & (q_lens <= kv_lens)
    seq_lens = jnp.where(valid, kv_lens, 0)

    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = token_sequences(cu[1:], num_tokens)                      # B for tokens past cu[B]
    seq_c = jnp.minimum(seq, batch - 1)
    row_valid = ((seq < batch) & valid[seq_c]).astype(jnp.int32)
    row = token - cu[seq_c]                                        # the token's row in its sequence
    words = -(-max_q // 32)
    ones = jnp.clip(row[:, None] + 1 - 32 * jnp.arange(words, dtype=jnp.int32)[None, :], 0, 32)
    full = jnp.uint32(0xFFFFFFFF)
    mask = jnp.where(ones >= 32, full, (jnp.uint32(1) << jnp.minimum(ones, 31).astype(jnp.uint32)) - jnp.uint32(1))
    if not causal:
        mask = jnp.full_like(mask, full)
    return seq_lens, cu, mask, row_valid


def _sinks(sinks: jax.Array | None, num_q_heads: int, hopper: bool) -> jax.Array:
    """float32 [Hq] sinks for the kernel, or [0] for none.

    XQA's generic kernel writes zeros for a token without keys when each sequence runs on one
    CTA, but 0/0 when it splits sequences over CTAs (small batches), unless a sink is present.
    So it always gets one, at least ``SINK_FLOOR``: absent sinks become that floor (which adds
    exactly nothing to rows with keys) and given ones are clamped to it (likewise exact). The
    Hopper kernel keeps flashinfer's inputs; its handler zeroes rows without keys instead."""
    if hopper:
        return jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    if sinks is None:
        return jnp.full((num_q_heads,), SINK_FLOOR, jnp.float32)
    return jnp.maximum(sinks.astype(jnp.float32), SINK_FLOOR)


def _scales(cache: KVCache, params: AttentionParams, head_dim: int) -> jax.Array:
    """float32[2] (q_scale, kv_scale): XQA computes logits as ``q_scale * kv_scale / sqrt(D) * q.k``
    and scales the output by ``kv_scale`` (fp8 pages only), so fp8 folds ``k_scale / v_scale`` into q."""
    q_scale = params.scale * math.sqrt(head_dim)
    if not cache.is_fp8:
        return jnp.asarray(np.array([q_scale, 1.0], np.float32))
    v_scale = cache.v_scale.astype(jnp.float32)
    return jnp.stack([q_scale * cache.k_scale.astype(jnp.float32) / v_scale, v_scale])


def _strides(cache: KVCache) -> tuple[int, int, int]:
    """Element strides (page, token, head) of the page pools; the head dim is contiguous."""
    heads, page, dim = cache.num_kv_heads, cache.page_size, cache.head_dim
    if cache.layout == "HND":
        return heads * page * dim, dim, page * dim
    return page * heads * dim, heads * dim, dim


def split_sm_count(kernel_variant: _xqa_build.Variant, num_requests: int, num_kv_heads: int, max_pages: int) -> int:
    """The SM count XQA's split formula is given for a decode launch (its CTAs per sequence grow
    with it). bf16/fp16 pages (XQA's generic kernel, ``min(SMs / (B * Hkv), kv / tile)`` CTAs per
    (request, KV head)): the device's; on an H100 a quarter to 8x that count was slower, or within
    2%, at every batch 1-64 and kv 4k-128k point. fp8 pages (the Hopper kernel,
    ``round(SMs * 3 / (B * Hkv) / 4)`` CTAs per (request, KV head), 96 in all on an H100 at B=1-4
    with Hkv 8): twice the device's count where that leaves SMs idle, if the launch then stays
    within ``_FP8_MAX_CTAS_PER_SM`` CTAs per SM and each CTA covers at least
    ``_FP8_MIN_KEYS_PER_CTA`` keys of the table's width. On an H100 (XQA kernel time, kv 16k-128k)
    2x took 10-17% less time at B=1, 13-19% at B=2, 17-19% at B=4; 4x (about 400 CTAs) slowed B=1 and
    B=2 down against 2x, the merge of their partials costing more than the extra CTAs gain
    (``benchmarks/tune_xqa_splits.py``, TUNING.md, "XQA split count, fp8 pages")."""
    sms = sm_count()
    pairs = num_requests * num_kv_heads

    def ctas_per_pair(count: int) -> int:      # XQA's Hopper formula given ``count`` SMs
        return max(1, round(count * 3 / pairs / 4))

    if (kernel_variant.hopper and ctas_per_pair(sms) * pairs < sms
            and ctas_per_pair(2 * sms) * pairs <= _FP8_MAX_CTAS_PER_SM * sms
            and max_pages * kernel_variant.page_size >= _FP8_MIN_KEYS_PER_CTA * ctas_per_pair(2 * sms)):
        return 2 * sms
    return sms



CAPABILITIES = Capabilities(dtypes=DTYPES, fp8_pages=True, max_q_len=MAX_SPEC_Q_LEN,
                            options=("non_causal", "sliding_window", "sinks"))
BACKEND = Backend(
    name="trtllm",
    kernel="TensorRT-LLM XQA decode (flashinfer-python's sources, nvcc on first use) via XLA FFI",
    archs=("sm_90",),
    requirements=lambda: _nvcc.toolchain_reason(_xqa_build.check_toolchain),
    ops={"paged_attention": OpSupport(run=attention, capabilities=CAPABILITIES, check=check, rank=rank,
                                      prepare=prepare)},
)
