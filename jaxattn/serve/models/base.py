"""What ``jaxattn.serve.engine.Engine`` needs from a model: ``PagedModel``.

A served model is an ``nnx.Module`` (the engine splits it into its structure, closed over by the
jitted step, and its weights) that creates its paged caches, runs one step over packed tokens on
them, and maps hidden states to logits. ``attention_ops`` names the ``jaxattn`` ops its step
calls (from ``jaxattn.backends.OPS``): the engine's ``backend`` must serve every one of them.
``Llama`` and ``DeepSeek`` implement it (``jaxattn.serve.models.llama``, ``jaxattn.serve.models.deepseek``).
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import jax
from flax import nnx
from jax.sharding import Mesh

import jaxattn
from jaxattn.kv_cache import SlotMapping

Cache = jaxattn.KVCache | jaxattn.MLACache


@runtime_checkable
class ModelConfig(Protocol):
    """The config fields the engine reads."""

    @property
    def vocab_size(self) -> int:
        """Token ids of a prompt are in ``[0, vocab_size)``; logits have ``vocab_size`` columns."""
        ...


@runtime_checkable
class PagedModel(Protocol):
    """A decoder the engine can serve (over packed tokens: T tokens of up to B sequences)."""

    cfg: ModelConfig
    attention_ops: tuple[str, ...]   # e.g. ("paged_attention",); names from jaxattn.backends.OPS

    def init_caches(self, num_pages: int, page_size: int, layout: str = "HND", dtype=None,
                    mesh: Mesh | None = None) -> list[Cache]:
        """One zeroed cache per layer of ``num_pages`` pages of ``page_size`` tokens (``layout``
        "HND" or "NHD"; ``dtype`` None: the model's); with a ``mesh``, split for tensor parallelism
        over all its devices as ``param_shardings`` splits the weights (ValueError if the model
        cannot be split)."""
        ...

    def forward_paged(self, tokens: jax.Array, caches: list[Cache], meta: jaxattn.AttentionMetadata,
                      slots: SlotMapping | jax.Array, backend: str = "auto",
                      plan: jaxattn.AttentionPlan | None = None) -> tuple[jax.Array, list[Cache]]:
        """One jittable step: ``tokens int32[T]`` (packed as ``meta`` says, at positions
        ``meta.positions(T)``) write their K/V (or latents) at ``slots`` (``PageTable.slot_mapping``'s
        ``SlotMapping``, or int32[T]; -1: padding) of every layer's cache and attend through
        ``attention_ops`` with ``backend``, every layer on the step's one ``AttentionPlan``
        (``plan``, or the model's ``plan_step`` made once when None); returns (final hidden states
        ``[T, dim]``, the updated caches)."""
        ...

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Hidden states ``[N, dim]`` -> float32 logits ``[N, cfg.vocab_size]``."""
        ...

    def param_shardings(self, mesh: Mesh) -> nnx.State:
        """The ``NamedSharding`` of each of ``nnx.state(model)``'s weights for tensor parallelism
        over all of ``mesh``'s devices; ValueError if the model cannot be split."""
        ...


def page_bytes(model: PagedModel, page_size: int, layout: str = "HND", dtype=None, mesh: Mesh | None = None) -> int:
    """Bytes one page of every layer's cache takes on one device (with a ``mesh``, the pools'
    shard of it), from the shapes ``model.init_caches`` gives (no memory is allocated)."""
    def device_bytes(num_pages: int) -> int:
        caches = jax.eval_shape(lambda: model.init_caches(num_pages, page_size, layout, dtype, mesh=mesh))
        total = 0
        for leaf in jax.tree.leaves(caches):
            sharding = getattr(leaf, "sharding", None)
            total += math.prod(sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape) \
                * leaf.dtype.itemsize
        return total

    return device_bytes(3) - device_bytes(2)
