"""The ``fa4`` backend: FlashAttention-4's Hopper forward kernel, compiled inside ``jax.jit``.

The kernel is the installed ``flash-attn-4`` package's CuTe DSL ``FlashAttentionForwardSm90``
(warp-specialised producer/consumer warpgroups, TMA for Q and O, pack-GQA: a KV head's query
heads share one M tile), launched through ``cutlass.jax.cutlass_call`` (``nvidia-cutlass-dsl``):
the kernel is compiled when the call is lowered, its object embedded in the HLO, and the call
runs on XLA's stream and inside its command buffers.

One launch serves any batch: ragged queries (``cu_q_lens``), page tables and KV lengths are
device data, decodes, chunked prefills and prefills alike (no split-KV on SM90, so a decode step
has only B x Hkv tiles of work). Pools are read in place in either layout (HND is presented to
the kernel as NHD by a mode permutation, no copy); pages are gathered by cp.async unless the page
size equals the kernel's key tile (128 at D <= 128), where they stream by TMA.

Masks are bottom-right aligned per sequence, as in the contract. ``sliding_window=w`` is the
kernel's local window (w - 1 keys to the left, none to the right), softcap its score modifier
(after the scale), sinks its learnable sink (a raw logit per query head). Sequences without
keys (padding, or emptied by ``sanitize``) get no tiles: their rows, and tokens past the last
sequence, are zeroed after the kernel by ``kernels.zero_rows``, in place, a write of those rows only.

Supported: bfloat16/float16 q and pages (no FP8 on SM90), head_dim a multiple of 16 up to 256,
GQA/MQA with Hq % Hkv == 0, any page size. Runs on compute capability 9.x only; FA4's SM100
kernels are another class (tcgen05, split-KV, FP8) this backend does not launch.

``mla_prefill`` runs the same kernel over the step's latents expanded into K and V pages of their
own widths (``latents.expanded_pages``; 192 and 128 at DeepSeek's dims): V is not padded to K's
width as cuDNN's graph needs, and the pages are regrouped to the key tile (TMA) where it divides
a sequence's slots.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata

import jax
import jax.numpy as jnp

from jaxattn.backends.base import (RANK_GENERAL, AttentionParams, Backend, Call, Capabilities, OpSupport,
                                   constant_rank)
from jaxattn.backends.latents import expanded_pages
from jaxattn.kv_cache import KVCache, MLACache
from jaxattn.metadata import AttentionMetadata

DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 16          # the cp.async page gather's vector width
FLASH_ATTN_4_VERSION = "4.0.0b36"
INSTALL_HINT = "pip install 'jaxattn[fa4]'"


def requirements() -> str | None:
    """Why the kernel cannot be built here (packages), or None."""
    try:
        importlib.import_module("triton")
    except ImportError as err:
        return f"needs triton, whose kernel zeroes the rows without keys ({INSTALL_HINT}): {err}"
    try:
        importlib.import_module("cutlass.jax")
    except ImportError as err:
        return f"needs nvidia-cutlass-dsl with cutlass.jax ({INSTALL_HINT}): {err}"
    try:
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return f"needs flash-attn-4=={FLASH_ATTN_4_VERSION} ({INSTALL_HINT})"
    if version != FLASH_ATTN_4_VERSION:
        return f"needs flash-attn-4=={FLASH_ATTN_4_VERSION} (its kernel's call signature), found {version}"
    try:
        importlib.import_module("flash_attn.cute.flash_fwd_sm90")
    except ImportError as err:
        return f"flash-attn-4's SM90 kernel does not import: {err}"
    return None


def check(call: Call) -> str | None:
    """The kernel's limits that ``CAPABILITIES`` do not express."""
    head_dim = call.q.shape[2]
    if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM:
        return f"head_dim={head_dim} is not supported; supported: multiples of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}"
    return None


def mla_check(call: Call) -> str | None:
    """The kernel's limits on ``mla_prefill``'s key (Dn + Dr) and value (Dv) widths."""
    for name, width in (("Dn + Dr", call.q.shape[2]), ("Dv", call.w_uv.shape[2])):
        if width % HEAD_DIM_MULTIPLE or width > MAX_HEAD_DIM:
            return f"{name}={width} is not supported; supported: multiples of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}"
    return None


