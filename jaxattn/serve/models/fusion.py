"""Fused projections: one GEMM where a checkpoint keeps several weights over the same input
(vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``, made after loading).

``fuse_projections(model, shards)`` replaces, in place, each Llama attention's ``q_proj``,
``k_proj`` and ``v_proj`` by one ``qkv_proj``, each DeepSeek attention's projections of its
input (``q_a_proj`` or ``q_proj``, and ``kv_a_proj``) by one ``qkv_a_proj``, and each SwiGLU
``MLP``'s (dense, or a mixture's shared expert) ``gate_proj`` and ``up_proj`` by one
``gate_up_proj``. A decode step's GEMMs are bound by reading their weights, and small ones read
further below the copy rate than one of their combined size: on an H100 (benchmarks/RESULTS.md,
"step_fusion") Llama-3-8B's fused q/k/v ran at 73% of the copy rate where XLA's own merge of the
three dots (one Triton fusion over three operands) ran at 61%, gate/up at 95% against 86%, and
the decode step took 5.3% less time. The ``Engine`` fuses its model
(``Engine(fuse_projections=True)``).

The fused columns are laid out so that tensor parallelism stays a plain split of the columns:

- ``qkv_proj [dim, Hkv * (G + 2) * D]`` (G = Hq / Hkv): per KV head, its G query heads, then its
  key head and its value head, on the logical axis "kv_heads": any shard count that divides Hkv
  holds whole groups. With more shards than KV heads the projections stay apart (k and v are
  replicated there, q is split; an attention fused earlier is split again).
- ``qkv_a_proj [dim, q + R + Dr]``: the query part, then the latent and RoPE key (MLA is replicated
  over a mesh, so any shard count takes it whole).
- ``gate_up_proj [dim, 2F]``: ``shards`` groups, each the gate columns then the up columns of
  F / shards hidden units, on the logical axis "mlp" (``MLP.fused_shards``): a mesh of tp shards,
  tp dividing ``shards``, holds whole groups; fusing again for another count regroups them.

Without tensor parallelism (``shards`` 1) a mixture of experts' shared expert, when its hidden
units are a whole number n of ``moe_hidden_dim`` groups, becomes the expert stacks' last n experts
(``MoE.fused_shared_experts``), every token routed to them with weight 1 (Qwen2-MoE: its gate's
sigmoid), so the routed experts' grouped GEMM computes it in the same launches (SGLang's shared
experts fusion): its gate/up and down GEMMs, their SwiGLU and the sum with the routed output are
no launches of their own. FP8 experts take the shared expert's FP8 values when their scales map
onto the stacks' (per expert: a per-tensor scale; per channel: per-tensor or per-channel ones;
blocks: the same blocks, whole per group); otherwise, or with a bias, the shared expert stays an
MLP. A model split over a mesh afterwards keeps the groups as experts (valid, but expert
parallelism then puts them all on one device).

FP8 parts (``Fp8Linear``) are fused in FP8: per-tensor scales become per-channel ones (exact),
per-channel scales are laid out as the columns, block scales as the column blocks when every
group of every part is a whole number of blocks. Parts that cannot be fused that way (block
scales across a group, an FP8 part beside an unquantized one) stay apart, computed as before."""

from __future__ import annotations

import gc
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxattn.serve.models import deepseek, layers
from jaxattn.serve.models.llama import Attention
from jaxattn.serve.models.quantization import Fp8Experts, Fp8Linear

Linear = nnx.Linear | Fp8Linear


