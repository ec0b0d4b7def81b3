"""Splitting a decoder (``jaxattn.serve.models.llama.Llama``, ``jaxattn.serve.models.deepseek.DeepSeek``) over
a mesh, as vLLM/Megatron do: the weights carry Flax partitioning metadata in logical axis names,
"heads" (q projection columns, o projection rows), "kv_heads" (k/v projection columns), "mlp"
(gate/up columns, down rows), "vocab" (embedding rows, LM head columns), "experts" and
"expert_mlp" (a mixture's stacked experts and their hidden columns), and ``shard_model`` places
them over mesh axes by ``tensor_parallel_rules``: column-parallel q/k/v/gate/up, row-parallel
o/down (XLA adds one all-reduce after each), vocab-parallel embedding and LM head. A mixture of
experts splits every expert's hidden columns the same way, or, after ``enable_expert_parallel``
(vLLM's ``--enable-expert-parallel``), gives each device ``num_experts / tp`` whole experts
(``layers.ExpertParallel``), its shared expert split like the dense MLP; either way the routed
experts run in ``shard_map`` on each device's part (``place_experts``).

Multi-head latent attention (DeepSeek) is not split: its weights and latent caches are replicated,
every device attends with every head (the latent cache is per token, not per head, so vLLM
replicates it too; splitting MLA's heads is not built yet), and the MLPs and experts around it
are split as above."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxattn.serve.models.layers import MLP, Decoder, ExpertParallel, ExpertTensorParallel, MoE
from jaxattn.sharding import MeshAxes, num_head_shards, tensor_parallel_mesh

__all__ = ["enable_expert_parallel", "expert_parallel_axes", "param_shardings", "place_experts", "shard_model",
           "tensor_parallel_rules"]


def tensor_parallel_rules(cfg: Any, mesh: Mesh, axes: str | tuple[str, ...],
                          expert_parallel: bool = False) -> tuple[tuple[str, MeshAxes], ...]:
    """Flax logical-axis rules that split a model of config ``cfg`` over mesh ``axes`` (module
    docstring): dense MLP columns and the vocabulary always; a Llama's query heads, and its KV
    heads when the shards divide them; an MLA model's attention not at all (replicated); the
    experts' hidden columns or (``expert_parallel``) the experts themselves. ValueError naming the
    config field that the number of shards does not divide."""
    num_shards = num_head_shards(mesh, axes)
    mla = not hasattr(cfg, "num_kv_heads")
    dense_mlp = not cfg.num_experts or getattr(cfg, "first_k_dense_replace", 0) > 0
    split = ([] if mla else ["num_q_heads"]) + (["hidden_dim"] if dense_mlp else []) + ["vocab_size"]
    if cfg.num_experts:
        split += ["num_experts" if expert_parallel else "moe_hidden_dim"]
        split += ["shared_expert_dim"] if cfg.shared_expert_dim else []
    for field in split:
        if getattr(cfg, field) % num_shards:
            raise ValueError(f"{'expert' if field == 'num_experts' else 'tensor'} parallelism over {num_shards} "
                             f"shards (mesh axes {axes!r}): the model's {field} ({getattr(cfg, field)}) must be a "
                             f"multiple of {num_shards}")
    experts, expert_mlp = (axes, None) if expert_parallel else (None, axes)
    if mla:
        return (("heads", None), ("kv_heads", None), ("mlp", axes), ("vocab", axes), ("experts", experts),
                ("expert_mlp", expert_mlp))
    if cfg.num_kv_heads % num_shards and num_shards % cfg.num_kv_heads:
        raise ValueError(f"tensor parallelism over {num_shards} shards (mesh axes {axes!r}): the model's "
                         f"num_kv_heads ({cfg.num_kv_heads}) and {num_shards} must divide one another (fewer "
                         f"shards split the KV heads, more replicate them)")
    kv_heads = axes if cfg.num_kv_heads % num_shards == 0 else None
    return (("heads", axes), ("kv_heads", kv_heads), ("mlp", axes), ("vocab", axes), ("experts", experts),
            ("expert_mlp", expert_mlp))


def _moes(model: Decoder) -> list[MoE]:
    return [block.mlp for block in model.layers if isinstance(block.mlp, MoE)]


def expert_parallel_axes(model: Decoder) -> ExpertParallel | None:
    """The mesh and axes ``enable_expert_parallel`` split ``model``'s experts over, or None."""
    placements = {moe.expert_parallel for moe in _moes(model)}
    return placements.pop() if len(placements) == 1 else None


