"""FlashInfer's SM90 MLA paged attention as an XLA FFI custom call (``mla_paged_attention`` only).

The kernel (``BatchMLAPageAttentionHopper``, compiled from flashinfer-python's headers by
``_mla_build``) is persistent and cooperative: one CTA per SM (pairs of CTAs sharing a 128-row
query tile when a request has more than 64 (token, head) rows) runs a list of works, each one
query tile of one request against a range of its keys, writing finished rows to the output and
rows whose keys were split over several works to a partial buffer that the same grid merges
after a grid-wide sync. It reads ``c_kv`` and ``k_rope`` from the latent pool in place.

FlashInfer schedules the works on the host from host copies of the lengths (``MLAPlan`` in
``flashinfer/attention/scheduler.cuh``). Here ``plan`` builds the same kind of schedule with jnp
ops from the (sanitized) device metadata, so that a step needs no host sync and runs inside
command buffers: FlashInfer's tiles, key-chunk limit, partial-row and merge layout, with the works
dealt to the CTAs in order, each CTA taking a contiguous run of about equal cost (FlashInfer uses
a min-heap). Padding tokens (before ``cu_q_lens[0]`` and after ``cu_q_lens[B]``) become requests
without keys, so the kernel writes every output row, zeros where a request has no keys.

Supported: bf16/fp16 queries over pages of the same dtype or FP8 (e4m3) pages, which the kernel
dequantizes in shared memory (with unit scales: the pool's scale is folded into the queries and the
output), ``kv_lora_rank`` 512 and ``rope_dim`` 64 (FlashInfer's instantiated widths), any page
size, any query lengths, causal or not.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.backends import _mla_build, _nvcc
from jaxattn.backends.base import (RANK_FIRST, AttentionParams, Backend, Call, Capabilities, OpSupport, constant_rank,
                                    sm_count)
from jaxattn.kv_cache import MLACache
from jaxattn.metadata import AttentionMetadata

DTYPES = ("bfloat16", "float16")
KV_LORA_RANK = 512
ROPE_DIM = 64
CTA_TILE_Q = 64      # (token, head) rows per CTA


def check(call: Call) -> str | None:
    """The kernel's limits that ``CAPABILITIES`` do not express: DeepSeek's latent widths."""
    if (call.cache.kv_lora_rank, call.cache.rope_dim) != (KV_LORA_RANK, ROPE_DIM):
        return (f"the cache's (kv_lora_rank, rope_dim) must be ({KV_LORA_RANK}, {ROPE_DIM}), "
                f"got ({call.cache.kv_lora_rank}, {call.cache.rope_dim})")
    return None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernel's schedule (FlashInfer's ``MLAPlanInfo`` fields, as device arrays).

    works: int32 ``[8, W]``, per work: q_indptr (first token of its request), kv_indptr (its
      block-table row's offset in the flattened tables, in pages), partial_indptr (first partial
      row, -1 when the work writes the output), q_len, kv_len, q_start (first packed row of its
      tile, packed row = token row * H + head), kv_start, kv_end.
    work_indptr: int32 ``[clusters + 1]``: cluster y runs works ``work_indptr[y] .. [y + 1]``.
    merge: int32 ``[5, M]``, per merge entry (CTA ``x + cluster * y``): packed row start and end
      (global, ``token * H + head``), partial row start and end, stride (a split tile's rows).
    cluster: CTAs per query tile (1 or 2); clusters: the grid's y extent; partial_rows: bound on
      partial rows.
    """

    works: jax.Array
    work_indptr: jax.Array
    merge: jax.Array
    cluster: int = dataclasses.field(metadata=dict(static=True))
    clusters: int = dataclasses.field(metadata=dict(static=True))
    partial_rows: int = dataclasses.field(metadata=dict(static=True))