def fuse_projections(model: layers.Decoder, shards: int = 1) -> layers.Decoder:
    """Fuses ``model``'s projections in place for tensor parallelism over ``shards`` devices (1:
    none) and returns it (module docstring). Idempotent; a model fused for another shard count
    has its MLP groups regrouped (or split apart where ``shards`` cannot group them). ValueError
    for a model that is not a decoder of ``jaxattn.serve.models``."""
    if not isinstance(model, layers.Decoder):
        raise ValueError(f"fuse_projections: model must be a jaxattn.serve.models decoder (Llama, DeepSeek: a "
                         f"layers.Decoder), got {type(model).__name__}")
    if not (isinstance(shards, int) and shards >= 1):
        raise ValueError(f"fuse_projections: shards must be a positive int, got {shards!r}")
    for block in model.layers:
        if isinstance(block.attn, Attention):
            _fuse_attention(block.attn, shards)
        elif isinstance(block.attn, deepseek.Attention) and not block.attn.fused:
            _fuse_latent_attention(block.attn)
        # replaced weights may sit in reference cycles, freed only by a collection (on an H100, jax
        # 0.11.2 and flax 0.12.10, a bf16 DeepSeek-V2-Lite kept all of its old expert stacks, 28 GiB,
        # for the engine's pool): the stacks, most of a mixture's weights, before the next layer's
        # copies are made; the rest once at the end (a collection takes tens of ms)
        if isinstance(block.mlp, layers.MoE) and shards == 1 and block.mlp.cfg.shared_expert_dim \
                and _fuse_shared_expert(block.mlp):
            gc.collect()
        for mlp in (block.mlp, getattr(block.mlp, "shared_expert", None)):
            if isinstance(mlp, layers.MLP):
                _fuse_mlp(mlp, shards)
    gc.collect()
    return model