def enable_expert_parallel(model: Decoder, mesh: Mesh, axes: MeshAxes = None) -> Decoder:
    """Makes ``model``'s mixtures of experts run expert-parallel over mesh ``axes`` (default: all
    the mesh's; ``layers.ExpertParallel``): ``param_shardings`` and ``shard_model`` then place
    whole experts per device, and the jitted step runs each device's experts and sums their
    outputs. Sets a static attribute of each ``MoE``; the weights are not moved (``shard_model``
    or ``Engine(mesh=)`` place them). ValueError when the model has no experts or the shards do
    not divide them."""
    if not getattr(model.cfg, "num_experts", 0):
        raise ValueError("enable_expert_parallel: the model has no experts (cfg.num_experts is 0)")
    mesh, axes = tensor_parallel_mesh(mesh, axes)
    tensor_parallel_rules(model.cfg, mesh, axes, expert_parallel=True)
    for moe in _moes(model):
        moe.expert_parallel = ExpertParallel(mesh, axes)
    return model


def place_experts(model: Decoder, mesh: Mesh, axes: MeshAxes = None) -> Decoder:
    """Makes ``model``'s mixtures of experts run split over mesh ``axes`` (default: all the
    mesh's) as ``param_shardings`` places them: whole experts per device after
    ``enable_expert_parallel`` (``layers.ExpertParallel``), else every expert's hidden units split
    (``layers.ExpertTensorParallel``, so that the Triton grouped GEMM runs on each device's slices
    rather than on weights XLA would gather). A static attribute of each ``MoE``, set before the
    step is traced: ``shard_model``, ``from_pretrained(mesh=)`` and ``Engine(mesh=)`` call it."""
    mesh, axes = tensor_parallel_mesh(mesh, axes)
    for moe in _moes(model):
        moe.tensor_parallel = None if moe.expert_parallel is not None else ExpertTensorParallel(mesh, axes)
    return model


def param_shardings(model: Decoder, mesh: Mesh, axes: MeshAxes = None) -> nnx.State:
    """The ``NamedSharding`` of each of ``nnx.state(model)``'s weights for tensor parallelism over
    mesh ``axes`` (default: all the mesh's; on the mesh with Auto axis types), experts split whole
    after ``enable_expert_parallel`` over the same mesh and axes (ValueError otherwise), fused
    projections split by whole groups (``jaxattn.serve.models.fusion``; ValueError for MLPs fused
    for a shard count the mesh's does not divide)."""
    mesh, axes = tensor_parallel_mesh(mesh, axes)
    placement = expert_parallel_axes(model)
    if placement is not None and placement != ExpertParallel(mesh, axes):
        raise ValueError(f"param_shardings: the model's experts are split over mesh axes {placement.axes!r} of "
                         f"another mesh (enable_expert_parallel); place it over that mesh, or enable expert "
                         f"parallelism again over this one")
    num_shards = num_head_shards(mesh, axes)
    grouped = {mlp.fused_shards for _, mlp in nnx.iter_graph(model) if isinstance(mlp, MLP) and mlp.fused_shards}
    if any(groups % num_shards for groups in grouped):
        raise ValueError(f"param_shardings: the model's MLPs are fused for {sorted(grouped)} shards, which "
                         f"{num_shards} shards do not split into whole groups; fuse them for this mesh first: "
                         f"jaxattn.serve.models.fusion.fuse_projections(model, {num_shards})")
    with nnx.logical_axis_rules(tensor_parallel_rules(model.cfg, mesh, axes, placement is not None)):
        return nnx.get_named_sharding(nnx.state(model), mesh)


def shard_model(model: Decoder, mesh: Mesh, axes: MeshAxes = None, *, expert_parallel: bool = False) -> Decoder:
    """Places ``model``'s weights (in place) for tensor parallelism over mesh ``axes`` (default:
    all the mesh's), whole experts per device with ``expert_parallel`` (``enable_expert_parallel``);
    returns the model. Run it under ``jax.jit`` as usual: XLA keeps each weight where it is and
    all-reduces the outputs of the row-parallel layers. Create the KV caches with
    ``model.init_caches(..., mesh=mesh, axes=axes)``."""
    if expert_parallel:
        enable_expert_parallel(model, mesh, axes)
    place_experts(model, mesh, axes)
    nnx.update(model, jax.device_put(nnx.state(model), param_shardings(model, mesh, axes)))
    return model
