"""grouped_gemm: each block of rows times its own expert's weights (and SwiGLU's gate and up in
one pass), the blocks no group uses left unwritten, against numpy; under Triton's interpreter on
the CPU and compiled on a GPU."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.kernels.grouped_gemm import Tiles, default_tiles, fp8_row_group, grouped_gemm, quantize_rows
from tests.paged_inputs import rel_error
from tests.xla_dump import REPO


def _laid_out(stack, layout: str) -> jax.Array:
    """``stack [E, K, N]`` as ``grouped_gemm`` takes it for ``weight_layout``."""
    return jnp.asarray(stack if layout == "ekn" else np.swapaxes(stack, 1, 2))


@pytest.mark.parametrize("launch", [{}, {"swap_ab": True}, {"block_tiles_first": True}])
@pytest.mark.parametrize("layout", ["ekn", "enk"])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("block_m, k, n", [(16, 64, 64), (32, 100, 72), (16, 256, 200)])
def test_blocks_take_their_experts(on_platform, swiglu, block_m, k, n, layout, launch):
    """Each tile's product straight or transposed (``Tiles.swap_ab``) alike, and the programs in
    either order (``Tiles.block_tiles_first``; N = 200 is two tile columns)."""
    rng = np.random.default_rng()
    dtype = jnp.float32 if on_platform == "cpu" else jnp.bfloat16
    block_expert = np.array([2, 0, 0, 3, -1, -1], np.int32)
    rows = rng.normal(size=(block_expert.size * block_m, k)).astype(np.float32)
    gate, up = (rng.normal(size=(4, k, n)).astype(np.float32) / np.sqrt(k) for _ in range(2))
    run = jax.jit(functools.partial(grouped_gemm, block_m=block_m, weight_layout=layout,
                                    tiles=default_tiles()._replace(**launch)))
    out = run(jnp.asarray(rows, dtype), jnp.asarray(block_expert), _laid_out(jnp.asarray(gate, dtype), layout),
              _laid_out(jnp.asarray(up, dtype), layout) if swiglu else None)
    assert out.shape == (rows.shape[0], n) and out.dtype == dtype
    used = 4 * block_m
    expert = np.repeat(block_expert[:4], block_m)
    want = np.einsum("rk,rkn->rn", rows[:used], gate[expert])
    if swiglu:
        want = want / (1 + np.exp(-want)) * np.einsum("rk,rkn->rn", rows[:used], up[expert])
    assert rel_error(out[:used], want) < (1e-5 if dtype == jnp.float32 else 2e-2)
    if on_platform == "cpu":            # the interpreter starts outputs as NaN: unused blocks stay so
        assert np.isnan(np.asarray(out[used:])).all()



@pytest.mark.parametrize("scale_block, tiles", [
    ((100, 1), Tiles()),                        # per output channel: one scale row, scaled after the dots
    ((32, 16), Tiles(block_n=32, block_k=32)),  # blocks a whole number of tiles deep: scaled per tile
    ((32, 16), Tiles(block_n=32, block_k=32, swap_ab=True)),
    ((8, 8), Tiles()),                          # blocks finer than a tile: every weight scaled
    ((8, 8), Tiles(swap_ab=True)),
])
def test_fp8_weights_are_scaled_in_the_kernel(on_platform, scale_block, tiles):
    rng = np.random.default_rng()
    dtype = jnp.float32 if on_platform == "cpu" else jnp.bfloat16
    block_m, k, n = 16, 100, 72
    block_expert = np.array([1, 0, 1, -1], np.int32)
    rows = rng.normal(size=(block_expert.size * block_m, k)).astype(np.float32)
    gate, up = (jnp.asarray(rng.normal(size=(2, k, n)) * 8, jnp.float8_e4m3fn) for _ in range(2))
    scale_shape = (2, -(-k // scale_block[0]), -(-n // scale_block[1]))
    scale, up_scale = (rng.uniform(0.5, 2.0, size=scale_shape).astype(np.float32) / 8 for _ in range(2))
    run = jax.jit(functools.partial(grouped_gemm, block_m=block_m, scale_block=scale_block, tiles=tiles))
    out = run(jnp.asarray(rows, dtype), jnp.asarray(block_expert), gate, up, scale=jnp.asarray(scale),
              up_scale=jnp.asarray(up_scale))

    def dequantized(w, s):
        s = np.repeat(np.repeat(s, scale_block[0], axis=1)[:, :k], scale_block[1], axis=2)[:, :, :n]
        return np.asarray(w, np.float32) * s

    used = 3 * block_m
    expert = np.repeat(block_expert[:3], block_m)
    g, u = (np.einsum("rk,rkn->rn", rows[:used], dequantized(w, s)[expert]) for w, s in ((gate, scale), (up, up_scale)))
    assert rel_error(out[:used], g / (1 + np.exp(-g)) * u) < (1e-5 if dtype == jnp.float32 else 2e-2)

def test_fp8_row_groups_follow_the_weight_scales():
    assert fp8_row_group(2048, (2048, 1)) == 2048                     # per channel: one scale per row
    assert fp8_row_group(2048, (128, 128)) == 128                     # DeepSeek-V3's blocks: 64-deep tiles
    assert fp8_row_group(2048, (128, 128), Tiles(block_k=256)) is None
    assert fp8_row_group(2048, (8, 8)) is None                        # shallower than any tile
    assert fp8_row_group(2048, (16, 16)) is None                      # 16-deep tiles: FP8 MMAs are 32 deep


@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("scale_block", [(32, 8), (64, 72)])
def test_fp8_rows_in_groups_meet_block_scales(on_platform, scale_block, swap_ab):
    """FP8 rows with one scale per ``bi`` columns (``quantize_rows(rows, bi)``) against block-scaled
    FP8 weights: each tile's product times its rows' and columns' scales (the tile straight or
    transposed)."""
    rng = np.random.default_rng()
    block_m, k, n = 16, 96, 72
    bi, bo = scale_block
    block_expert = np.array([1, 0, -1], np.int32)
    rows = rng.normal(size=(block_expert.size * block_m, k)).astype(np.float32)
    weights = np.asarray(jnp.asarray(rng.normal(size=(2, k, n)) * 8, jnp.float8_e4m3fn), np.float32)
    scale = rng.uniform(0.5, 2.0, size=(2, -(-k // bi), -(-n // bo))).astype(np.float32) / 8
    fp8_rows, row_scale = quantize_rows(jnp.asarray(rows), fp8_row_group(k, scale_block))
    assert row_scale.shape == (rows.shape[0], -(-k // bi))
    tiles = default_tiles(bi, fp8_enk=True)._replace(swap_ab=swap_ab)
    out = jax.jit(functools.partial(grouped_gemm, block_m=block_m, scale_block=scale_block, weight_layout="enk",
                                    out_dtype=jnp.float32, tiles=tiles))(
        fp8_rows, jnp.asarray(block_expert), _laid_out(jnp.asarray(weights, jnp.float8_e4m3fn), "enk"),
        scale=jnp.asarray(scale), row_scale=row_scale)
    used = 2 * block_m
    dequantized_rows = np.asarray(fp8_rows, np.float32) * np.repeat(np.asarray(row_scale), bi, axis=1)[:, :k]
    dequantized = weights * np.repeat(np.repeat(scale, bi, axis=1), bo, axis=2)[:, :k, :n]
    want = np.einsum("rk,rkn->rn", dequantized_rows[:used], dequantized[np.repeat(block_expert[:2], block_m)])
    assert rel_error(out[:used], want) < (1e-5 if on_platform == "cpu" else 1e-3)


@pytest.mark.parametrize("layout, swap_ab", [("ekn", False), ("enk", False), ("enk", True)])
def test_fp8_rows_are_scaled_per_row(on_platform, layout, swap_ab):
    """FP8 activations (``quantize_rows``) times FP8 weights with per-channel scales: each output
    row times its row's scale, close to the bf16 rows' product (FP8 rounding of the rows)."""
    rng = np.random.default_rng()
    block_m, k, n = 16, 96, 72
    block_expert = np.array([1, 0, 1, -1], np.int32)
    rows = rng.normal(size=(block_expert.size * block_m, k)).astype(np.float32) * rng.uniform(
        0.05, 2.0, size=(block_expert.size * block_m, 1)).astype(np.float32)
    gate, up = (np.asarray(jnp.asarray(rng.normal(size=(2, k, n)) * 8, jnp.float8_e4m3fn)) for _ in range(2))
    scale, up_scale = (rng.uniform(0.5, 2.0, size=(2, 1, n)).astype(np.float32) / 8 for _ in range(2))
    fp8_rows, row_scale = quantize_rows(jnp.asarray(rows, jnp.bfloat16))
    run = jax.jit(functools.partial(grouped_gemm, block_m=block_m, scale_block=(k, 1), weight_layout=layout,
                                    out_dtype=jnp.bfloat16,
                                    tiles=default_tiles(fp8_enk=layout == "enk")._replace(swap_ab=swap_ab)))
    out = run(fp8_rows, jnp.asarray(block_expert), _laid_out(gate, layout), _laid_out(up, layout),
              scale=jnp.asarray(scale), up_scale=jnp.asarray(up_scale), row_scale=row_scale)
    assert out.dtype == jnp.bfloat16
    used = 3 * block_m
    expert = np.repeat(block_expert[:3], block_m)
    g, u = (np.einsum("rk,rkn->rn", rows[:used], (w.astype(np.float32) * s)[expert])
            for w, s in ((gate, scale), (up, up_scale)))
    assert rel_error(out[:used], g / (1 + np.exp(-g)) * u) < 0.1      # e4m3 rows: 3 mantissa bits


@pytest.mark.parametrize("swap_ab", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_gathered_rows_are_their_tokens(on_platform, fp8, swap_ab):
    """With ``row_index`` each block row is its token's row of ``rows [T, K]`` (a token may fill
    several rows, ``row_scale`` is per token); indices outside ``0 .. T-1`` (padding, or bad data)
    give zero rows and read nothing outside ``rows``; each tile straight or transposed (the
    swapped tiles the sm_90 table gives the model's gathered decode blocks)."""
    rng = np.random.default_rng()
    block_m, tokens, k, n = 16, 20, 64, 48
    block_expert = np.array([1, 0, -1], np.int32)
    row_index = rng.integers(0, tokens, size=block_expert.size * block_m).astype(np.int32)
    row_index[[3, 17, 20]] = [-1, tokens, 1 << 30]
    x = rng.normal(size=(tokens, k)).astype(np.float32)
    weights = rng.normal(size=(2, k, n)).astype(np.float32) / np.sqrt(k)
    kwargs = dict(block_m=block_m, row_index=jnp.asarray(row_index), tiles=default_tiles()._replace(swap_ab=swap_ab))
    if fp8:
        rows, row_scale = quantize_rows(jnp.asarray(x))
        x = np.asarray(rows, np.float32) * np.asarray(row_scale)
        stack = jnp.asarray(weights * 8, jnp.float8_e4m3fn)
        weights = np.asarray(stack, np.float32) / 8
        kwargs.update(row_scale=row_scale, scale=jnp.full((2, 1, n), 1 / 8, jnp.float32), scale_block=(k, 1),
                      out_dtype=jnp.float32)
    else:
        rows, stack = jnp.asarray(x), jnp.asarray(weights)
    out = jax.jit(functools.partial(grouped_gemm, **kwargs))(rows, jnp.asarray(block_expert), stack)
    assert out.shape == (row_index.size, n)
    used = 2 * block_m
    gathered = np.where(((row_index >= 0) & (row_index < tokens))[:, None], x[np.clip(row_index, 0, tokens - 1)], 0)
    want = np.einsum("rk,rkn->rn", gathered[:used], weights[np.repeat(block_expert[:2], block_m)])
    assert rel_error(out[:used], want) < (1e-5 if on_platform == "cpu" else 1e-2)     # GPU float32 dots: TF32
    assert not np.asarray(out[:used])[[3, 17, 20]].any()


def test_misshapen_blocks_are_named():
    with pytest.raises(ValueError, match="blocks of 16 rows"):
        grouped_gemm(jnp.zeros((40, 8)), jnp.zeros((3,), jnp.int32), jnp.zeros((2, 8, 4)), block_m=16)
    with pytest.raises(ValueError, match=r"must be \[E, K, N\] with K = 8"):
        grouped_gemm(jnp.zeros((32, 8)), jnp.zeros((2,), jnp.int32), jnp.zeros((2, 6, 4)), block_m=16)
    rows, blocks, fp8 = jnp.zeros((32, 8)), jnp.zeros((2,), jnp.int32), jnp.zeros((2, 8, 4), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="weights of float8_e4m3fn need a scale"):
        grouped_gemm(rows, blocks, fp8, block_m=16)
    with pytest.raises(ValueError, match=r"scale \(and up_scale\) must be \(2, 2, 1\) for blocks \(4, 4\)"):
        grouped_gemm(rows, blocks, fp8, block_m=16, scale=jnp.ones((2, 1, 1)), scale_block=(4, 4))
    with pytest.raises(ValueError, match=r"scale \(and up_scale\) must be"):
        grouped_gemm(rows, blocks, fp8, fp8, block_m=16, scale=jnp.ones((2, 2, 1)), scale_block=(4, 4))
    with pytest.raises(ValueError, match="weight_layout must be 'ekn' or 'enk'"):
        grouped_gemm(rows, blocks, jnp.zeros((2, 8, 4)), block_m=16, weight_layout="kn")
    with pytest.raises(ValueError, match=r"must be \[E, N, K\] with K = 8"):
        grouped_gemm(rows, blocks, jnp.zeros((2, 8, 4)), block_m=16, weight_layout="enk")
    with pytest.raises(ValueError, match="row_scale must be \\[32, K / group\\] for FP8 rows times FP8 weights"):
        grouped_gemm(rows.astype(jnp.float8_e4m3fn), blocks, fp8, block_m=16, scale=jnp.ones((2, 1, 4)),
                     scale_block=(8, 1), row_scale=jnp.ones((32,)))
    with pytest.raises(ValueError, match="row_scale must be"):          # blocks shallower than a tile
        grouped_gemm(rows.astype(jnp.float8_e4m3fn), blocks, fp8, block_m=16, scale=jnp.ones((2, 2, 1)),
                     scale_block=(4, 4), row_scale=jnp.ones((32, 2)))
    with pytest.raises(ValueError, match=r"row_index must be int32\[R\], got float32\[32\]"):
        grouped_gemm(rows, blocks, jnp.zeros((2, 8, 4)), block_m=16, row_index=jnp.zeros((32,)))
    with pytest.raises(ValueError, match="blocks of 16 rows"):
        grouped_gemm(rows, blocks, jnp.zeros((2, 8, 4)), block_m=16, row_index=jnp.zeros((40,), jnp.int32))
    with pytest.raises(ValueError, match="quantize_rows: group must be a positive number of columns, got 0"):
        quantize_rows(rows, 0)
    for tiles in (Tiles(block_n=24), Tiles(block_k=8), Tiles(num_warps=0), Tiles(swap_ab="yes"),
                  Tiles(block_tiles_first=1)):
        with pytest.raises(ValueError, match="grouped_gemm: tiles need block_n and block_k powers of two >= 16"):
            grouped_gemm(rows, blocks, jnp.zeros((2, 8, 4)), block_m=16, tiles=tiles)


def test_default_tiles_keep_a_tile_inside_a_scale_block():
    """Block scales cap the tile's depth at the largest power of two dividing a block's rows, so
    each tile's rows share one row of scales; blocks shallower than 16 rows leave it alone."""
    assert default_tiles() == Tiles(128, 64, 4, 4)
    assert default_tiles(scale_depth=128).block_k == 64
    assert default_tiles(scale_depth=96).block_k == 32
    assert default_tiles(scale_depth=8).block_k == 64
    assert default_tiles(fp8_enk=True) == Tiles(128, 128, 8, 3)
    assert default_tiles(scale_depth=128, fp8_enk=True).block_k == 128


_SM90_SCRIPT = textwrap.dedent("""
    import json, re, sys
    import jax, jax.numpy as jnp
    jax.default_backend = lambda: "gpu"             # the launch a GPU would get (no float32 dots)
    from jaxattn.kernels import grouped_gemm as gg
    from tests.triton_compile import compiled_kernels

    block_m, fp8, swap = int(sys.argv[1]), sys.argv[2] == "fp8", sys.argv[3] == "swap"
    experts, k, n, rows = 64, 2048, 1408, 8 * block_m          # DeepSeek-V2-Lite's gate and up
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    tiles = gg.default_tiles(fp8_enk=fp8)._replace(swap_ab=swap)
    shape = jax.ShapeDtypeStruct
    scales = (shape((experts, 1, n), jnp.float32),) * 2 + (shape((rows, 1), jnp.float32),) if fp8 else ()
    static = dict(scale_block=(k, 1), weight_layout="enk", out_dtype=jnp.bfloat16) if fp8 else {}

    def call(r, b, gate, up, *s):
        return gg.grouped_gemm(r, b, gate, up, block_m=block_m, tiles=tiles, **static,
                               **dict(zip(("scale", "up_scale", "row_scale"), s)))

    weights = shape((experts, n, k) if fp8 else (experts, k, n), dtype)
    (compiled,) = compiled_kernels(call, shape((rows, k), dtype), shape((rows // block_m,), jnp.int32), weights,
                                   weights, *scales).values()
    print(json.dumps(sorted(set(re.findall(r"wgmma\\.mma_async[.\\w]*|mma\\.sync[.\\w]*", compiled.asm["ptx"])))))
""")


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("fp8", [False, True])
def test_sm90_swapped_tiles_take_warpgroup_mmas(block_m, fp8):
    """No GPU needed: compiled for sm_90 by the installed Triton, a 16- or 32-row block's dot is an
    mma.sync (for FP8 weights and rows, over f16: the FP8 operands are converted in registers),
    and with ``swap_ab`` a warpgroup MMA, FP8 x FP8 for FP8 weights (``N`` = the block's rows).
    In a fresh process: the interpreter the other tests run leaves Triton's language module patched."""
    mmas = {}
    for swap in ("straight", "swap"):
        run = subprocess.run([sys.executable, "-c", _SM90_SCRIPT, str(block_m), "fp8" if fp8 else "bf16", swap],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        mmas[swap] = json.loads(run.stdout.strip().splitlines()[-1])
    kind = "f16.f16" if fp8 else "bf16.bf16"
    assert mmas["straight"] == [f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.f32"], mmas
    kind = "m64n{}k32.f32.e4m3.e4m3" if fp8 else "m64n{}k16.f32.bf16.bf16"
    assert mmas["swap"] == ["wgmma.mma_async.sync.aligned." + kind.format(block_m)], mmas
