"""Tensor parallelism for ``paged_attention``: each device attends with its own heads.

Under a plain ``jax.jit`` whose arguments are sharded over a mesh axis on their head dimensions
(q ``P(None, "tp", None)``, HND pages ``P(None, "tp", None, None)``, NHD pages
``P(None, None, "tp", None)``, sinks ``P("tp")``; metadata, the page table and FP8 scales
replicated), the attention is a ``custom_partitioning`` call: XLA's partitioner (Shardy's sharding
rule, or GSPMD's callbacks) hands every device its ``Hq / tp`` query heads and ``Hkv / tp`` KV
heads, the backend runs on those local shapes, and the output stays sharded like q. Nothing is
gathered: no collective touches the pool or q.

Each shard must hold whole GQA groups, so ``tp`` must divide ``Hkv``. With more shards than KV
heads, replicate KV heads as vLLM does (``replicate_kv_heads``): a cache of ``tp`` KV heads where
head ``j`` holds original head ``j // (tp // Hkv)``, which maps every query head to the same KV
head as before.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor, SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxattn.kv_cache import KVCache, pool_sharding

# attend(q, cache, plan, sinks) -> [T, Hq, D]: the unsharded attention, traced per shard; ``plan`` is
# any pytree of arrays every shard reads whole (the step's AttentionPlan).
Attend = Callable[[jax.Array, KVCache, Any, "jax.Array | None"], jax.Array]
MeshAxes = str | tuple[str, ...] | None
_SUPPORTED = ("q P(None, axes, None), HND pages P(None, axes, None, None), NHD pages "
              "P(None, None, axes, None), sinks P(axes) over the same mesh axes (or all replicated)")


def shard_by_heads(attend: Attend, q: jax.Array, cache: KVCache, meta: Any,
                   sinks: jax.Array | None) -> jax.Array:
    """``attend(q, cache, meta, sinks)`` run per head shard when the arguments are sharded on their
    head axes (module docstring; ``meta`` is a pytree of arrays every shard reads whole, the plan);
    ``[T, Hq, D]`` sharded like q. In a one-device process it is ``attend`` itself.

    Unsupported shardings raise ValueError: at trace time when the mesh axes are Explicit (the
    shardings are in the types), else when XLA partitions the jitted program (the error it
    raises then carries the same message).
    """
    if jax.device_count() == 1:
        return attend(q, cache, meta, sinks)
    leaves, treedef = jax.tree.flatten((q, cache, meta, sinks))
    typed_mesh = jax.typeof(q).sharding.mesh
    if not typed_mesh.empty and all(axis_type == AxisType.Explicit for axis_type in typed_mesh.axis_types):
        _head_axes(typed_mesh, [_typed_shape(leaf) for leaf in leaves], _roles(cache, meta, sinks, 0), cache)
    partitioned, consts = _head_partitioned(attend, treedef, tuple(_typed_shape(leaf) for leaf in leaves))
    return partitioned(*leaves, *consts)


@functools.cache
def _head_partitioned(attend: Attend, treedef, shapes: tuple[jax.ShapeDtypeStruct, ...]
                      ) -> tuple[custom_partitioning, list]:
    """``attend`` over operands of these ``shapes`` (the flattened ``(q, cache, meta, sinks)``) as a
    ``custom_partitioning`` call, and the constants to pass after the operands. Built once per
    structure and shapes: the layers of a step, which share their plan, share one."""
    _, cache, meta, sinks = jax.tree.unflatten(treedef, shapes)

    def attend_leaves(*leaves: jax.Array) -> jax.Array:
        return attend(*jax.tree.unflatten(treedef, leaves))

    # custom_partitioning traces its function once more and refuses constants captured there
    # (arrays a backend builds from NumPy): they become operands of the call, replicated.
    traced = jax.make_jaxpr(attend_leaves)(*shapes)
    consts = list(traced.consts)
    roles = _roles(cache, meta, sinks, len(consts))

    def attend_operands(*operands: jax.Array) -> jax.Array:
        return jax.core.eval_jaxpr(traced.jaxpr, operands[len(shapes):], *operands[:len(shapes)])[0]

    def per_shard(*operands: jax.Array) -> jax.Array:
        return attend_leaves(*operands[:len(shapes)])

    def partition(mesh: Mesh, arg_shapes: tuple, result_shape):
        del result_shape
        axes = _head_axes(mesh, arg_shapes, roles, cache)
        return mesh, per_shard, _head_sharding(mesh, "q", axes, cache), tuple(
            _head_sharding(mesh, role, axes, cache) for role in roles)

    partitioned = custom_partitioning(attend_operands)
    partitioned.def_partition(
        partition=partition,
        infer_sharding_from_operands=_infer_output_sharding,
        sharding_rule=_sharding_rule(roles, list(shapes) + consts, shapes[0].shape[1], cache),
    )
    return partitioned, consts


def replicate_kv_heads(kv: jax.Array, num_shards: int) -> jax.Array:
    """``[T, Hkv, D]`` K or V tokens -> ``[T, max(Hkv, num_shards), D]``, each KV head repeated
    ``num_shards // Hkv`` times when there are more shards than KV heads (write them to a cache
    created with ``num_kv_heads=max(Hkv, num_shards)``)."""
    num_kv_heads = kv.shape[1]
    if num_shards <= num_kv_heads:
        return kv
    if num_shards % num_kv_heads:
        raise ValueError(f"replicate_kv_heads: num_shards ({num_shards}) must be a multiple of the "
                         f"number of KV heads ({num_kv_heads}) when it exceeds it")
    return jnp.repeat(kv, num_shards // num_kv_heads, axis=1)


def tensor_parallel_mesh(mesh: Mesh, axes: MeshAxes = None) -> tuple[Mesh, str | tuple[str, ...]]:
    """(``mesh`` with Auto axis types, the mesh axes to split heads over: ``axes``, or all of the
    mesh's). A model is sharded on Auto axes: XLA propagates the weights' shardings and inserts
    the all-reduces of row-parallel layers itself (on Explicit axes, each such matmul would need
    an ``out_sharding``)."""
    if axes is None:
        axes = mesh.axis_names[0] if len(mesh.axis_names) == 1 else tuple(mesh.axis_names)
    names = (axes,) if isinstance(axes, str) else axes
    unknown = [name for name in names if name not in mesh.axis_names]
    if unknown or not names:
        raise ValueError(f"axes must name axes of the mesh {mesh.axis_names}, got {axes!r}")
    return mesh.update(axis_types=(AxisType.Auto,) * len(mesh.axis_names)), axes


def _roles(cache: KVCache, meta: Any, sinks: jax.Array | None, num_consts: int) -> tuple[str, ...]:
    """What each operand ``(q, cache, meta, sinks)`` leaves, then constants, is: "q", "pool" (K or
    V pages), "scale" (FP8 scales), "meta" (the plan's arrays), "sinks" or "const"."""
    pools = ["pool" if leaf.ndim == 4 else "scale" for leaf in jax.tree.leaves(cache)]
    return ("q", *pools, *["meta"] * len(jax.tree.leaves(meta)), *(["sinks"] if sinks is not None else []),
            *["const"] * num_consts)


def _sharding_rule(roles: tuple[str, ...], operands: list[jax.Array], num_q_heads: int,
                   cache: KVCache) -> SdyShardingRule:
    """Shardy's rule: query heads ``(k g)`` are KV heads ``k`` times the group ``g``, so a sharding
    of q's or the pool's head axis propagates to the other and to the output; every other
    dimension (tokens, head_dim, pages, metadata, constants) is a factor of its own."""
    group = num_q_heads // cache.num_kv_heads
    if group == 1 or cache.num_kv_heads == 1:  # Shardy rejects size-1 factors in a compound
        heads = "k" if group == 1 else "g"
    else:
        heads = CompoundFactor("k", "g")
    mappings = {
        "q": ArrayMapping("t", heads, "d"),
        "pool": ArrayMapping("p", "k", "s", "d") if cache.layout == "HND" else ArrayMapping("p", "s", "k", "d"),
        "scale": ArrayMapping(),
        "sinks": ArrayMapping(heads),
    }
    operand_mappings = tuple(
        ArrayMapping(*(f"m{i}_{dim}" for dim in range(x.ndim))) if role in ("meta", "const") else mappings[role]
        for i, (role, x) in enumerate(zip(roles, operands)))
    compound = isinstance(heads, CompoundFactor)
    return SdyShardingRule(operand_mappings, (mappings["q"],), **({"g": group} if compound else {}))


def _infer_output_sharding(mesh: Mesh, arg_shapes: tuple, result_shape) -> jax.sharding.Sharding:
    """GSPMD's callback: the output is sharded like q. It must not raise (GSPMD aborts the process
    on an error here); the partition callback checks the shardings."""
    del mesh, result_shape
    return arg_shapes[0].sharding


def _head_sharding(mesh: Mesh, role: str, axes: MeshAxes, cache: KVCache) -> NamedSharding:
    """The per-shard layout of an operand: q (and the output) and sinks split on heads over
    ``axes``, the pools on KV heads, scales, metadata and constants replicated."""
    if role == "q":
        return NamedSharding(mesh, PartitionSpec(None, axes, None))
    if role == "pool":
        return pool_sharding(mesh, axes, cache.layout)
    if role == "sinks":
        return NamedSharding(mesh, PartitionSpec(axes))
    return NamedSharding(mesh, PartitionSpec())


def _head_axes(mesh: Mesh, shapes, roles: tuple[str, ...], cache: KVCache) -> MeshAxes:
    """The mesh axes the heads are sharded over (None: replicated), from the shardings of the
    leaves' ``shapes``; ValueError for any other sharding of q, the pages or sinks."""
    q_spec = _spec(shapes[0])
    axes = q_spec[1]
    if q_spec[0] is not None or q_spec[2] is not None:
        raise ValueError(f"paged_attention under sharding: q may be sharded only on its head axis "
                         f"(supported: {_SUPPORTED}), got q {PartitionSpec(*q_spec)}")
    num_shards = num_head_shards(mesh, axes)
    num_q_heads = shapes[0].shape[1]
    if num_q_heads % num_shards:
        raise ValueError(f"paged_attention under sharding: q's {num_q_heads} heads cannot be split into "
                         f"{num_shards} head shards (mesh axes {axes!r}): the number of shards must divide the "
                         f"number of query heads (and of the cache's KV heads)")
    if cache.num_kv_heads % num_shards:
        raise ValueError(f"paged_attention under sharding: the cache's num_kv_heads ({cache.num_kv_heads}) "
                         f"must be a multiple of the head shards ({num_shards} over mesh axes {axes!r}) so "
                         f"each shard holds whole query groups; with more shards than KV heads, create the "
                         f"cache with num_kv_heads={num_shards} and write jaxattn.sharding.replicate_kv_heads(k, "
                         f"{num_shards}) (and v)")
    for role, shape in zip(roles, shapes):
        if role not in ("pool", "sinks"):
            continue
        spec, expected = _spec(shape), _head_sharding(mesh, role, axes, cache).spec
        if spec != _spec_entries(expected, shape.ndim):
            name = f"the cache's {cache.layout} pages" if role == "pool" else "sinks"
            raise ValueError(f"paged_attention under sharding: {name} must be sharded like q's heads, "
                             f"{expected} for q {PartitionSpec(*q_spec)} (supported: {_SUPPORTED}), "
                             f"got {PartitionSpec(*spec)}")
    return axes


def _typed_shape(x: jax.Array) -> jax.ShapeDtypeStruct:
    """``x``'s shape with the sharding its type carries (explicit mesh axes)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.typeof(x).sharding)


def _spec(x: jax.ShapeDtypeStruct) -> tuple:
    """``x``'s partition spec, one entry per dimension (None: replicated)."""
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        return _spec_entries(sharding.spec, x.ndim)
    if sharding is None or sharding.is_fully_replicated:
        return (None,) * x.ndim
    raise ValueError(f"paged_attention under sharding: expected NamedShardings over a mesh, got {sharding}")


def _spec_entries(spec: PartitionSpec, ndim: int) -> tuple:
    """``spec`` padded to ``ndim`` entries, with ``("tp",)`` written ``"tp"`` and ``()`` None."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(entry[0] if isinstance(entry, tuple) and len(entry) == 1 else entry or None
                 for entry in entries)


def num_head_shards(mesh: Mesh, axes: MeshAxes) -> int:
    """How many pieces the heads are split into over mesh ``axes`` (None: 1)."""
    names = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[name] for name in names)
