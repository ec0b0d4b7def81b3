"""A Llama-family decoder in Flax NNX (RMSNorm, RoPE, GQA attention, SwiGLU MLP: the shared layers
of ``jaxattn.serve.models.layers``, re-exported here) over packed tokens, with attention supplied by the
caller: paged through ``jaxattn.paged_attention`` in serving (``forward_paged``), or dense in
tests. The config covers Llama 2/3/3.1, Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k
norms), and their mixtures of experts (``num_experts``: Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE; ``layers.MoE``); weights are random unless loaded with ``jaxattn.serve.models.from_pretrained``.

Tensor parallelism (as in vLLM/Megatron; ``jaxattn.serve.models.parallel``, whose functions this
module re-exports): the weights carry Flax partitioning metadata in logical axis names, "heads" (q
projection columns, o projection rows), "kv_heads" (k/v projection columns), "mlp" (gate/up columns,
down rows) and "vocab" (embedding rows, LM head columns), and ``shard_model`` places them over a
mesh axis: column-parallel q/k/v/gate/up, row-parallel o/down (XLA adds one all-reduce after each),
vocab-parallel embedding and LM head. Each device then holds ``Hq / tp`` query heads and ``Hkv /
tp`` KV heads. With more shards than KV heads, the k/v projections stay replicated and the caches
hold ``tp`` KV heads, each original head repeated ``tp / Hkv`` times
(``jaxattn.sharding.replicate_kv_heads``, as vLLM does). The ``Engine`` serves the model with its
q/k/v and gate/up projections fused (``jaxattn.serve.models.fusion``, laid out so that the same
split holds). A mixture of experts splits every expert's hidden columns the same way ("expert_mlp"),
or, after ``enable_expert_parallel`` (vLLM's ``--enable-expert-parallel``), gives each device
``num_experts / tp`` whole experts ("experts"; ``layers.ExpertParallel``), its shared expert split
like the dense MLP."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import jaxattn
from jaxattn.checks import is_positive_int
from jaxattn.kv_cache import SlotMapping, pool_sharding
from jaxattn.serve.models import layers
from jaxattn.serve.models.layers import MLP, Block, Llama3RopeScaling, rope, rope_frequencies
from jaxattn.serve.models.parallel import (enable_expert_parallel, expert_parallel_axes, param_shardings, shard_model,
                                           tensor_parallel_rules)
from jaxattn.serve.models.quantization import quantize
from jaxattn.sharding import MeshAxes, num_head_shards, replicate_kv_heads, tensor_parallel_mesh

__all__ = ["AttendFn", "Attention", "Block", "Llama", "Llama3RopeScaling", "LlamaConfig", "MLP", "PRESETS",
           "enable_expert_parallel", "expert_parallel_axes", "forward_paged", "param_shardings", "plan_step",
           "random_model", "rope", "rope_frequencies", "shard_model", "tensor_parallel_rules"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_dim: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    dtype: str = "bfloat16"
    rope_scaling: Llama3RopeScaling | None = None
    qkv_bias: bool = False           # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False            # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    tie_embeddings: bool = False     # logits use the embedding table; no separate lm_head
    sliding_window: int | None = None  # every layer's keys ``i-W+1 .. i`` (Mistral)
    # a mixture of experts in every layer (layers.MoE; Mixtral, Qwen2-MoE, Qwen3-MoE); 0: the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_hidden_dim: int = 0          # each expert's hidden size
    norm_topk_prob: bool = True      # the chosen experts' weights renormalized to sum to 1
    shared_expert_dim: int = 0       # a sigmoid-gated shared expert's hidden size (Qwen2-MoE); 0: none
    routing: layers.MoERouting = layers.MoERouting()

    def __post_init__(self):
        for name in ("vocab_size", "dim", "num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            if not is_positive_int(getattr(self, name)):
                raise ValueError(f"LlamaConfig: {name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=512, dim=128, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32,
                        hidden_dim=256, dtype="float32"),
    "small": LlamaConfig(vocab_size=32000, dim=2048, num_layers=8, num_q_heads=16, num_kv_heads=4, head_dim=128,
                         hidden_dim=5632),
    # Llama-3-8B layer shapes; use .replace(num_layers=...) to fit a time or memory budget.
    "llama3-8b": LlamaConfig(vocab_size=128256, dim=4096, num_layers=32, num_q_heads=32, num_kv_heads=8,
                             head_dim=128, hidden_dim=14336),
    "llama3-70b": LlamaConfig(vocab_size=128256, dim=8192, num_layers=80, num_q_heads=64, num_kv_heads=8,
                              head_dim=128, hidden_dim=28672),
    # Llama-3.2-1B's shapes (Llama 3's vocabulary): a draft model for the 8B and 70B shapes
    "llama3.2-1b": LlamaConfig(vocab_size=128256, dim=2048, num_layers=16, num_q_heads=32, num_kv_heads=8,
                               head_dim=64, hidden_dim=8192, tie_embeddings=True),
    # mixtures of experts: Qwen1.5-MoE-A2.7B (Qwen2-MoE: 60 experts of 1408, 4 per token, a gated
    # shared expert of 5632), Qwen3-30B-A3B (128 experts of 768, 8 per token) and Mixtral-8x7B's shapes
    "qwen1.5-moe-a2.7b": LlamaConfig(vocab_size=151936, dim=2048, num_layers=24, num_q_heads=16, num_kv_heads=16,
                                     head_dim=128, hidden_dim=5632, rope_theta=1e6, norm_eps=1e-6, qkv_bias=True,
                                     num_experts=60, num_experts_per_tok=4, moe_hidden_dim=1408,
                                     norm_topk_prob=False, shared_expert_dim=5632),
    "qwen3-30b-a3b": LlamaConfig(vocab_size=151936, dim=2048, num_layers=48, num_q_heads=32, num_kv_heads=4,
                                 head_dim=128, hidden_dim=6144, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
                                 num_experts=128, num_experts_per_tok=8, moe_hidden_dim=768),
    "mixtral-8x7b": LlamaConfig(vocab_size=32000, dim=4096, num_layers=32, num_q_heads=32, num_kv_heads=8,
                                head_dim=128, hidden_dim=14336, rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
                                moe_hidden_dim=14336),
}

# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


class Attention(nnx.Module):
    """GQA attention around the caller's ``attend``: q/k/v projections (with ``qkv_bias``), Qwen3's
    q/k norms, RoPE, the o projection. ``jaxattn.serve.models.fusion`` replaces ``q_proj``,
    ``k_proj`` and ``v_proj`` by one ``qkv_proj`` (``fused``) whose columns hold, per KV head,
    its G = Hq / Hkv query heads, its key head and its value head."""

    fused: bool = False

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.q_proj = layers.linear(cfg, cfg.dim, cfg.num_q_heads * cfg.head_dim, rngs, (None, "heads"),
                                    cfg.qkv_bias)
        self.k_proj = layers.linear(cfg, cfg.dim, cfg.num_kv_heads * cfg.head_dim, rngs, (None, "kv_heads"),
                                    cfg.qkv_bias)
        self.v_proj = layers.linear(cfg, cfg.dim, cfg.num_kv_heads * cfg.head_dim, rngs, (None, "kv_heads"),
                                    cfg.qkv_bias)
        self.o_proj = layers.linear(cfg, cfg.num_q_heads * cfg.head_dim, cfg.dim, rngs, ("heads", None))
        if cfg.qk_norm:
            self.q_norm = layers.rms_norm(cfg, cfg.head_dim, rngs)
            self.k_norm = layers.rms_norm(cfg, cfg.head_dim, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Callable) -> jax.Array:
        """x: [T, dim], positions: int32[T] -> [T, dim]."""
        cfg = self.cfg
        q, k, v = self.project(x)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
        return self.o_proj(attend(q, k, v).reshape(x.shape[0], -1))

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [T, dim] -> q [T, Hq, D], k and v [T, Hkv, D] (before norms and RoPE)."""
        cfg, tokens = self.cfg, x.shape[0]
        if not self.fused:
            return (self.q_proj(x).reshape(tokens, cfg.num_q_heads, cfg.head_dim),
                    self.k_proj(x).reshape(tokens, cfg.num_kv_heads, cfg.head_dim),
                    self.v_proj(x).reshape(tokens, cfg.num_kv_heads, cfg.head_dim))
        group = cfg.num_q_heads // cfg.num_kv_heads
        qkv = self.qkv_proj(x).reshape(tokens, cfg.num_kv_heads, group + 2, cfg.head_dim)
        return qkv[:, :, :group].reshape(tokens, cfg.num_q_heads, cfg.head_dim), qkv[:, :, group], qkv[:, :, group + 1]