def prepare(call: Call) -> jax.Array:
    """The per-step operand of a ``paged_attention`` call: ``rows_with_keys``."""
    return rows_with_keys(call.meta)


def rows_with_keys(meta: AttentionMetadata) -> jax.Array:
    """int32[B]: the query rows the kernel computes and writes for each sequence of sanitized
    ``meta``: its query length when it has keys, else none (every sequence that breaks the
    contract has ``kv_lens == 0``, so it gets no tiles and no reads)."""
    return jnp.where(meta.kv_lens > 0, meta.q_lens, 0).astype(jnp.int32)


def attention(q: jax.Array, cache: KVCache, meta: AttentionMetadata, params: AttentionParams,
              sinks: jax.Array | None, *, prepared: jax.Array | None = None) -> jax.Array:
    """``q: [T, Hq, D]`` -> ``[T, Hq, D]`` in ``q.dtype``; ``sinks``: float32 ``[Hq]`` or None;
    ``prepared``: ``prepare``'s operand (made here when None)."""
    return attend_pages(q, cache.k_pages, cache.v_pages, cache.layout, meta, params, sinks, prepared)


def mla_prefill(q: jax.Array, cache: MLACache, meta: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array,
                params: AttentionParams) -> jax.Array:
    """MLA prefill over the latents expanded to per-head K (Dn + Dr wide) and V (Dv wide) pages
    (``mla_pages``): the kernel takes the two widths, so V is not padded to K's.
    ``q: [T, Hq, Dn + Dr]`` (whole) -> ``[T, Hq, Dv]`` in ``q.dtype``."""
    k_pages, v_pages, meta = mla_pages(cache, meta, w_uk, w_uv, q.dtype, params.causal)
    return attend_pages(q, k_pages, v_pages, "NHD", meta, params, None)


def mla_pages(cache: MLACache, meta: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array, dtype: jnp.dtype,
              causal: bool) -> tuple[jax.Array, jax.Array, AttentionMetadata]:
    """``latents.expanded_pages`` in pages of the kernel's key tile, which stream by TMA (cp.async
    gathers any other size), where the tile divides a sequence's slots; else of the cache's size."""
    slots = meta.max_pages_per_seq * cache.page_size
    tile = _tiles(w_uk.shape[2] + cache.rope_dim, w_uv.shape[2], causal, local=False).n_block_size
    return expanded_pages(cache, meta, w_uk, w_uv, dtype, page_size=tile if slots % tile == 0 else None)


