"""A Triton grouped GEMM for a mixture of experts: rows grouped by expert, each group padded to a
whole number of ``BLOCK_M``-row blocks, every block multiplied by its own expert's weights.

``rows [R, K]`` holds the token copies in expert order; ``block_expert int32[R / BLOCK_M]`` names
each block's expert, or -1 for the blocks past the last group (their output rows are left
unwritten). A program computes one ``BLOCK_M x BLOCK_N`` tile of one block, so only the experts
that some row uses have their weights read (a decode batch that touches 6 of 64 experts reads 6),
and at large batches each expert's tile is reused across its blocks from L2. With ``swiglu`` the
kernel takes two weight stacks (gate, up) and writes ``silu(rows @ gate) * (rows @ up)``: the
rows are read once for both. FP8 weights are read as FP8; with rows in the model's dtype they are
converted to it for the dot (weight-only FP8), with FP8 rows (``quantize_rows``, one scale per
row) FP8 meets FP8 in the dot: on an H100, with Triton 3.6, an FP8 x FP8 warpgroup MMA for 64-row
blocks and for ``swap_ab`` tiles, but an f16 ``mma.sync`` for 16- and 32-row blocks straight (the
FP8 operands converted in registers; ``tests/kernels/test_grouped_gemm.py`` compiles both for
sm_90; the sm_90 tiles table gives those blocks swapped tiles). Scales per row, expert or output channel multiply the
accumulated product once; block scales each tile's product per column where a scale block is at
least a tile deep, else every weight before the dot. Weights come ``[E, K, N]`` or, each
expert's kernel transposed, ``[E, N, K]`` (``weight_layout="enk"``: K contiguous, the layout an
FP8 dot reads). The launch configuration is ``choose_tiles``' (``Tiles``: the weight tile, warps,
stages, and whether each tile's product is computed transposed, ``swap_ab``): this GPU's measured
table (``grouped_gemm_table``), else ``default_tiles``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from jaxattn.kernels import grouped_gemm_table
from jaxattn.kernels.fp8_rows import FP8_MAX, quantize_rows  # noqa: F401  (the FP8 rows' API, with the kernel)
from jaxattn.kernels.grouped_gemm_table import Tiles


def default_tiles(scale_depth: int | None = None, fp8_enk: bool = False) -> Tiles:
    """The launch configuration without a measured table entry (``choose_tiles``), measured fastest
    on an H100 at DeepSeek-V2-Lite's expert shapes (``K x N`` 2048 x 1408 with SwiGLU, 1408 x 2048
    without; 32 to 512 tokens, 8 configurations; benchmarks/TUNING.md, "grouped-gemm-tiles", from
    ``benchmarks.tune_grouped_gemm``): 128 x 64 tiles, 4 warps, 4 stages, for bf16 weights and FP8
    weights ``[E, K, N]`` at every block size; FP8 weights ``[E, N, K]`` (``fp8_enk``) 128 x 128
    tiles, 8 warps, 3 stages (128 bytes of K per weight row; "grouped-gemm-fp8-rows"). With FP8
    block scales ``scale_depth`` weight rows deep, the tile no deeper than a block
    (``_within_scale_block``)."""
    return _within_scale_block(Tiles(128, 128, 8, 3) if fp8_enk else Tiles(128, 64, 4, 4), scale_depth)


def choose_tiles(block_m: int, k: int, n: int, swiglu: bool, weights: str | None,
                 scale_depth: int | None = None) -> Tiles:
    """The launch configuration of a call of ``block_m``-row blocks times weights ``K x N``
    (``swiglu``: gate and up) of a kind the measured table has (``weights``: "bf16", bf16 rows and
    weights, or "fp8", FP8 weights ``[E, N, K]``; None: another kind, e.g. FP8 weights ``[E, K, N]``):
    the tiles of this GPU's table's nearest entry (``grouped_gemm_table``), else ``default_tiles``;
    with FP8 block scales ``scale_depth`` weight rows deep, no deeper than a block."""
    measured = None if weights is None else grouped_gemm_table.measured_tiles(weights, swiglu, block_m, k, n)
    if measured is None:
        return default_tiles(scale_depth, fp8_enk=weights == "fp8")
    return _within_scale_block(measured, scale_depth)


def _within_scale_block(tiles: Tiles, scale_depth: int | None) -> Tiles:
    """``tiles`` made no deeper than a block of FP8 scales ``scale_depth`` weight rows deep, so
    that each tile's rows share their scales (scaled once per tile, not per weight)."""
    if scale_depth is not None and scale_depth % tiles.block_k:
        depth = scale_depth & -scale_depth             # the largest power of two dividing a block's rows
        if depth >= 16:
            tiles = tiles._replace(block_k=min(tiles.block_k, depth))
    return tiles