class Llama(layers.Decoder):
    """Decoder over packed tokens: ``tokens int32[T]`` -> logits ``[T, vocab]`` (float32), the
    shared layers (``jaxattn.serve.models.layers``) around GQA attention; a ``PagedModel``
    (``jaxattn.serve.models.base``) served through ``paged_attention``."""

    attention_ops: tuple[str, ...] = ("paged_attention",)

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs, Attention)

    def forward_paged(self, tokens: jax.Array, caches: list[jaxattn.KVCache], meta: jaxattn.AttentionMetadata,
                      slots: SlotMapping | jax.Array, backend: str = "auto",
                      plan: jaxattn.AttentionPlan | None = None) -> tuple[jax.Array, list[jaxattn.KVCache]]:
        """``forward_paged(self, ...)``, the step the engine runs."""
        return forward_paged(self, tokens, caches, meta, slots, backend, plan)

    def init_caches(self, num_pages: int, page_size: int, layout: str = "HND", dtype=None, mesh: Mesh | None = None,
                    axes: MeshAxes = None) -> list[jaxattn.KVCache]:
        """One zeroed KV cache per layer (``dtype`` defaults to the model's). With a ``mesh``, the
        pools are split by KV heads over ``axes`` (default: all the mesh's) as ``shard_model``
        splits the weights, with ``max(Hkv, tp)`` KV heads (module docstring)."""
        cfg = self.cfg
        num_kv_heads, sharding = cfg.num_kv_heads, None
        if mesh is not None:
            mesh, axes = tensor_parallel_mesh(mesh, axes)
            tensor_parallel_rules(cfg, mesh, axes, expert_parallel_axes(self) is not None)   # shard_model's checks
            num_kv_heads = max(num_kv_heads, num_head_shards(mesh, axes))
            sharding = pool_sharding(mesh, axes, layout)
        return [jaxattn.KVCache.create(num_pages, page_size, num_kv_heads, cfg.head_dim, dtype=dtype or cfg.dtype,
                                       layout=layout, sharding=sharding) for _ in range(cfg.num_layers)]

    def param_shardings(self, mesh: Mesh, axes: MeshAxes = None) -> nnx.State:
        """``param_shardings(self, mesh, axes)`` (module function)."""
        return param_shardings(self, mesh, axes)


