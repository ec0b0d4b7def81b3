"""The routed experts of a mixture of experts: ``sum_j weights[t, j] * expert_{chosen[t, j]}(x[t])``,
computed by one of three GEMM strategies, chosen per step shape (``choose_gemm``):

  * ``"ragged_dot"``: ``jax.lax.ragged_dot`` over the token copies grouped by expert (exact work,
    but XLA's GPU lowering reads every expert and runs at 1-2% of the matmul rate at prefill sizes);
  * ``"dense"``: every expert on every token, the outputs weighted by the routing (0 for experts a
    token did not choose): each expert's weights read once, ``E / k`` times the FLOPs;
  * ``"triton"``: ``jaxattn.kernels.grouped_gemm``, the copies grouped by expert in blocks, each
    block multiplied by its own expert: reads only the experts the tokens touch, routed FLOPs only.

Measured (benchmarks/RESULTS.md, "moe_grouped_gemm", H100, 2026-11-27, each timed call on another
of 8 routings; four MoE shapes, 1 to 2,048 tokens): dense beat ragged_dot at every size (1.03x to
6.3x); the Triton kernel beat dense at 1 token (3.5x to 8.5x), at 8 tokens (1.07x to 2.0x), at
128-2,048 tokens of the shapes with 60-128 experts (1.06x to 3.7x) and at Mixtral's 2,048 (2.0x),
was level at 32 tokens (0.96x to 1.07x) and lost at Mixtral's 32-512 (0.94x down to 0.35x: 8
experts of 14336 columns); on FP8 stacks dense also won at 8-128 tokens of most shapes. On a GPU
``choose_gemm`` takes the fastest strategy of the nearest shape in that measured table
(``expert_gemm_table``: ``jaxattn/tuning/moe_sm_90.json``, written by ``bench_moe --table``), and
"dense" where no entry is near. Off the GPU (tests, CPU serving) ragged_dot does the exact work.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Union

import jax
import jax.numpy as jnp

from jaxattn.serve.models import expert_gemm_table

GEMMS = ("ragged_dot", "dense", "triton")
LAYOUTS = ("ekn", "enk")      # an FP8 stack's values: [E, in, out], or each kernel transposed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Stack:
    """A stack of E FP8 expert kernels ``[in, out]``, ``W[e] = values[e] * scale[e]`` broadcast
    (``jaxattn.serve.models.quantization.Fp8Experts`` holds one): ``values`` float8_e4m3fn ``[E, in,
    out]`` (``layout`` "ekn") or each kernel transposed, ``[E, out, in]`` ("enk": the layout FP8
    tensor-core dots read, inputs contiguous), ``scale`` float32 ``[E]`` (per expert), ``[E, out]``
    (per output channel) or, with ``block = (bi, bo)``, ``[E, ceil(in / bi), ceil(out / bo)]``."""
    values: jax.Array
    scale: jax.Array
    block: tuple[int, int] | None = dataclasses.field(default=None, metadata=dict(static=True))
    layout: str = dataclasses.field(default="ekn", metadata=dict(static=True))

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"Fp8Stack: layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        """``(E, in, out)`` whatever the layout."""
        experts, first, second = self.values.shape
        return (experts, first, second) if self.layout == "ekn" else (experts, second, first)

    def kernels(self) -> jax.Array:
        """The values ``[E, in, out]`` (a transpose of an "enk" stack)."""
        return self.values if self.layout == "ekn" else jnp.swapaxes(self.values, 1, 2)

    def blocks(self) -> tuple[jax.Array, int, int]:
        """The scales as blocks of any granularity: ``(scale [E, KB, NB], bi, bo)``, block (kb, nb)
        covering rows ``kb*bi ..`` and columns ``nb*bo ..`` of each ``[in, out]`` kernel."""
        experts, rows, cols = self.shape
        if self.block is not None:
            return self.scale, *self.block
        if self.scale.ndim == 1:
            return self.scale.reshape(experts, 1, 1), rows, cols
        return self.scale.reshape(experts, 1, cols), rows, 1

    def dequantize(self, dtype) -> jax.Array:
        """``[E, in, out]`` in ``dtype``: each expert's ``quantization.dequantize`` (the values times
        their scales in float32), rounded once."""
        # imported here: quantization builds on layers, which imports this module
        from jaxattn.serve.models.quantization import dequantize

        granularity = self.block or ("tensor", "channel")[self.scale.ndim - 1]
        return jax.vmap(lambda values, scale: dequantize(values, scale, granularity))(self.kernels(),
                                                                                       self.scale).astype(dtype)


Stack = Union[jax.Array, Fp8Stack]      # an expert weight stack: in the model's dtype, or FP8


def choose_gemm(tokens: int, experts: int, k: int, dim: int, hidden: int, fp8: bool = False) -> str:
    """The strategy ``routed_experts`` takes for ``gemm="auto"`` at ``tokens`` tokens of ``dim``
    features, ``experts`` local experts of hidden size ``hidden`` (FP8 stacks with ``fp8``) and
    ``k`` experts per token (static: a compiled step shape): on a GPU the fastest of the nearest
    measured shape (``expert_gemm_table``; "dense" without one), elsewhere "ragged_dot"."""
    if jax.default_backend() != "gpu":
        return "ragged_dot"
    table = expert_gemm_table.current_table()
    key = expert_gemm_table.Key("fp8" if fp8 else "bf16", experts, k, dim, hidden, tokens)
    entry = None if table is None else table.nearest(key)
    return next((name for name in (entry.order if entry else ()) if name in GEMMS), "dense")


def routed_experts(x: jax.Array, weights: jax.Array, chosen: jax.Array, gate_proj: Stack, up_proj: Stack,
                   down_proj: Stack, first: jax.Array | int = 0, gemm: str = "auto",
                   ragged_dot: Callable[..., jax.Array] = jax.lax.ragged_dot) -> jax.Array:
    """``sum_j weights[t, j] * expert_{chosen[t, j]}(x[t])`` ``[T, dim]`` over the experts
    ``first .. first + E`` whose stacked weights are given (``[E, dim, F]``, ``[E, dim, F]``,
    ``[E, F, dim]``); copies routed to other experts add nothing (expert parallelism: a device's
    experts). ``x [T, dim]``, ``weights [T, k]`` in x's dtype, ``chosen int32[T, k]``; ``gemm``:
    one of ``GEMMS`` or "auto" (``choose_gemm``); ``ragged_dot(lhs, rhs, group_sizes)``: the
    grouped GEMM of "ragged_dot" (``benchmarks/bench_moe.py`` compares tokamax's). A stack may be an
    ``Fp8Stack``: "triton" reads its FP8 values and scales in the kernel, "dense" converts them
    and scales its products (``_expert_einsum``), "ragged_dot" dequantizes the stack first."""
    if gemm == "auto":
        gemm = choose_gemm(x.shape[0], gate_proj.shape[0], chosen.shape[1], x.shape[1], gate_proj.shape[2],
                           isinstance(gate_proj, Fp8Stack))
    if gemm == "triton":
        return _triton(x, weights, chosen, gate_proj, up_proj, down_proj, first)
    if gemm == "dense":
        return _dense(x, weights, chosen, gate_proj, up_proj, down_proj, first)
    if gemm == "ragged_dot":
        gate_proj, up_proj, down_proj = (w.dequantize(x.dtype) if isinstance(w, Fp8Stack) else w
                                         for w in (gate_proj, up_proj, down_proj))
        return _ragged(x, weights, chosen, gate_proj, up_proj, down_proj, first, ragged_dot)
    raise ValueError(f"routed_experts: gemm must be 'auto' or one of {GEMMS}, got {gemm!r}")


def _group(chosen: jax.Array, first: jax.Array | int, experts: int) -> tuple[jax.Array, ...]:
    """Each token copy's group, the groups' sizes and its rank in its group: ``(here bool[T k],
    group int32[T k], counts int32[E + 1], rank int32[T k])``; copies for experts outside
    ``first .. first + E`` form a last group E. A counting permutation (one-hot cumsums, no sort:
    straight-line code for command buffers)."""
    local = chosen.reshape(-1) - first
    here = (local >= 0) & (local < experts)
    group = jnp.where(here, local, experts)
    onehot = jax.nn.one_hot(group, experts + 1, dtype=jnp.int32)      # [T k, E + 1]
    counts = jnp.sum(onehot, axis=0)
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    return here, group, counts, rank


def _combine(rows: jax.Array, place: jax.Array, here: jax.Array, weights: jax.Array) -> jax.Array:
    """``sum_j weights[t, j] * rows[place[t k + j]]`` over the copies ``here``: ``[T, dim]``."""
    tokens, k = weights.shape
    # rows of no group are not defined by every lowering: select, not multiply by a zero weight
    copies = jnp.where(here.reshape(tokens, k, 1), rows[place].reshape(tokens, k, -1) * weights[:, :, None], 0)
    return jnp.sum(copies, axis=1).astype(rows.dtype)


def _ragged(x, weights, chosen, gate_proj, up_proj, down_proj, first, ragged_dot):
    tokens, k = chosen.shape
    experts = gate_proj.shape[0]
    here, group, counts, rank = _group(chosen, first, experts)
    place = jnp.cumsum(counts)[group] - counts[group] + rank
    grouped = jnp.zeros((tokens * k, x.shape[1]), x.dtype).at[place].set(jnp.repeat(x, k, axis=0))
    group_sizes = counts[:experts]                     # the last group's rows are in none: ragged_dot skips them
    gate = ragged_dot(grouped, gate_proj, group_sizes)
    up = ragged_dot(grouped, up_proj, group_sizes)
    out = ragged_dot((jax.nn.silu(gate) * up).astype(x.dtype), down_proj, group_sizes)
    return _combine(out, place, here, weights)


def _dense(x, weights, chosen, gate_proj, up_proj, down_proj, first):
    experts = gate_proj.shape[0]
    hidden = jax.nn.silu(_expert_einsum("td,edf->etf", x, gate_proj)) * _expert_einsum("td,edf->etf", x, up_proj)
    out = _expert_einsum("etf,efd->etd", hidden.astype(x.dtype), down_proj)
    # one_hot of another device's expert (out of 0..E-1) is a zero row: that copy adds nothing
    routing = jnp.sum(jax.nn.one_hot(chosen - first, experts, dtype=x.dtype) * weights[:, :, None], axis=1)
    return jnp.einsum("etd,te->td", out, routing).astype(x.dtype)


def _expert_einsum(spec: str, lhs: jax.Array, stack: Stack) -> jax.Array:
    """``einsum(spec, lhs, W)`` ``[E, T, out]`` in lhs's dtype. FP8 values with per-expert or
    per-column scales are only converted to lhs's dtype, which XLA can fuse into the GEMM's operand
    (the weights then read as FP8), and their scales multiply the product; block scales vary along
    the contraction, so such a stack is dequantized first."""
    if not isinstance(stack, Fp8Stack):
        return jnp.einsum(spec, lhs, stack)
    if stack.block is not None:
        return jnp.einsum(spec, lhs, stack.dequantize(lhs.dtype))
    # an "enk" stack's transpose folds into the dot's dimension numbers (XLA's transpose folding)
    product = jnp.einsum(spec, lhs, stack.kernels().astype(lhs.dtype))
    return (product * stack.scale.reshape(stack.shape[0], 1, -1)).astype(lhs.dtype)


def block_rows(tokens: int, experts: int, k: int) -> int:
    """The Triton path's rows per block at a step shape: about the copies per expert, 16 to 64."""
    per_expert = -(-tokens * k // experts)
    return min(64, max(16, 1 << (per_expert - 1).bit_length()))


def num_blocks(tokens: int, experts: int, k: int, block_m: int) -> int:
    """The Triton path's blocks at a step shape: at most ``min(E, T k)`` groups are used, each
    padded by fewer than ``block_m`` rows."""
    return -(-(tokens * k + min(experts, tokens * k) * (block_m - 1)) // block_m)


def fp8_row_group(stack: Stack) -> int | None:
    """The columns each scale of the FP8 rows covers where the Triton path multiplies ``stack``
    with FP8 rows in FP8 x FP8 dots (``grouped_gemm.quantize_rows``, ``fp8_row_group``): an
    "enk" FP8 stack whose scales are constant along the contraction (per expert or output channel:
    one scale per row) or blocks a whole number of kernel tiles deep (one per block of columns);
    None for the other stacks, which take the rows in the model's dtype."""
    from jaxattn.kernels import grouped_gemm

    if not (isinstance(stack, Fp8Stack) and stack.layout == "enk"):
        return None
    _, bi, bo = stack.blocks()
    return grouped_gemm.fp8_row_group(stack.shape[1], (bi, bo))


def _triton(x, weights, chosen, gate_proj, up_proj, down_proj, first):
    from jaxattn.kernels.grouped_gemm import grouped_gemm, quantize_rows

    tokens, k = chosen.shape
    experts = gate_proj.shape[0]
    block_m = block_rows(tokens, experts, k)
    blocks = num_blocks(tokens, experts, k, block_m)
    here, group, counts, rank = _group(chosen, first, experts)
    padded = -(-counts[:experts] // block_m) * block_m
    ends = jnp.cumsum(padded)
    place = jnp.where(here, (ends - padded)[jnp.minimum(group, experts - 1)] + rank, blocks * block_m)
    # each block row's token (-1: padding); the kernel gathers the rows, so the copies are never written
    token = jnp.full((blocks * block_m,), -1, jnp.int32).at[place].set(jnp.arange(tokens * k) // k, mode="drop")
    block_expert = jnp.searchsorted(ends, jnp.arange(blocks) * block_m, side="right", method="scan_unrolled")
    block_expert = jnp.where(block_expert < experts, block_expert, -1).astype(jnp.int32)
    stacks, scales = _operands(gate_proj, up_proj)
    rows = x
    if group := fp8_row_group(gate_proj):        # each token quantized once, its copies sharing its scales
        rows, row_scale = quantize_rows(x, group)
        scales.update(row_scale=row_scale, out_dtype=x.dtype)
    hidden = grouped_gemm(rows, block_expert, *stacks, block_m=block_m, row_index=token, **scales)
    stacks, scales = _operands(down_proj)
    if group := fp8_row_group(down_proj):
        hidden, row_scale = quantize_rows(hidden, group)
        scales.update(row_scale=row_scale, out_dtype=x.dtype)
    out = grouped_gemm(hidden, block_expert, *stacks, block_m=block_m, **scales)
    return _combine(out, place, here, weights)


def _operands(weights: Stack, up: Stack | None = None) -> tuple[tuple, dict]:
    """``grouped_gemm``'s weight operands and scale keywords of a stack, or of gate and up."""
    if not isinstance(weights, Fp8Stack):
        return (weights, up), {}
    scale, bi, bo = weights.blocks()
    common = dict(scale_block=(bi, bo), weight_layout=weights.layout)
    if up is None:
        return (weights.values, None), dict(scale=scale, **common)
    up_scale, *up_block = up.blocks()
    if (*up_block, up.layout) != (bi, bo, weights.layout):
        raise ValueError(f"routed_experts: gate_proj and up_proj must be scaled and laid out alike, got blocks "
                         f"{(bi, bo)} and {tuple(up_block)}, layouts {weights.layout!r} and {up.layout!r}")
    return (weights.values, up.values), dict(scale=scale, up_scale=up_scale, **common)