@triton.jit
def grouped_gemm_kernel(rows_ptr, row_scale_ptr, row_index_ptr, block_expert_ptr, w_ptr, w2_ptr, s_ptr, s2_ptr,
                        out_ptr, T: tl.constexpr, GATHER: tl.constexpr,
                        N: tl.constexpr, K: tl.constexpr, SWIGLU: tl.constexpr, SCALED: tl.constexpr,
                        ROW_SCALED: tl.constexpr, ROW_GROUPS: tl.constexpr, K_SCALES: tl.constexpr,
                        TILE_SCALES: tl.constexpr,
                        SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, BI: tl.constexpr, BO: tl.constexpr,
                        W_NK: tl.constexpr, DOT_F32: tl.constexpr, SWAP_AB: tl.constexpr,
                        BLOCK_TILES_FIRST: tl.constexpr, BLOCKS: tl.constexpr, N_TILES: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[block] = rows[block] @ w[e]`` (``SWIGLU``: ``silu(rows @ w[e]) * (rows @ w2[e])``),
    ``e = block_expert[block]``; ``w, w2: [E, K, N]`` (``W_NK``: ``[E, N, K]``), ``rows: [R, K]``
    (``GATHER``: ``[T, K]``, block row r being ``rows[row_index[r]]``, a zero row where that is not
    in ``0 .. T-1``), ``out: [R, N]``; ``ROW_SCALED``: FP8 rows, each times its ``row_scale``
    (``[rows, ROW_GROUPS]``: one per row, or one per ``BI`` columns of a row with block scales). With
    ``SCALED``, ``w`` and ``w2`` are FP8 with scales ``s, s2: [E, SCALE_ROWS, SCALE_COLS]`` (one per
    block of ``BI`` rows and ``BO`` columns). Scales that vary along K (``K_SCALES``) scale each
    tile's dot per column with ``TILE_SCALES`` (each ``BLOCK_K`` rows of a tile share their
    scales), otherwise every weight; scales constant along K (per expert or output channel) scale
    the accumulated product once, so the dots chain in one accumulator. ``SWAP_AB`` accumulates
    the tile transposed (``_tile_dot``) and transposes it once before the epilogue. One program per
    tile of ``BLOCKS`` blocks x ``N_TILES`` tile columns, a block's tiles consecutive with
    ``BLOCK_TILES_FIRST`` (``Tiles.block_tiles_first``), else a tile column's."""
    program = tl.program_id(0)
    if BLOCK_TILES_FIRST:
        block, n_tile = program // N_TILES, program % N_TILES
    else:
        block, n_tile = program % BLOCKS, program // BLOCKS
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        offs_m = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        if GATHER:
            source = tl.load(row_index_ptr + offs_m)
            m_in = (source >= 0) & (source < T)
            source = tl.where(m_in, source, 0).to(tl.int64)
        else:
            source = offs_m
            m_in = offs_m >= 0
        a_ptrs = rows_ptr + source[:, None] * K + offs_k[None, :]
        if W_NK:
            w_offsets = expert.to(tl.int64) * K * N + offs_n[None, :] * K + offs_k[:, None]
            w_step = BLOCK_K
        else:
            w_offsets = expert.to(tl.int64) * K * N + offs_k[:, None] * N + offs_n[None, :]
            w_step = BLOCK_K * N
        s_base = expert.to(tl.int64) * SCALE_ROWS * SCALE_COLS + offs_n // BO
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            acc2 = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        n_in = offs_n < N
        for k0 in range(0, K, BLOCK_K):
            k_in = (k0 + offs_k) < K
            w_mask = k_in[:, None] & n_in[None, :]
            a = tl.load(a_ptrs, mask=m_in[:, None] & k_in[None, :], other=0.0)
            if ROW_SCALED and K_SCALES:      # the rows' scales of this tile's columns (a block of BI)
                a_scale = tl.load(row_scale_ptr + source * ROW_GROUPS + k0 // BI, mask=m_in, other=0.0)
                a_scale = a_scale[None, :] if SWAP_AB else a_scale[:, None]
            else:
                a_scale = 1.0
            acc = _tile_dot(a, a_scale, w_ptr + w_offsets, w_mask, s_ptr, s_base, k0, offs_k, n_in, acc, K_SCALES,
                            TILE_SCALES, SCALE_COLS, BI, DOT_F32, SWAP_AB)
            if SWIGLU:
                acc2 = _tile_dot(a, a_scale, w2_ptr + w_offsets, w_mask, s2_ptr, s_base, k0, offs_k, n_in, acc2,
                                 K_SCALES, TILE_SCALES, SCALE_COLS, BI, DOT_F32, SWAP_AB)
            a_ptrs += BLOCK_K
            w_offsets += w_step
        if SWAP_AB:
            acc = tl.trans(acc)
            acc2 = tl.trans(acc2)
        if SCALED:
            if not K_SCALES:
                acc = acc * tl.load(s_ptr + s_base, mask=n_in, other=0.0)[None, :]
                if SWIGLU:
                    acc2 = acc2 * tl.load(s2_ptr + s_base, mask=n_in, other=0.0)[None, :]
        if ROW_SCALED and not K_SCALES:
            row_scale = tl.load(row_scale_ptr + source, mask=m_in, other=0.0)[:, None]
            acc = acc * row_scale
            if SWIGLU:
                acc2 = acc2 * row_scale
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc2
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=n_in[None, :])