def random_model(preset: str, *, layers: int | None = None, dtype: str | None = None,
                 mesh: Mesh | None = None, expert_parallel: bool = False, quantization: str | None = None) -> Llama:
    """A random-weight Llama of ``PRESETS[preset]``'s shapes (with ``layers`` layers and weights
    of ``dtype`` when given), its linears quantized with ``quantization`` ("fp8":
    ``jaxattn.serve.models.quantization.quantize``), split over ``mesh`` by ``shard_model`` when given
    (its experts whole per device with ``expert_parallel``)."""
    cfg = PRESETS[preset]
    if layers is not None:
        cfg = cfg.replace(num_layers=layers)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype)
    model = Llama(cfg, nnx.Rngs(0))
    if quantization is not None:
        quantize(model, quantization)
    return shard_model(model, mesh, expert_parallel=expert_parallel) if mesh is not None else model


def plan_step(model: Llama, num_tokens: int, caches: list[jaxattn.KVCache], meta: jaxattn.AttentionMetadata,
              backend: str = "auto") -> jaxattn.AttentionPlan:
    """The step's attention plan (``jaxattn.plan``), shared by every layer's ``paged_attention``:
    queries ``[num_tokens, Hq, D]`` in the model's dtype over caches like ``caches[0]``."""
    cfg = model.cfg
    q = jax.ShapeDtypeStruct((num_tokens, cfg.num_q_heads, cfg.head_dim), jnp.dtype(cfg.dtype))
    return jaxattn.plan(meta, caches[0], q, sliding_window=cfg.sliding_window, backend=backend)


def forward_paged(model: Llama, tokens: jax.Array, caches: list[jaxattn.KVCache], meta: jaxattn.AttentionMetadata,
                  slots: SlotMapping | jax.Array, backend: str = "auto",
                  plan: jaxattn.AttentionPlan | None = None) -> tuple[jax.Array, list[jaxattn.KVCache]]:
    """One step over packed tokens with paged KV: writes each layer's K/V at ``slots``, attends
    with ``jaxattn.paged_attention`` on the step's ``plan`` (``plan_step``'s when None: made once,
    not per layer); returns (hidden ``[T, dim]``, updated caches)."""
    new_caches = list(caches)
    if plan is None:
        plan = plan_step(model, tokens.shape[0], caches, meta, backend)

    def attend(layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        num_kv_heads = new_caches[layer].num_kv_heads     # more than the model's: KV heads replicated
        new_caches[layer] = new_caches[layer].write(replicate_kv_heads(k, num_kv_heads),
                                                    replicate_kv_heads(v, num_kv_heads), slots)
        return jaxattn.paged_attention(q, new_caches[layer], plan)

    return model.hidden(tokens, meta.positions(tokens.shape[0]), attend), new_caches