def _fuse_attention(attn: Attention, shards: int) -> None:
    cfg = attn.cfg
    if shards > cfg.num_kv_heads:     # k and v replicated, q split: apart again if fused before
        if attn.fused:
            sizes = [cfg.num_q_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
            axes = [(None, "heads"), (None, "kv_heads"), (None, "kv_heads")]
            attn.q_proj, attn.k_proj, attn.v_proj = _split(attn.qkv_proj, sizes, cfg.num_kv_heads, axes)
            del attn.qkv_proj
            attn.fused = False
        return
    if not attn.fused:
        fused = _concatenate((attn.q_proj, attn.k_proj, attn.v_proj), cfg.num_kv_heads, (None, "kv_heads"))
        if fused is not None:
            del attn.q_proj, attn.k_proj, attn.v_proj
            attn.qkv_proj, attn.fused = fused, True


def _fuse_latent_attention(attn: deepseek.Attention) -> None:
    name = "q_a_proj" if attn.cfg.q_lora_rank else "q_proj"
    fused = _concatenate((getattr(attn, name), attn.kv_a_proj), 1, (None, None))
    if fused is not None:
        delattr(attn, name)
        del attn.kv_a_proj
        attn.qkv_a_proj, attn.fused = fused, True


def _fuse_mlp(mlp: layers.MLP, shards: int) -> None:
    if mlp.fused_shards == shards:
        return
    if mlp.fused_shards:              # fused for another shard count: back to the two parts first
        hidden = mlp.down_proj.in_features
        parts = _split(mlp.gate_up_proj, [hidden, hidden], mlp.fused_shards, [(None, "mlp")] * 2)
        del mlp.gate_up_proj
        mlp.gate_proj, mlp.up_proj, mlp.fused_shards = *parts, 0
    fused = _concatenate((mlp.gate_proj, mlp.up_proj), shards, (None, "mlp"))
    if fused is not None:
        del mlp.gate_proj, mlp.up_proj
        mlp.gate_up_proj, mlp.fused_shards = fused, shards


def _columns(linear: Linear) -> dict[str, jnp.ndarray]:
    """The arrays of ``linear`` whose last axis runs over its output columns (a block scale's, over
    column blocks): kernel, bias, and an FP8 layer's scale (a per-tensor scale as per-channel)."""
    arrays = {"kernel": linear.values() if isinstance(linear, Fp8Linear) else linear.kernel[...]}
    if linear.bias is not None:
        arrays["bias"] = linear.bias[...]
    if isinstance(linear, Fp8Linear):
        scale = linear.scale[...]
        arrays["scale"] = jnp.broadcast_to(scale, (linear.out_features,)) if linear.granularity == "tensor" else scale
    return arrays


def _interleave(arrays: Sequence[jnp.ndarray], groups: int) -> jnp.ndarray:
    """Group 0 of every array's last axis (``groups`` equal groups each), then group 1, ..."""
    split = [a.reshape(*a.shape[:-1], groups, a.shape[-1] // groups) for a in arrays]
    fused = jnp.concatenate(split, axis=-1)
    return fused.reshape(*fused.shape[:-2], -1)


def _concatenate(parts: Sequence[Linear], groups: int, axes: layers.Axes) -> Linear | None:
    """One linear whose columns are ``parts``' in ``groups`` interleaved groups (``_interleave``),
    its kernel on the logical ``axes``; None when the parts cannot be fused (module docstring)."""
    kinds = {type(part) for part in parts}
    if len(kinds) != 1 or len({part.bias is None for part in parts}) != 1 \
            or any(part.out_features % groups for part in parts):
        return None
    first, block_size = parts[0], None
    if isinstance(first, Fp8Linear):
        granularities = {part.granularity for part in parts}
        if not granularities <= {"tensor", "channel"}:
            if len(granularities) != 1:
                return None
            block_size = granularities.pop()
            # whole blocks per group; in one group, the last part may end in a partial block
            whole = parts if groups > 1 else parts[:-1]
            if any(part.out_features // groups % block_size[1] for part in whole):
                return None
    columns = [_columns(part) for part in parts]
    fused = {name: _interleave([c[name] for c in columns], groups) for name in columns[0]}
    return _linear_like(first, fused, block_size, axes)


def _split(fused: Linear, sizes: Sequence[int], groups: int, axes: Sequence[layers.Axes]) -> list[Linear]:
    """The linears of ``sizes`` columns each, on the logical ``axes``, that ``fused`` was made of
    (``_concatenate`` over ``groups``)."""
    columns = {}
    for name, array in _columns(fused).items():
        widths = [size * array.shape[-1] // sum(sizes) // groups for size in sizes]   # block scales: in blocks
        grouped = array.reshape(*array.shape[:-1], groups, -1)
        columns[name] = [part.reshape(*array.shape[:-1], -1)
                         for part in jnp.split(grouped, np.cumsum(widths)[:-1], axis=-1)]
    block_size = None if not isinstance(fused, Fp8Linear) or isinstance(fused.granularity, str) else fused.granularity
    return [_linear_like(fused, {name: split[i] for name, split in columns.items()}, block_size, axes[i])
            for i in range(len(sizes))]


def _linear_like(like: Linear, arrays: dict[str, jnp.ndarray], block_size: tuple[int, int] | None,
                 axes: layers.Axes) -> Linear:
    """A linear of ``like``'s kind and dtype holding ``arrays`` (``_columns``' names)."""
    kernel, bias = arrays["kernel"], arrays.get("bias")
    if isinstance(like, Fp8Linear):
        return Fp8Linear(kernel, arrays["scale"], bias, block_size=block_size, dtype=like.dtype, axes=axes,
                         activations=like.activations)
    return nnx.Linear(*kernel.shape, use_bias=bias is not None, dtype=like.dtype, param_dtype=like.param_dtype,
                      kernel_init=layers.partitioned(lambda *_: kernel, axes),
                      bias_init=layers.partitioned(lambda *_: bias, axes[1:]), rngs=nnx.Rngs(0))


def _fuse_shared_expert(moe: layers.MoE) -> bool:
    """``moe``'s shared expert as its stacks' last experts, where it can be (module docstring);
    whether it replaced the stacks."""
    if moe.fused_shared_experts or moe.expert_parallel is not None or moe.tensor_parallel is not None:
        return False
    mlp, hidden = moe.shared_expert, moe.cfg.moe_hidden_dim
    width = mlp.down_proj.in_features
    if width % hidden:
        return False
    gate, up = (mlp.gate_proj, mlp.up_proj) if not mlp.fused_shards else \
        _split(mlp.gate_up_proj, [width, width], mlp.fused_shards, [(None, "mlp")] * 2)
    stacks = {}
    for name, linear in (("gate_proj", gate), ("up_proj", up), ("down_proj", mlp.down_proj)):
        stacks[name] = _stack_with(getattr(moe, name), linear, width // hidden, name)
        if stacks[name] is None:
            return False
    # one layer's copies at a time: the host would otherwise queue every layer's concatenations,
    # each holding its new stack and its inputs until the GPU reaches it
    jax.block_until_ready(stacks)
    for name, stack in stacks.items():
        setattr(moe, name, stack)
    del moe.shared_expert
    moe.fused_shared_experts = width // hidden
    return True


def _stack_with(stack: nnx.Param | Fp8Experts, linear: Linear, groups: int, name: str) -> nnx.Param | Fp8Experts | None:
    """``stack`` ``[E, in, out]`` with ``linear``'s kernel appended as ``groups`` experts (its
    hidden units in equal groups: the output columns of gate / up, the input rows of down), in the
    stack's kind (``layers.EXPERT_AXES[name]``); None where the two cannot be joined exactly."""
    fp8 = isinstance(stack, Fp8Experts)
    if linear.bias is not None or fp8 != isinstance(linear, Fp8Linear):
        return None
    split_rows = name == "down_proj"
    axes = layers.EXPERT_AXES[name]
    if not fp8:
        values = linear.kernel[...]
        if values.dtype != stack[...].dtype:
            return None
        joined = jnp.concatenate([stack[...], _as_experts(values, groups, split_rows)])
        return nnx.Param(layers.partitioned(lambda: joined, axes)())
    current = stack.stack()
    scale = _expert_scales(current, linear, groups, split_rows)
    if scale is None:
        return None
    return Fp8Experts(jnp.concatenate([current.kernels(), _as_experts(linear.values(), groups, split_rows)]),
                      jnp.concatenate([current.scale, scale]), block_size=current.block, axes=axes)


def _as_experts(array: jnp.ndarray, groups: int, split_rows: bool) -> jnp.ndarray:
    """``array [rows, cols]`` (a kernel ``[in, out]``, or its block scales) as ``groups`` experts:
    ``[groups, rows / groups, cols]`` (``split_rows``), else ``[groups, rows, cols / groups]``."""
    rows, cols = array.shape
    if split_rows:
        return array.reshape(groups, rows // groups, cols)
    return jnp.moveaxis(array.reshape(rows, groups, cols // groups), 1, 0)


def _expert_scales(stack, linear: Fp8Linear, groups: int, split_rows: bool):
    """The scales of ``linear``'s kernel as ``groups`` experts (``_as_experts``) in the
    granularity of ``stack`` (an ``experts.Fp8Stack``), or None where it has no exact one."""
    scale, granularity = linear.scale[...], linear.granularity
    rows, cols = linear.in_features, linear.out_features
    if stack.block is None and stack.scale.ndim == 1:             # per expert: one scale each
        return jnp.broadcast_to(scale, (groups,)) if granularity == "tensor" else None
    if stack.block is None:                                        # per output channel
        if granularity == "tensor":
            scale = jnp.broadcast_to(scale, (cols,))
        elif granularity != "channel":
            return None
        return jnp.broadcast_to(scale, (groups, cols)) if split_rows else scale.reshape(groups, cols // groups)
    bi, bo = stack.block
    if granularity != (bi, bo) or (rows // groups if split_rows else cols // groups) % (bi if split_rows else bo):
        return None
    return _as_experts(scale, groups, split_rows)          # whole blocks per group: the blocks split alike
