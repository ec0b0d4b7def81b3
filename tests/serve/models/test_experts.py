"""experts.routed_experts: every GEMM strategy against a float64 reference (a device's share of
the experts included: expert parallelism's ``first``), in bfloat16 against each other, through
layers.MoE and set_expert_gemm, and the names of bad strategies."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.kernels.grouped_gemm import quantize_rows
from jaxattn.serve.models import experts, layers
from tests.paged_inputs import rel_error


def routing(rng: np.random.Generator, tokens: int, num_experts: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(weights float32[T, k], chosen int32[T, k])``: k distinct experts per token."""
    chosen = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :k].astype(np.int32)
    return rng.dirichlet(np.ones(k), size=tokens).astype(np.float32), chosen


def expert_weights(rng: np.random.Generator, num_experts: int, dim: int, hidden: int) -> list[np.ndarray]:
    return [(rng.normal(size=shape) / np.sqrt(shape[1])).astype(np.float32)
            for shape in ((num_experts, dim, hidden), (num_experts, dim, hidden), (num_experts, hidden, dim))]


def fp8_rounded(row: np.ndarray, group: int) -> np.ndarray:
    """``row`` through ``grouped_gemm.quantize_rows`` and back: FP8 values times their group's scale."""
    values, scale = quantize_rows(jnp.asarray(row[None], jnp.float32), group)
    return np.asarray(values, np.float64)[0] * np.repeat(np.asarray(scale[0]), group)[:row.size]


