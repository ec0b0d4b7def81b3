"""Our Triton paged-attention kernels (``jaxattn.kernels.triton_attention``), launched from JAX.

Launch plans, all inside one jitted call with static grids (everything per-step is read from the
metadata's device arrays):

* ``launch="split"`` (default): a decode-only step (``meta.max_q_len == 1``) runs the 3D split-KV
  decode kernel and its reduction, and so does a short-query (speculative) step whose tokens fit
  the kernel's M tile (``split_query_tokens``); a mixed step runs those for its leading decodes,
  then the 2D kernel for the rest, writing in place into the same output buffer (aliased).
* ``launch="single"``: the 2D kernel alone serves every sequence (one launch), for comparison.

``mla_attention`` runs absorbed multi-head latent attention (``jaxattn.mla``) with
``jaxattn.kernels.triton_mla``: split-KV over the latent pages, query heads as the M tile, and a
segment reduction (skipped when one segment suffices). ``mla_prefill`` runs the paged kernels
above over the latents expanded to per-head K and V (``latents.attend_expanded``: one pool of
``max(Dn + Dr, Dv)``-wide pages, V zero-padded, as the cudnn backend does), so that MLA prefill
has a GPU kernel where cuDNN's handler is not built and FlashAttention-4 is not installed.

Block sizes come from ``decode_config`` / ``short_query_config`` / ``prefill_config`` (measured on
an H200, see ``benchmarks/TUNING.md``), or are passed explicitly. On CPU the kernels run under Triton's
interpreter (tests only; the registry reports the backend unavailable there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.backends.base import (RANK_GENERAL, AttentionParams, Backend, Call, Capabilities, OpSupport,
                                    constant_rank)
from jaxattn.backends.latents import attend_expanded
from jaxattn.kv_cache import KVCache, MLACache
from jaxattn.metadata import SPEC_DECODE_MAX_Q_LEN, AttentionMetadata

DTYPES = ("float32", "bfloat16", "float16")
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
LAUNCHES = ("split", "single")
MIN_TRITON = (3, 6)
# MLA, auto: queries up to MLA_MAX_DECODE_Q_LEN tokens go to the decode kernel (one program per
# query token), unless the step's tokens times the table's width in keys is at most
# MLA_XLA_MAX_DECODE_KEYS: there the xla backend's one gather and two einsums beat the split-KV
# launch (H100, bench_mla: B=1 x kv 1k-16k at 16 and 128 heads, 0.31-0.74x of triton's time;
# B=16 x kv 1k: 0.54x at 16 heads, 1.11x at 128).
MLA_MAX_DECODE_Q_LEN = SPEC_DECODE_MAX_Q_LEN
MLA_XLA_MAX_DECODE_KEYS = 16384
# Decode: KV segments are chosen to give about this many programs (B x Hkv x segments; ~8 per SM
# of a 132-SM H100/H200), with at least _MIN_TILES_PER_SEGMENT KV tiles each. Chosen on an H200 by
# benchmarks/tune_triton.py (benchmarks/TUNING.md, "Triton block sizes"): at D=128,
# B=64 x kv 4096 -> 2 segments, 0.263 ms (best of 54 configs: 0.261); B=8 x kv 4096 -> 8 segments,
# 0.052 ms (best of 12: 0.052).
_DECODE_PROGRAMS = 1024
_MIN_TILES_PER_SEGMENT = 8
# Few (sequence, KV head) pairs: up to this many segments of at least one tile, each tile as long as
# a segment's share of the keys (16 to 64), at D = 65..128. Chosen on an H100 by
# ``benchmarks/tune_triton.py --decode-points`` (benchmarks/TUNING.md, "Triton decode tiles and KV
# segments"; do_bench, decode + reduce): B=1 x kv 512, 16-key tiles x 32 segments 11.9 us (the rule
# above: one segment of 64-key tiles, 20.6 us); kv 1024 13.3 us (21.2); kv 4096 19.1 us (24.2);
# kv 16384 41.5 us (46.7); B=2 x kv 4096 26.5 us (30.0); B=4 x kv 4096 41.9 us (42.2; best 41.7).
# Pipeline stages: 2 for 16-key tiles, 3 for 32-key tiles; 64-key tiles take 3 only while the launch
# has at most _DEEP_PIPELINE_PROGRAMS programs (about 2 per SM, latency not hidden by other programs),
# else 2. The H200 sweep (TUNING.md, "...: triton-decode-tiles-h200"), 64-key tiles x 32 segments,
# 2 stages against 3: B=2 x kv 16384 50.6 us (57.2), B=2 x kv 65536 140.9 us (171.8), B=4 x kv 16384
# 82.8 us (85.2); B=1 (256 programs) x kv 16384 32.9 us (32.5), and in bench_jax_peers 2 stages lost
# 2-4% at B=1 x kv 32k and 128k.
_FEW_DECODE_PAIRS = 32
_FEW_PAIRS_MAX_SEGMENTS = 32
_DEEP_PIPELINE_PROGRAMS = 256
# Short-query steps (speculative decode) run in the split-KV kernels while a sequence's query
# tokens x its group's heads fit in this many rows (split_query_tokens).
_SPLIT_QUERY_ROWS = 64
# Short-query steps the split-KV kernels do not take (launch="single", or more rows than those):
# the 2D kernel takes one small query tile per (sequence, KV head) up to this many rows, and longer
# key tiles below this many (sequence, KV head) pairs.
_SHORT_QUERY_ROWS = 64
_FEW_PAIRS = 256
# MLA: KV segments are chosen to give about this many programs (query tokens x head blocks x
# segments; 2 per SM of a 132-SM H100/H200: each program streams [block_n, 576] latent tiles).
_MLA_PROGRAMS = 264
# Over FP8 latents one per SM (132 on an H100/H200): the 8-warp programs that widen them fill an
# SM's registers (tune_mla --fp8, B=128 kv 4096 Hq 16: 1 segment 261 us against 302 us for 2);
# past that many sequences mla_config takes 4-warp tiles, two of which share an SM.
_MLA_FP8_PROGRAMS = 132


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """2D kernel tiles: ``block_m`` query rows (tokens x heads of one group), ``block_n`` keys."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """3D kernel tiles: ``block_n`` keys per tile, KV split into ``num_segments`` (a power of 2)."""

    block_n: int
    num_segments: int
    num_warps: int
    num_stages: int


def requirements() -> str | None:
    """Why the kernels cannot be launched on this GPU machine (the triton package, jaxlib's launcher)."""
    try:
        import triton
    except ImportError:
        return "needs the triton package (pip install 'jaxattn[triton]')"
    version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    if version < MIN_TRITON:
        return f"needs triton >= {'.'.join(map(str, MIN_TRITON))}, found {triton.__version__}"
    from jax._src.lib import gpu_triton
    if not hasattr(gpu_triton, "TritonKernelCall"):
        return "this jaxlib's CUDA plugin has no Triton launcher (jax._src.lib.gpu_triton)"
    return None


def check(call: Call) -> str | None:
    """The kernels' limit that ``CAPABILITIES`` do not express: the head width."""
    if not MIN_HEAD_DIM <= call.q.shape[2] <= MAX_HEAD_DIM:
        return f"head_dim must be in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {call.q.shape[2]}"
    return None


def decode_config(head_dim: int, batch: int, num_kv_heads: int, max_kv_len: int) -> DecodeConfig:
    """Decode tiles for this shape (static), 4 warps. At most ``_FEW_DECODE_PAIRS`` (sequence, KV
    head) pairs (D 65..128): more and shorter segments (the H100 sweep above). Otherwise, from the
    H200 sweep (benchmarks/TUNING.md, "Triton block sizes"), B=64 x kv 4096 (best of 54 configs in
    brackets):

    * D <= 64: 64-key tiles, 2 stages: 0.143 ms (0.141; 3 stages 0.175).
    * D <= 128: 64-key tiles, 3 stages: 0.263 ms (0.261; 2 stages 0.273).
    * D > 128: 32-key tiles, 2 stages: 0.504 ms (0.500; 3 stages 0.528).
    """
    if _interpreting():
        return DecodeConfig(block_n=16, num_segments=4, num_warps=4, num_stages=1)
    if batch * num_kv_heads <= _FEW_DECODE_PAIRS and 64 < head_dim <= 128:
        segments = max(1, min(_pow2_ceil(-(-_DECODE_PROGRAMS // (batch * num_kv_heads))), _FEW_PAIRS_MAX_SEGMENTS,
                              _pow2_floor(max(1, max_kv_len // 16))))
        keys = -(-max_kv_len // segments)
        block_n = 16 if keys <= 16 else 32 if keys <= 256 else 64
        deep = block_n == 32 or (block_n == 64 and batch * num_kv_heads * segments <= _DEEP_PIPELINE_PROGRAMS)
        return DecodeConfig(block_n=block_n, num_segments=segments, num_warps=4, num_stages=3 if deep else 2)
    block_n = 64 if head_dim <= 128 else 32
    segments = _pow2_ceil(-(-_DECODE_PROGRAMS // (batch * num_kv_heads)))
    most = max(1, -(-max_kv_len // (_MIN_TILES_PER_SEGMENT * block_n)))
    segments = max(1, min(segments, 16, _pow2_floor(most)))
    return DecodeConfig(block_n=block_n, num_segments=segments, num_warps=4,
                        num_stages=3 if 64 < head_dim <= 128 else 2)


def prefill_config(head_dim: int, dtype) -> PrefillConfig:
    """2D kernel tiles for this head dim and query dtype (static), from the H200 sweep
    (benchmarks/TUNING.md, "Triton block sizes"): each is the winner at B=8 x 4096
    causal and on the mixed batch's prefill part.

    * D <= 64: 128 x 128, 4 warps, 2 stages: 1.63 ms = 338 TFLOP/s.
    * D <= 128: 256 x 64, 8 warps, 3 stages: 2.62 ms = 419 TFLOP/s (before the sweep, 128 x 64, 8
      warps, 2 stages: 3.37 ms).
    * D > 128: 128 x 64, 8 warps, 3 stages: 4.92 ms = 447 TFLOP/s (before, 64 x 32: 13.2 ms).
    float32 queries (not swept) keep tiles whose K/V stages fit in shared memory.
    """
    if _interpreting():
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    four_bytes = jnp.dtype(dtype).itemsize == 4
    if head_dim <= 64:
        return PrefillConfig(block_m=64 if four_bytes else 128, block_n=128, num_warps=4, num_stages=2)
    if head_dim <= 128:
        return PrefillConfig(block_m=128 if four_bytes else 256, block_n=64, num_warps=8,
                             num_stages=2 if four_bytes else 3)
    if four_bytes:
        return PrefillConfig(block_m=32, block_n=32, num_warps=8, num_stages=2)
    return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


def short_query_config(head_dim: int, dtype, max_q_len: int | None, group: int, batch: int,
                       num_kv_heads: int) -> PrefillConfig | None:
    """2D kernel tiles for a step whose query lengths are all at most ``max_q_len`` (static),
    when one query tile of ``max(16, pow2(max_q_len) * pow2(group))`` rows holds a sequence's
    tokens and that is at most 64 rows; None otherwise (``prefill_config`` applies). From the H200
    sweep (benchmarks/TUNING.md, "Triton short-query tiles"; D=128, kv 4096; the best
    of 54 configs in brackets where it is not this one), 4 warps, 2 stages:

    * B=64, q_len 4: 16 x 64 tiles: 0.254 ms (the winner).
    * B=64, q_len 16: 64 x 64: 0.276 ms (the winner).
    * B=8, q_len 4: only 64 (sequence, KV head) pairs, so 128-key tiles: 16 x 128: 0.084 ms (0.081).
    """
    if max_q_len is None or _interpreting():
        return None
    block_m = max(16, _pow2_ceil(max_q_len) * _pow2_ceil(group))
    if block_m > _SHORT_QUERY_ROWS:
        return None
    four_bytes = jnp.dtype(dtype).itemsize == 4
    if four_bytes and head_dim > 128:            # the K/V stages must fit in shared memory
        block_n = 32
    elif batch * num_kv_heads < _FEW_PAIRS and not four_bytes and head_dim <= 128:
        block_n = 128
    else:
        block_n = 64
    return PrefillConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)


def split_query_tokens(max_q_len: int | None, group: int) -> int | None:
    """Query tokens per sequence of the split-KV kernels' M tile when a step runs whole in them:
    1 for a decode-only step; ``pow2(max_q_len)`` for a short-query (speculative) step whose tile
    of that many tokens x ``pow2(group)`` heads is at most ``_SPLIT_QUERY_ROWS`` rows; None
    otherwise (the split launch's decodes, then the 2D kernel)."""
    if max_q_len == 1:
        return 1
    if max_q_len is None or max_q_len > SPEC_DECODE_MAX_Q_LEN:
        return None
    tokens = _pow2_ceil(max_q_len)
    return tokens if tokens * _pow2_ceil(group) <= _SPLIT_QUERY_ROWS else None


def prepare(call: Call) -> jax.Array | None:
    """The per-step operand of a split launch over a step that is not decode-only: its decode count
    (``meta.checked_num_decodes``, int32[1]); None for a decode-only step, whose count is the batch
    (a constant)."""
    group = call.q.shape[1] // call.cache.num_kv_heads
    return None if split_query_tokens(call.meta.max_q_len, group) is not None else \
        call.meta.checked_num_decodes.reshape(1)


def attention(q: jax.Array, cache: KVCache, meta: AttentionMetadata, params: AttentionParams,
              sinks: jax.Array | None, *, launch: str = "split", decode: DecodeConfig | None = None,
              prefill: PrefillConfig | None = None, prepared: jax.Array | None = None) -> jax.Array:
    """``q: [T, Hq, D]`` -> ``[T, Hq, D]`` in ``q.dtype``; ``launch`` is "split" or "single";
    ``prepared``: ``prepare``'s decode count (made here when None)."""
    from jaxattn.kernels import triton_attention as kernels
    from jaxattn.kernels.triton_call import triton_call

    if launch not in LAUNCHES:
        raise ValueError(f"triton.attention: launch must be one of {LAUNCHES}, got {launch!r}")
    num_tokens, num_q_heads, head_dim = q.shape
    batch, width = meta.batch_size, meta.max_pages_per_seq
    group = num_q_heads // cache.num_kv_heads
    # Operands the kernels do not read in this configuration are one-element numpy constants: XLA
    # keeps them as literals, where a jnp.zeros (or a constant of two or more equal elements, which
    # XLA's simplifier rewrites as a broadcast) costs a broadcast kernel on every call.
    sinks_arg = np.zeros((1,), np.float32) if sinks is None else sinks.astype(jnp.float32)
    # FP8 scales as two operands: the cache's scalars as they are (a reshape is free), not a stack
    # (a concatenate kernel per call); the kernels check them (checks_fp8_scales).
    k_scale, v_scale = (np.zeros((1,), np.float32),) * 2
    if cache.is_fp8:
        k_scale, v_scale = (scale.reshape(1).astype(jnp.float32) for scale in (cache.k_scale, cache.v_scale))
    strides = _kv_strides(cache)
    dot_f32 = q.dtype == jnp.float32 or _interpreting()
    shared = dict(
        HQ=num_q_heads, G=group, D=head_dim, D_P=_pow2_ceil(head_dim), PAGE=cache.page_size,
        NUM_PAGES=cache.num_pages, SK_P=strides[0], SK_H=strides[1], SK_T=strides[2], SCALE=float(params.scale),
        SOFTCAP=float(params.softcap or 0.0), WINDOW=int(params.sliding_window or 0), CAUSAL=params.causal,
        FP8=cache.is_fp8, DOT_F32=dot_f32, PRECISION="ieee" if dot_f32 else "tf32", T=num_tokens, B=batch,
        P=width)
    log_b = (batch + 1).bit_length() + 1
    out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)

    # A short-query step (every query at most split_query_tokens tokens) runs whole in the split-KV
    # kernels, its query tokens in the M tile; a decode-only step is the one-token case.
    query_tokens = split_query_tokens(meta.max_q_len, group) if launch == "split" else None
    out = None
    if launch == "split":
        if query_tokens is not None:
            num_decodes = np.full((1,), batch, np.int32)
        elif prepared is not None:
            num_decodes = prepared
        else:
            num_decodes = meta.checked_num_decodes.reshape(1)
        cfg = decode or decode_config(head_dim, batch, cache.num_kv_heads, width * cache.page_size)
        nseg, qt = cfg.num_segments, query_tokens or 1
        seg_acc, seg_ml = triton_call(
            q, cache.k_pages, cache.v_pages, meta.block_tables, meta.kv_lens, meta.cu_q_lens, num_decodes, k_scale,
            v_scale,
            kernel=kernels.paged_decode_kernel,
            out_shape=[jax.ShapeDtypeStruct((batch * qt, num_q_heads, nseg, head_dim), jnp.float32),
                       jax.ShapeDtypeStruct((batch * qt, num_q_heads, nseg, 2), jnp.float32)],
            grid=(batch, cache.num_kv_heads, nseg), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            G_P=_pow2_ceil(group), QT=qt, BLOCK_M=max(16, qt * _pow2_ceil(group)), BLOCK_N=cfg.block_n, NSEG=nseg,
            **_subset(shared, "T B P HQ G D D_P PAGE NUM_PAGES SK_P SK_H SK_T SCALE SOFTCAP WINDOW CAUSAL FP8 "
                              "DOT_F32 PRECISION"))
        (out,) = triton_call(
            meta.cu_q_lens, num_decodes, sinks_arg, k_scale, v_scale, seg_acc, seg_ml,
            kernel=kernels.paged_decode_reduce_kernel,
            out_shape=[out_type], grid=(batch if query_tokens is None else num_tokens, cache.num_kv_heads),
            num_warps=4, num_stages=1, LOG_B=log_b, G_P=_pow2_ceil(group), QT=qt, NSEG=nseg,
            HAS_SINKS=sinks is not None, WRITE_ALL=query_tokens is not None, **_subset(shared, "T B HQ G D D_P FP8"))
        if query_tokens is not None:
            return out
    else:
        num_decodes = np.zeros((1,), np.int32)

    cfg = (prefill or short_query_config(head_dim, q.dtype, meta.max_q_len, group, batch, cache.num_kv_heads)
           or prefill_config(head_dim, q.dtype))
    block_m = max(cfg.block_m, _pow2_ceil(group))
    rows_per_block = block_m // _pow2_ceil(group)
    (out,) = triton_call(
        q, cache.k_pages, cache.v_pages, meta.block_tables, meta.kv_lens, meta.cu_q_lens, num_decodes, sinks_arg,
        k_scale, v_scale, num_decodes if out is None else out,
        kernel=kernels.paged_prefill_kernel, out_shape=[out_type],
        grid=(num_tokens // rows_per_block + batch + 2, cache.num_kv_heads),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        input_output_aliases=None if out is None else {10: 0},
        LOG_B=log_b, G_P=_pow2_ceil(group), BLOCK_M=block_m, BLOCK_N=cfg.block_n, HAS_SINKS=sinks is not None,
        **_subset(shared, "T B P HQ G D D_P PAGE NUM_PAGES SK_P SK_H SK_T SCALE SOFTCAP WINDOW CAUSAL FP8 "
                          "DOT_F32 PRECISION"))
    return out


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """MLA kernel tiles: ``block_h`` query heads of ``tokens`` consecutive query tokens of one
    sequence (the M tile, ``tokens * block_h`` rows), ``block_n`` keys, the KV split into
    ``num_segments`` (a power of 2; 1 writes the output directly, without the reduction);
    ``f16_dots``: over FP8 pages, both dots in float16 (the kernel's ``F16_DOTS``) rather than in
    the queries' dtype (bf16 or f16 queries only)."""

    tokens: int
    block_h: int
    block_n: int
    num_segments: int
    num_warps: int
    num_stages: int
    f16_dots: bool = False


def mla_check(call: Call) -> str | None:
    """The MLA kernels' limits: power-of-2 latent widths."""
    for name in ("kv_lora_rank", "rope_dim"):
        dim = getattr(call.cache, name)
        if dim < MIN_HEAD_DIM or dim & (dim - 1):
            return f"the cache's {name} must be a power of 2 >= {MIN_HEAD_DIM}, got {dim}"
    return None


def mla_prefill_check(call: Call) -> str | None:
    """The paged kernels' head-width limit over the expanded pool (K of Dn + Dr, V padded to it)."""
    width = max(call.q.shape[2], call.w_uv.shape[2])
    if not MIN_HEAD_DIM <= width <= MAX_HEAD_DIM:
        return f"max(Dn + Dr, Dv) must be in {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {width}"
    return None


def mla_prefill(q: jax.Array, cache: MLACache, meta: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array,
                params: AttentionParams) -> jax.Array:
    """MLA prefill on the paged kernels over the expanded pool (module docstring):
    ``q: [T, Hq, Dn + Dr]`` (whole) -> ``[T, Hq, Dv]`` in ``q.dtype``."""
    return attend_expanded(attention, q, cache, meta, w_uk, w_uv, params)


def mla_rank(call: Call) -> int | None:
    """auto: short queries (``MLA_MAX_DECODE_Q_LEN``) past ``MLA_XLA_MAX_DECODE_KEYS`` token-keys."""
    keys = call.q.shape[0] * call.meta.max_pages_per_seq * call.cache.page_size
    short = call.meta.max_q_len is not None and call.meta.max_q_len <= MLA_MAX_DECODE_Q_LEN
    return RANK_GENERAL if short and keys > MLA_XLA_MAX_DECODE_KEYS else None


def mla_config(num_tokens: int, num_q_heads: int, kv_lora_rank: int, max_kv_len: int, max_q_len: int | None,
               fp8: bool = False) -> MLAConfig:
    """Tiles for this shape (static); KV segments give about ``_MLA_PROGRAMS`` programs
    (``_MLA_FP8_PROGRAMS`` over FP8 latents).

    bf16 decode, from ``benchmarks/tune_mla.py`` (TUNING.md, "MLA decode tiles"; H100, R 512,
    Dr 64): up to 16 heads, 16 heads x 64 keys, 4 warps, 3 stages (B=128 kv 4096: 222 us against
    264 for the earlier 8 warps, 2 stages); more heads, 64 heads x 64 keys, 8 warps, 3 stages (B=64
    kv 4096 Hq 128: 335 us against 437 for 32 keys, 2 stages), but 32 heads x 64 keys, 2 stages when
    even 32 segments of 64-head tiles leave SMs idle (B=1 kv 16384: 50 us against 67). Not timed:
    speculative decode with 16 heads (16 heads of up to 4 tokens, 16-key tiles, wgmma).

    FP8 pools, from ``tune_mla --fp8`` (TUNING.md, "MLA decode tiles over FP8 latents"): up to 16
    heads, both dots in f16 (``f16_dots``), one token per program; 16 heads x 32 keys, 4 warps, 3
    stages where there are more sequences than SMs (B=256 kv 1536: 161 us against 196 for 64 keys,
    8 warps, and 207 with bf16 dots), else 16 heads x 64 keys, 8 warps, 4 stages (B=128 kv 4096:
    252 us against 297 for the 32-key tiles); more heads, the bf16 tiles with bf16 dots, 64-head
    tiles at 2 stages (B=64 kv 4096 Hq 128: 414 us, 424 at 3 stages, 512 with f16 dots, 930 with
    the 32 x 32 tiles before). Every choice compiles for sm_90 without spilling registers, but
    FP8's 64-head tiles: they spill some 380 bytes and still beat every tile that does not
    (``tests/backends/test_triton_mla.py``)."""
    if _interpreting():
        return MLAConfig(tokens=1, block_h=16, block_n=16, num_segments=1 if max_kv_len <= 32 else 2, num_warps=4,
                         num_stages=1)
    tokens = 1
    if num_q_heads <= 16:
        block_h = 16
        tokens = 1 if fp8 else min(4, _pow2_ceil(min(max_q_len or num_tokens, num_tokens)))
        if fp8:
            block_n, warps, stages = (32, 4, 3) if num_tokens > _MLA_FP8_PROGRAMS else (64, 8, 4)
        else:
            block_n, warps, stages = (64, 4, 3) if tokens == 1 else (16, 8, 2)
    elif num_tokens * -(-num_q_heads // 64) * 32 < _MLA_PROGRAMS:
        block_h, block_n, warps, stages = 32, 64, 8, 2
    else:
        block_h, block_n, warps, stages = 64, 64, 8, 2 if fp8 else 3
    if kv_lora_rank > 512:                       # the tiles above fill shared memory at R 512
        block_n, stages = min(block_n, 32), min(stages, 2)
    programs = -(-num_tokens // tokens) * -(-num_q_heads // block_h)
    most = max(1, -(-max_kv_len // (_MIN_TILES_PER_SEGMENT * block_n)))
    target = _MLA_FP8_PROGRAMS if fp8 else _MLA_PROGRAMS
    segments = max(1, min(_pow2_floor(max(1, target // programs)), 32, _pow2_floor(most)))
    return MLAConfig(tokens=tokens, block_h=block_h, block_n=block_n, num_segments=segments, num_warps=warps,
                     num_stages=stages, f16_dots=fp8 and block_h == 16)


def mla_attention(q_latent: jax.Array, q_rope: jax.Array, cache: MLACache, meta: AttentionMetadata,
                  params: AttentionParams, *, config: MLAConfig | None = None) -> jax.Array:
    """Absorbed MLA: ``q_latent: [T, Hq, R]``, ``q_rope: [T, Hq, Dr]`` -> ``[T, Hq, R]`` in
    ``q_latent.dtype``; one program per (group of a sequence's query tokens, head block, KV
    segment), any query lengths."""
    from jaxattn.kernels import triton_mla as kernels
    from jaxattn.kernels.triton_call import triton_call

    num_tokens, num_q_heads, rank = q_latent.shape
    batch, width = meta.batch_size, meta.max_pages_per_seq
    cfg = config or mla_config(num_tokens, num_q_heads, rank, width * cache.page_size, meta.max_q_len, cache.is_fp8)
    nseg = cfg.num_segments
    head_blocks = -(-num_q_heads // cfg.block_h)
    dot_f32 = q_latent.dtype == jnp.float32 or _interpreting()
    f16_dots = cfg.f16_dots and cache.is_fp8 and q_latent.dtype != jnp.float32
    direct = nseg == 1
    acc_type = (jax.ShapeDtypeStruct(q_latent.shape, q_latent.dtype) if direct
                else jax.ShapeDtypeStruct((num_tokens, num_q_heads, nseg, rank), jnp.float32))
    scales = np.zeros((1,), np.float32) if cache.scale is None else cache.scale.reshape(1).astype(jnp.float32)
    acc, ml = triton_call(
        q_latent, q_rope, cache.pages, meta.block_tables, meta.kv_lens, meta.cu_q_lens, scales,
        kernel=kernels.mla_decode_kernel,
        out_shape=[acc_type, jax.ShapeDtypeStruct((num_tokens, num_q_heads, nseg, 2), jnp.float32)],
        grid=(num_tokens * nseg * head_blocks,), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        T=num_tokens, B=batch, LOG_B=batch.bit_length() + 1, P=width, HQ=num_q_heads, R=rank, DR=cache.rope_dim,
        PAGE=cache.page_size, NUM_PAGES=cache.num_pages, QT=cfg.tokens, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        NSEG=nseg, SCALE=float(params.scale), CAUSAL=params.causal, FP8=cache.is_fp8, F16_DOTS=f16_dots,
        DIRECT=direct, DOT_F32=dot_f32, PRECISION="ieee" if dot_f32 else "tf32")
    if direct:
        return acc
    (out,) = triton_call(acc, ml, kernel=kernels.mla_reduce_kernel,
                         out_shape=[jax.ShapeDtypeStruct(q_latent.shape, q_latent.dtype)],
                         grid=(num_tokens, -(-num_q_heads // 16)), num_warps=4, num_stages=1,
                         HQ=num_q_heads, R=rank, NSEG=nseg, BLOCK_H=16)
    return out


def _kv_strides(cache: KVCache) -> tuple[int, int, int]:
    """Element strides of (page, KV head, token in page) in the page pools."""
    page, heads, dim = cache.page_size, cache.num_kv_heads, cache.head_dim
    if cache.layout == "HND":
        return heads * page * dim, page * dim, dim
    return page * heads * dim, dim, heads * dim


def _subset(values: dict, names: str) -> dict:
    return {n: values[n] for n in names.split()}


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _interpreting() -> bool:
    return jax.default_backend() == "cpu"


CAPABILITIES = Capabilities(dtypes=DTYPES, fp8_pages=True)
BACKEND = Backend(
    name="triton",
    kernel="our Triton kernels (2D prefill, 3D split-KV decode + reduce; MLA split-KV) via jaxlib's Triton FFI call",
    archs=("sm_80+",),
    requirements=requirements,
    ops={
        # auto: behind trtllm (decode, short speculative decode) and cudnn (prefill), ahead of xla.
        "paged_attention": OpSupport(run=attention, capabilities=CAPABILITIES, check=check,
                                     rank=constant_rank(RANK_GENERAL), prepare=prepare, checks_fp8_scales=True),
        "mla_paged_attention": OpSupport(run=mla_attention, check=mla_check, rank=mla_rank,
                                         capabilities=Capabilities(dtypes=DTYPES, fp8_pages=True, layouts=(),
                                                                   options=("non_causal",))),
        # auto, without a measured choice: after cudnn (RANK_FIRST) and fa4 (RANK_GENERAL), ahead of xla
        "mla_prefill": OpSupport(run=mla_prefill, check=mla_prefill_check, rank=constant_rank(RANK_GENERAL + 1),
                                 capabilities=Capabilities(dtypes=DTYPES, fp8_pages=True, layouts=(),
                                                           options=("non_causal",))),
    },
)