def attend_pages(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layout: str, meta: AttentionMetadata,
                 params: AttentionParams, sinks: jax.Array | None, q_used: jax.Array | None = None) -> jax.Array:
    """The kernel over page pools ``[pages, Hkv, page, D]`` (HND) or ``[pages, page, Hkv, D]``
    (NHD), V's width Dv may differ from K's, and sanitized ``meta``: ``q: [T, Hq, D]`` ->
    ``[T, Hq, Dv]`` in ``q.dtype``. ``q_used``: ``rows_with_keys(meta)`` (made here when None)."""
    from cutlass.jax import TensorSpec, cutlass_call

    from jaxattn.kernels.zero_rows import zero_unwritten_rows

    num_tokens, num_q_heads, head_dim = q.shape
    heads_axis = 1 if layout == "HND" else 2
    config = _Config(dtype=q.dtype.name, head_dim=head_dim, head_dim_v=v_pages.shape[-1],
                     group=num_q_heads // k_pages.shape[heads_axis],
                     causal=params.causal or params.sliding_window is not None,
                     window_left=None if params.sliding_window is None else params.sliding_window - 1,
                     softcap=params.softcap, page_size=k_pages.shape[3 - heads_axis])
    if q_used is None:
        q_used = rows_with_keys(meta)
    pool = TensorSpec(mode=(0, 2, 1, 3)) if layout == "HND" else None
    out = cutlass_call(
        _launch(), output_shape_dtype=jax.ShapeDtypeStruct((num_tokens, num_q_heads, config.head_dim_v), q.dtype),
        input_spec=(None, pool, pool, None, None, None, None, None),
        compile_key=("jaxattn.fa4", config, layout, sinks is not None),
        kernel=_kernel(config), scale=float(params.scale), window_left=config.window_left,
        window_right=None if params.sliding_window is None else 0,
    )(q, k_pages, v_pages, meta.cu_q_lens, q_used, meta.kv_lens, meta.block_tables, sinks)
    return zero_unwritten_rows(out, meta.cu_q_lens, q_used)


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static facts one compiled kernel is specialised on (part of the compile key)."""

    dtype: str
    head_dim: int               # of queries and keys
    head_dim_v: int             # of values and the output
    group: int                  # query heads per KV head
    causal: bool                # keys after the query masked (also under a sliding window)
    window_left: int | None     # keys left of the diagonal a query sees (None: all)
    softcap: float | None
    page_size: int


@functools.cache
def _kernel(config: _Config):
    """FA4's SM90 forward kernel object for ``config`` (one per configuration: cutlass_call's
    compile cache keys on it), with FA4's own tile choice for this head dim and mask."""
    import cutlass
    from flash_attn.cute import utils
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    local = config.window_left is not None
    tiles = _tiles(config.head_dim, config.head_dim_v, config.causal and not local, local)
    return FlashAttentionForwardSm90(
        {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[config.dtype],
        config.head_dim, config.head_dim_v, config.group,
        is_causal=config.causal and not local, is_local=local, pack_gqa=config.group > 1,
        tile_m=tiles.m_block_size, tile_n=tiles.n_block_size, num_stages=2,
        num_threads=(tiles.m_block_size // 64 + 1) * 128, Q_in_regs=False,
        intra_wg_overlap=tiles.intra_wg_overlap, mma_pv_is_rs=tiles.mma_pv_is_rs,
        score_mod=None if config.softcap is None else utils.create_softcap_scoremod(config.softcap),
        paged_kv_non_tma=config.page_size != tiles.n_block_size)


def _tiles(head_dim: int, head_dim_v: int, causal: bool, local: bool):
    """FA4's SM90 tile choice (``m_block_size``, ``n_block_size``, ...) for these head dims and mask."""
    from flash_attn.cute import interface

    return interface._tile_size_fwd_sm90(head_dim, head_dim_v, causal, local)


@functools.cache
def _launch():
    """The ``@cute.jit`` entry cutlass_call compiles: (stream, *inputs, *outputs, **static)."""
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def launch(stream, q, k_pages, v_pages, cu_q_lens, q_used, kv_lens, block_tables, sinks, out, *,
               kernel, scale, window_left, window_right):
        kernel(q, k_pages, v_pages, out, None, cutlass.Float32(scale), mCuSeqlensQ=cu_q_lens, mSeqUsedQ=q_used,
               mSeqUsedK=kv_lens, mPageTable=block_tables, window_size_left=window_left,
               window_size_right=window_right, learnable_sink=sinks, stream=stream)

    return launch


RANK_LAST_GPU = 5 * RANK_GENERAL
CAPABILITIES = Capabilities(dtypes=DTYPES)
# The latents are expanded (FP8 ones dequantized) into bf16/fp16 pages before the kernel runs.
MLA_CAPABILITIES = Capabilities(dtypes=DTYPES, fp8_pages=True, layouts=(), options=("non_causal",))
BACKEND = Backend(
    name="fa4",
    kernel="FlashAttention-4's SM90 forward kernel (flash-attn-4, CuTe DSL) via cutlass.jax.cutlass_call",
    archs=("sm_90",),
    requirements=requirements,
    # auto, without a measured choice: after cudnn and triton for prefills; last before the
    # reference for (speculative) decodes, which have no split-KV here (B x Hkv tiles of work);
    # MLA prefill after cudnn where no measured table decides (sm_90's puts fa4 first at every
    # MLA prefill point it timed).
    ops={"paged_attention": OpSupport(run=attention, capabilities=CAPABILITIES, check=check,
                                      rank=lambda call: RANK_GENERAL + 1 if call.phase == "prefill" else RANK_LAST_GPU,
                                      prepare=prepare),
         "mla_prefill": OpSupport(run=mla_prefill, capabilities=MLA_CAPABILITIES, check=mla_check,
                                  rank=constant_rank(RANK_GENERAL))},
)