def plan(cu_q_lens: jax.Array, kv_lens: jax.Array, pages_per_seq: int, num_tokens: int, num_heads: int,
         sm_count: int, max_q_len: int | None, causal: bool) -> Plan:
    """The schedule for sanitized metadata (``cu_q_lens`` non-decreasing in ``[0, T]``,
    ``kv_lens`` int32[B] within the tables); every size is static, every value traced."""
    batch = kv_lens.shape[0]
    rows_bound = min(max_q_len or num_tokens, num_tokens) * num_heads
    cluster = 2 if rows_bound > CTA_TILE_Q else 1        # FlashInfer: average packed rows > 64
    clusters = sm_count // cluster
    tile_q = cluster * CTA_TILE_Q
    i32 = jnp.int32
    cu = cu_q_lens.astype(i32)
    zero = jnp.zeros((1,), i32)

    # Requests: leading padding, the B sequences, trailing padding (padding has no keys).
    q_indptr = jnp.concatenate([zero, cu[:-1], cu[-1:]])
    q_lens = jnp.concatenate([cu[:1], cu[1:] - cu[:-1], num_tokens - cu[-1:]])
    kv = jnp.concatenate([zero, kv_lens.astype(i32), zero])
    kv_indptr = jnp.concatenate([zero, jnp.arange(batch, dtype=i32) * pages_per_seq, zero])
    requests = batch + 2

    # Query tiles of tile_q packed rows; at most T * H / tile_q + one partial tile per request.
    tiles = -(-q_lens * num_heads // tile_q)
    num_slots = -(-num_tokens * num_heads // tile_q) + requests
    tile_req, tile_idx, tile_ok = _expand(tiles, num_slots)
    packed = q_lens[tile_req] * num_heads
    tile_rows = jnp.minimum(tile_q, packed - tile_idx * tile_q)
    kv_t = kv[tile_req]
    if causal:   # keys the tile's last row sees (FlashInfer's packed_causal_kv_end)
        visible = kv_t - q_lens[tile_req] + -(-(tile_idx + 1) * tile_q // num_heads)
        eff = jnp.where(tile_idx + 1 == tiles[tile_req], kv_t, jnp.clip(visible, 0, kv_t))
    else:
        eff = kv_t
    eff = jnp.where(tile_ok, eff, 0)

    # Key chunks of at most `limit` keys (FlashInfer's kv_len_limit); a tile of several is split.
    limit = _chunk_limit(jnp.maximum(-(-jnp.sum(eff) // clusters), 1))
    chunks = jnp.where(tile_ok, jnp.maximum(-(-eff // limit), 1), 0)
    split = chunks > 1
    partial_rows = jnp.where(split, chunks * tile_rows, 0)
    partial_base = jnp.cumsum(partial_rows) - partial_rows

    # Works: sum(chunks) <= tiles + sum(eff) / limit <= num_slots + clusters.
    num_works = num_slots + clusters
    work_tile, chunk, work_ok = _expand(chunks, num_works)
    req = tile_req[work_tile]
    kv_start = chunk * limit
    kv_end = jnp.minimum(eff[work_tile], kv_start + limit)
    partial = jnp.where(split[work_tile], partial_base[work_tile] + chunk * tile_rows[work_tile], -1)
    works = jnp.stack([q_indptr[req], kv_indptr[req], partial, q_lens[req], kv[req],
                       tile_idx[work_tile] * tile_q, kv_start, kv_end])
    works = jnp.where(work_ok[None], works, 0)

    # Each cluster takes the works whose cost midpoint falls in its equal share of the total.
    cost = jnp.where(work_ok, 2 * tile_q + kv_end - kv_start, 0).astype(jnp.float32)
    before = jnp.cumsum(cost) - cost
    share = jnp.floor((before + cost / 2) * clusters / jnp.maximum(jnp.sum(cost), 1.0)).astype(i32)
    owner = jnp.where(work_ok, jnp.minimum(share, clusters - 1), clusters)
    work_indptr = jnp.searchsorted(owner, jnp.arange(clusters + 1, dtype=i32), side="left",
                                   method="scan_unrolled").astype(i32)

    # Merge entries: a split tile's rows in max(eff * cluster // limit, 1) groups (<= SMs in all).
    groups = jnp.where(split, jnp.maximum(eff * cluster // limit, 1), 1)
    group_rows = -(-tile_rows // groups)
    entries = jnp.where(split, -(-tile_rows // group_rows), 0)
    num_entries = cluster * clusters
    entry_tile, group, entry_ok = _expand(entries, num_entries)
    first = group * group_rows[entry_tile]
    packed_base = q_indptr[tile_req[entry_tile]] * num_heads + tile_idx[entry_tile] * tile_q
    rows = tile_rows[entry_tile]
    merge = jnp.stack([packed_base + first,
                       packed_base + jnp.minimum(first + group_rows[entry_tile], rows),
                       partial_base[entry_tile] + first,
                       partial_base[entry_tile] + chunks[entry_tile] * rows,
                       rows])
    merge = jnp.where(entry_ok[None], merge, 0)
    return Plan(works.astype(i32), work_indptr, merge.astype(i32), cluster, clusters, 2 * clusters * tile_q)


def prepare(call: Call) -> Plan:
    """The per-step operand of an ``mla_paged_attention`` call: the kernel's schedule (``plan``)."""
    num_tokens, num_heads, _ = call.q.shape
    meta = call.meta
    return plan(meta.cu_q_lens, meta.kv_lens, meta.max_pages_per_seq, num_tokens, num_heads, sm_count(),
                meta.max_q_len, call.params.causal)


def mla_attention(q_latent: jax.Array, q_rope: jax.Array, cache: MLACache, meta: AttentionMetadata,
                  params: AttentionParams, *, prepared: Plan | None = None) -> jax.Array:
    """Absorbed MLA: ``q_latent: [T, Hq, 512]``, ``q_rope: [T, Hq, 64]`` -> ``[T, Hq, 512]``;
    ``prepared``: the schedule (``prepare``; made here when None)."""
    variant = _mla_build.Variant(q_latent.dtype.name, cache.dtype.name, cache.kv_lora_rank, cache.rope_dim)
    target = _mla_build.load(variant)
    rank = q_latent.shape[2]
    schedule = prepared if prepared is not None else prepare(Call("mla_paged_attention", q_latent, cache, meta,
                                                                   params))
    if cache.is_fp8:
        # The kernel's own FP8 scales are launch constants; the pool's scale is traced. Logits are
        # linear in the latents and the output is too, so q carries it in and the output back.
        fold = lambda x: (x.astype(jnp.float32) * cache.scale).astype(x.dtype)  # noqa: E731
        q_latent, q_rope = fold(q_latent), fold(q_rope)
    call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(q_latent.shape, q_latent.dtype),
                                     jax.ShapeDtypeStruct((schedule.partial_rows, rank), q_latent.dtype),
                                     jax.ShapeDtypeStruct((schedule.partial_rows,), jnp.float32)))
    out, _, _ = call(q_latent, q_rope, cache.pages, meta.block_tables.astype(jnp.int32).reshape(-1),
                     schedule.works, schedule.work_indptr, schedule.merge,
                     sm_scale=np.float32(params.scale), causal=params.causal,
                     cluster=np.int64(schedule.cluster), clusters=np.int64(schedule.clusters))
    if cache.is_fp8:
        out = (out.astype(jnp.float32) * cache.scale).astype(out.dtype)
    return out


def _expand(counts: jax.Array, size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Slots ``0..size-1`` dealt to items in order, ``counts[i]`` each: ``(item, index within the
    item, slot in use)``; unused slots point at item 0, index 0."""
    ends = jnp.cumsum(counts)
    slot = jnp.arange(size, dtype=jnp.int32)
    item = jnp.searchsorted(ends, slot, side="right", method="scan_unrolled").astype(jnp.int32)
    used = item < counts.shape[0]
    item = jnp.where(used, item, 0)
    index = jnp.where(used, slot - (ends[item] - counts[item]), 0)
    return item, index, used


def _chunk_limit(average: jax.Array) -> jax.Array:
    """FlashInfer's kv_len_limit for an average of ``average`` keys per cluster: 32, 64, 128, 192
    up to 8, 16, 32, 64, else rounded up to a multiple of 256."""
    return jnp.where(average <= 8, 32, jnp.where(average <= 16, 64, jnp.where(
        average <= 32, 128, jnp.where(average <= 64, 192, -(-average // 256) * 256)))).astype(jnp.int32)


CAPABILITIES = Capabilities(dtypes=DTYPES, fp8_pages=True, layouts=(), options=("non_causal",))
BACKEND = Backend(
    name="flashinfer",
    kernel="FlashInfer's SM90 MLA kernel (the installed flashinfer-python's headers, nvcc on first use) via XLA FFI",
    archs=("sm_90",),
    requirements=lambda: _nvcc.toolchain_reason(_mla_build.check_toolchain),
    # auto: first for every step it takes (bench_mla: 1.01x flashinfer's own MLA wrapper at B=64 x
    # kv 4k x 128 heads, 2.5x triton).
    ops={"mla_paged_attention": OpSupport(run=mla_attention, capabilities=CAPABILITIES, check=check,
                                          rank=constant_rank(RANK_FIRST), prepare=prepare)},
)