@triton.jit
def _tile_dot(a, a_scale, w_ptrs, w_mask, s_ptr, s_base, k0, offs_k, n_in, acc, K_SCALES: tl.constexpr,
              TILE_SCALES: tl.constexpr, SCALE_COLS: tl.constexpr, BI: tl.constexpr, DOT_F32: tl.constexpr,
              SWAP_AB: tl.constexpr):
    """``acc + a @ w`` over the ``BLOCK_K x BLOCK_N`` weight tile at rows ``k0 + offs_k`` (columns
    ``n_in`` inside N), FP8 weights times their scales where these vary along K (``K_SCALES``;
    with ``TILE_SCALES`` the tile's product, also times the rows' scales ``a_scale [BLOCK_M, 1]``).
    ``SWAP_AB``: ``acc + w^T @ a^T``, ``acc [BLOCK_N, BLOCK_M]`` and ``a_scale [1, BLOCK_M]``."""
    b = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if K_SCALES and not TILE_SCALES:
        b = b.to(tl.float32) * tl.load(s_ptr + s_base[None, :] + ((k0 + offs_k) // BI)[:, None] * SCALE_COLS,
                                       mask=w_mask, other=0.0)
    b = b.to(a.dtype)
    if DOT_F32:       # Triton's interpreter (CPU tests) multiplies float32 only
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    # if / else throughout: the compiler also generates code after a constexpr branch's return
    if K_SCALES and TILE_SCALES:
        w_scale = tl.load(s_ptr + s_base + (k0 // BI) * SCALE_COLS, mask=n_in, other=0.0)
        if SWAP_AB:
            acc = acc + tl.dot(tl.trans(b), tl.trans(a)) * (w_scale[:, None] * a_scale)
        else:
            acc = acc + tl.dot(a, b) * (a_scale * w_scale[None, :])
    elif SWAP_AB:
        acc = tl.dot(tl.trans(b), tl.trans(a), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


def grouped_gemm(rows: jax.Array, block_expert: jax.Array, weights: jax.Array, up: jax.Array | None = None, *,
                 block_m: int, scale: jax.Array | None = None, up_scale: jax.Array | None = None,
                 scale_block: tuple[int, int] = (1, 1), row_scale: jax.Array | None = None,
                 row_index: jax.Array | None = None, weight_layout: str = "ekn", out_dtype=None,
                 tiles: Tiles | None = None) -> jax.Array:
    """``[R, N]``: each ``block_m``-row block of ``rows [R, K]`` times its expert's ``weights
    [E, K, N]`` (with ``up``: ``silu(rows @ weights) * (rows @ up)``, SwiGLU's gate and up), the
    experts given by ``block_expert int32[R / block_m]`` (-1: a block no group uses, its output
    rows unwritten). ``R`` must be a multiple of ``block_m`` (>= 16, a power of two). FP8 weights
    come with float32 ``scale`` (and ``up_scale``) ``[E, ceil(K / bi), ceil(N / bo)]``,
    ``scale_block = (bi, bo)``: dequantized in the kernel, so the weights are read as FP8. FP8
    ``rows`` times FP8 weights come with ``row_scale float32[R, ceil(K / group)]``
    (``quantize_rows``; ``group``: ``fp8_row_group``) and give ``out_dtype`` (default: the rows'
    dtype).
    ``weight_layout``: "ekn" (weights ``[E, K, N]``) or "enk" (``[E, N, K]``). With ``row_index
    int32[R]``, ``rows [T, K]`` are gathered: block row r is ``rows[row_index[r]]`` (a zero row
    where the index is outside ``0 .. T-1``), ``row_scale`` is per row of ``rows``, and the output
    has the ``R`` block rows (the grouped copies never exist in memory).
    ``tiles``: the launch configuration (default: ``choose_tiles``)."""
    from jaxattn.kernels.triton_call import triton_call

    num_sources, k = rows.shape
    num_rows = num_sources if row_index is None else row_index.shape[0]
    if row_index is not None and (row_index.ndim != 1 or not jnp.issubdtype(row_index.dtype, jnp.integer)):
        raise ValueError(f"grouped_gemm: row_index must be int32[R], got {row_index.dtype}{list(row_index.shape)}")
    if num_rows % block_m or block_expert.shape != (num_rows // block_m,):
        raise ValueError(f"grouped_gemm: rows {rows.shape} must be {block_expert.shape[0]} blocks of {block_m} rows")
    if weight_layout not in ("ekn", "enk"):
        raise ValueError(f"grouped_gemm: weight_layout must be 'ekn' or 'enk', got {weight_layout!r}")
    w_nk = weight_layout == "enk"
    if weights.ndim != 3 or weights.shape[1 + w_nk] != k or (up is not None and up.shape != weights.shape):
        layout = "[E, N, K]" if w_nk else "[E, K, N]"
        raise ValueError(f"grouped_gemm: weights {weights.shape} (and up) must be {layout} with K = {k}")
    experts, n = weights.shape[0], weights.shape[2 - w_nk]
    bi, bo = scale_block
    if scale is not None:
        expected = (experts, -(-k // bi), -(-n // bo))
        if scale.shape != expected or (up is not None and (up_scale is None or up_scale.shape != expected)):
            raise ValueError(f"grouped_gemm: scale (and up_scale) must be {expected} for blocks {scale_block}, got "
                             f"{scale.shape}")
    elif weights.dtype != rows.dtype:
        raise ValueError(f"grouped_gemm: weights of {weights.dtype} need a scale (rows are {rows.dtype})")
    # unscaled: the weights stand in for the scale pointers, which the kernel then never reads
    scales = (weights, weights) if scale is None else (scale, scale if up_scale is None else up_scale)
    scale_rows, scale_cols = (1, 1) if scale is None else scale.shape[1:]
    if tiles is None:
        if scale is not None:                       # the table holds FP8 weights [E, N, K] and bf16 ones
            kind = "fp8" if w_nk else None
        else:
            kind = "bf16" if rows.dtype == jnp.bfloat16 else None
        tiles = choose_tiles(block_m, k, n, up is not None, kind, bi if scale_rows > 1 else None)
    elif not tiles.launchable():
        raise ValueError(f"grouped_gemm: tiles need block_n and block_k powers of two >= 16, positive warps and "
                         f"stages, and swap_ab and block_tiles_first bools, got {tiles}")
    tile_scales = bi % tiles.block_k == 0           # read only for scales that vary along K
    if row_scale is not None:
        group = fp8_row_group(k, scale_block, tiles) if scale is not None and rows.dtype == weights.dtype else None
        if group is None or row_scale.shape != (num_sources, -(-k // group)):
            raise ValueError(f"grouped_gemm: row_scale must be [{num_sources}, K / group] for FP8 rows times FP8 "
                             f"weights whose scales are constant along K (group K) or blocks whole tiles deep (group "
                             f"bi); got {row_scale.shape} for {rows.dtype} rows, {weights.dtype} weights, scale "
                             f"blocks {scale_block if scale is not None else None}, tiles {tuple(tiles)}")
    blocks, n_tiles = num_rows // block_m, triton.cdiv(n, tiles.block_n)
    # operands a configuration does not read stand in for their pointers (unscaled rows, no gather)
    (out,) = triton_call(
        rows, rows if row_scale is None else row_scale,
        block_expert if row_index is None else row_index.astype(jnp.int32), block_expert.astype(jnp.int32),
        weights, weights if up is None else up, *scales,
        kernel=grouped_gemm_kernel, out_shape=[jax.ShapeDtypeStruct((num_rows, n), out_dtype or rows.dtype)],
        grid=(blocks * n_tiles,), num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, T=num_sources, GATHER=row_index is not None, N=n, K=k,
        SWIGLU=up is not None, SCALED=scale is not None,
        ROW_SCALED=row_scale is not None, ROW_GROUPS=1 if row_scale is None else row_scale.shape[1],
        K_SCALES=scale_rows > 1, TILE_SCALES=tile_scales, SCALE_ROWS=scale_rows,
        SCALE_COLS=scale_cols, BI=bi, BO=bo, W_NK=w_nk, DOT_F32=jax.default_backend() == "cpu",
        SWAP_AB=tiles.swap_ab, BLOCK_TILES_FIRST=tiles.block_tiles_first, BLOCKS=blocks, N_TILES=n_tiles,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k)
    return out


def fp8_row_group(k: int, scale_block: tuple[int, int], tiles: Tiles | None = None) -> int | None:
    """The columns each scale of FP8 rows covers when they meet FP8 weights of contraction ``k``
    scaled in blocks ``scale_block = (bi, bo)``: ``k`` where the weights' scales are constant along
    it (one scale per row), ``bi`` where a block is a whole number of ``tiles`` deep (default:
    ``default_tiles`` of FP8 weights ``[E, N, K]``; each tile's product is scaled by its rows' and
    columns' scales: DeepSeek-V3's 128 x 128 blocks with vLLM's 1 x 128 groups of activations),
    else None (FP8 rows not taken)."""
    bi = scale_block[0]
    depth = (tiles or default_tiles(bi if bi < k else None, fp8_enk=True)).block_k
    if depth < 32:                  # FP8 MMA instructions are 32 deep
        return None
    return k if bi >= k else bi if bi % depth == 0 else None