def reference(x, weights, chosen, gate, up, down, first=0, fp8_groups=None) -> np.ndarray:
    """float64, one token copy at a time; copies for experts outside ``first .. first + E`` add
    nothing; ``fp8_groups``: the rows of the first and the second GEMM rounded to FP8 in groups of
    that many columns first (``fp8_rounded``)."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    first_group, second_group = fp8_groups or (None, None)

    def rounded(row, group):
        return row if group is None else fp8_rounded(row, group)

    out = np.zeros_like(x)
    for t, j in np.ndindex(chosen.shape):
        e = chosen[t, j] - first
        if 0 <= e < gate.shape[0]:
            row = rounded(x[t], first_group)
            g = row @ gate[e]
            out[t] += weights[t, j] * (rounded(g / (1 + np.exp(-g)) * (row @ up[e]), second_group) @ down[e])
    return out


# (tokens, experts in the model, k, first local expert, local experts, dim, hidden)
CASES = [(1, 8, 2, 0, 8, 64, 48), (5, 8, 2, 0, 8, 64, 48), (37, 8, 3, 4, 4, 100, 72), (64, 4, 2, 0, 4, 32, 16),
         (130, 16, 4, 0, 16, 64, 80), (9, 16, 4, 12, 4, 64, 48)]


@pytest.mark.parametrize("gemm", experts.GEMMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-k{}-first{}-{}x{}".format(*c[:4], *c[5:]))
def test_each_gemm_gives_the_routed_sum(gemm, case):
    tokens, num_experts, k, first, local, dim, hidden = case
    rng = np.random.default_rng()
    weights, chosen = routing(rng, tokens, num_experts, k)
    x = rng.normal(size=(tokens, dim)).astype(np.float32)
    stacks = [w[first:first + local] for w in expert_weights(rng, num_experts, dim, hidden)]
    run = jax.jit(functools.partial(experts.routed_experts, first=first, gemm=gemm))
    out = run(jnp.asarray(x), jnp.asarray(weights), jnp.asarray(chosen), *map(jnp.asarray, stacks))
    assert out.shape == (tokens, dim) and out.dtype == jnp.float32
    assert rel_error(out, reference(x, weights, chosen, *stacks, first=first)) < 1e-5


@pytest.mark.parametrize("layout", ["ekn", "enk"])
@pytest.mark.parametrize("gemm", experts.GEMMS)
@pytest.mark.parametrize("block", [None, "tensor", (16, 32), (8, 8), (32, 16)])
def test_fp8_stacks_compute_their_dequantized_experts(gemm, block, layout):
    """An ``Fp8Stack`` (per channel, per expert, or blocks of rows x columns; kernels stored as
    they are or transposed) gives what its dequantized float32 stack gives: the Triton kernel
    scales in the kernel, the others before."""
    rng = np.random.default_rng()
    weights, chosen = routing(rng, 21, 8, 2)
    x = rng.normal(size=(21, 64)).astype(np.float32)
    stacks = []
    for w in expert_weights(rng, 8, 64, 48):
        values = jnp.asarray(w * 16, jnp.float8_e4m3fn)
        if block is None:
            scale = rng.uniform(0.5, 2.0, size=(8, w.shape[2])) / 16
        elif block == "tensor":
            scale = rng.uniform(0.5, 2.0, size=(8,)) / 16
        else:
            scale = rng.uniform(0.5, 2.0, size=(8, -(-w.shape[1] // block[0]), -(-w.shape[2] // block[1]))) / 16
        stacks.append(experts.Fp8Stack(values if layout == "ekn" else jnp.swapaxes(values, 1, 2),
                                       jnp.asarray(scale, jnp.float32), None if block in (None, "tensor") else block,
                                       layout))
        assert stacks[-1].shape == w.shape
    args = (jnp.asarray(x), jnp.asarray(weights), jnp.asarray(chosen))
    out = jax.jit(functools.partial(experts.routed_experts, gemm=gemm))(*args, *stacks)
    dequantized = [s.dequantize(jnp.float32) for s in stacks]
    # the Triton path multiplies "enk" stacks scaled per expert or channel, or in blocks whole tiles
    # deep, at least 32 (FP8 MMAs are 32 deep; default_tiles makes its tiles 16 deep for 16-row blocks), with FP8 rows
    groups = (experts.fp8_row_group(stacks[0]), experts.fp8_row_group(stacks[2]))
    expected = {None: (64, 48), "tensor": (64, 48), (16, 32): (None, None), (32, 16): (32, 32), (8, 8): (None, None)}
    assert groups == (expected[block] if layout == "enk" else (None, None))
    fp8_groups = groups if gemm == "triton" and groups[0] else None
    error = rel_error(out, reference(x, weights, chosen, *dequantized, fp8_groups=fp8_groups))
    # FP8 rows: mostly ~2e-7, but a hidden value that float32 and float64 round to neighbouring e4m3
    # values (about 1 in 40 draws here) costs up to ~5e-3; rows not rounded in the reference give 3e-2 to 6e-2
    assert error < (1e-2 if fp8_groups else 1e-5)


@pytest.mark.parametrize("gemm", ["dense", "triton"])
def test_bfloat16_gemms_agree_with_ragged_dot(gemm):
    rng = np.random.default_rng()
    weights, chosen = routing(rng, 48, 16, 4)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (rng.normal(size=(48, 128)), weights)] + [jnp.asarray(chosen)]
    stacks = [jnp.asarray(w, jnp.bfloat16) for w in expert_weights(rng, 16, 128, 96)]
    out = jax.jit(functools.partial(experts.routed_experts, gemm=gemm))(*args, *stacks)
    ragged = jax.jit(functools.partial(experts.routed_experts, gemm="ragged_dot"))(*args, *stacks)
    assert out.dtype == jnp.bfloat16
    assert rel_error(out, np.asarray(ragged.astype(jnp.float32))) < 2e-2


@pytest.mark.parametrize("tokens, num_experts, k, rows", [(1, 64, 6, 16), (64, 64, 6, 16), (256, 64, 6, 32),
                                                           (2048, 8, 2, 64)])
def test_block_rows_follow_the_copies_per_expert(tokens, num_experts, k, rows):
    assert experts.block_rows(tokens, num_experts, k) == rows


def moe(dtype: str = "float32") -> layers.MoE:
    from tests.serve.models.test_moe import _Config

    return layers.MoE(_Config(dtype=dtype), nnx.Rngs(0))


def test_set_expert_gemm_reaches_every_moe():
    from tests.serve.models.test_moe import moe_llama

    model = moe_llama()
    layers.set_expert_gemm(model, "triton")
    assert {block.mlp.gemm for block in model.layers} == {"triton"}
    x = jnp.asarray(np.random.default_rng().normal(size=(7, 32)), jnp.float32)
    module = moe()
    outs = {}
    for gemm in experts.GEMMS:
        layers.set_expert_gemm(module, gemm)
        outs[gemm] = np.asarray(nnx.jit(lambda m, x: m(x))(module, x))
    assert rel_error(outs["dense"], outs["ragged_dot"]) < 1e-5
    assert rel_error(outs["triton"], outs["ragged_dot"]) < 1e-5


def test_bad_gemms_are_named():
    with pytest.raises(ValueError, match="gemm must be 'auto' or one of"):
        layers.set_expert_gemm(moe(), "cublas")
    with pytest.raises(ValueError, match="no mixture of experts"):
        layers.set_expert_gemm(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "dense")
    x, weights, chosen = jnp.zeros((2, 4)), jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32)
    stack = experts.Fp8Stack(jnp.zeros((2, 4, 3), jnp.float8_e4m3fn), jnp.ones((2, 3)))
    blocked = experts.Fp8Stack(jnp.zeros((2, 4, 3), jnp.float8_e4m3fn), jnp.ones((2, 2, 2)), (2, 2))
    with pytest.raises(ValueError, match="Fp8Stack: layout must be one of \\('ekn', 'enk'\\), got 'kn'"):
        experts.Fp8Stack(jnp.zeros((2, 4, 3), jnp.float8_e4m3fn), jnp.ones((2, 3)), layout="kn")
    with pytest.raises(ValueError, match="gate_proj and up_proj must be scaled and laid out alike"):
        jax.jit(functools.partial(experts.routed_experts, gemm="triton"))(x, weights, chosen, stack, blocked,
                                                                          jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="routed_experts: gemm must be"):
        experts.routed_experts(x, weights, chosen, jnp.zeros((2, 4, 3)), jnp.zeros((2, 4, 3)), jnp.zeros((2, 3, 4)),
                               gemm="cublas")


@pytest.mark.parametrize("gemm", experts.GEMMS)
def test_strategies_lower_to_straight_line_code(gemm):
    """No strategy puts a loop in the step: a while loop on a GPU leaves command buffers and
    syncs with the host at every trip (the Triton path's block search is unrolled)."""
    rng = np.random.default_rng()
    weights, chosen = routing(rng, 300, 64, 6)
    stacks = [jnp.asarray(w) for w in expert_weights(rng, 64, 16, 8)]
    run = jax.jit(functools.partial(experts.routed_experts, gemm=gemm))
    hlo = run.lower(jnp.zeros((300, 16)), jnp.asarray(weights), jnp.asarray(chosen), *stacks).as_text()
    assert "stablehlo.while" not in hlo
