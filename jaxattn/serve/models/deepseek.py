"""A DeepSeek-V2-shaped decoder in Flax NNX with multi-head latent attention over packed tokens:
per layer RMSNorm, MLA (queries compressed through ``q_lora_rank`` as in V2 and V3, or not as
in V2-Lite), RMSNorm, and a dense SwiGLU MLP or,
with ``num_experts``, DeepSeek's mixture of experts from layer ``first_k_dense_replace`` on
(``layers.MoE``: routed experts with V2's softmax or V3's sigmoid + bias routing, grouped
routing, a scaling factor, and ungated shared experts). Preset "v2-lite" has a dense MLP the size
of V2-Lite's active experts (6 routed + 2 shared of 1408), "v2-lite-moe" its real experts. RoPE is
in the half-split convention, with YaRN scaling (``rope_scaling``) or not; weights are random unless loaded from a
deepseek_v2 / deepseek_v3 checkpoint by ``jaxattn.serve.models.from_pretrained`` (which reorders the
checkpoints' interleaved RoPE dimensions into this convention).

The layers around attention are Llama's (``jaxattn.serve.models.layers``). Attention is supplied by the
caller, as in ``jaxattn.serve.models.llama``: paged over an ``MLACache`` per layer in serving
(``forward_paged``: absorbed ``mla_paged_attention`` for decode-sized steps, ``mla_prefill`` for
the rest, both on the one ``backend`` given; ``jaxattn.serve.engine.Engine`` serves it), or dense in
tests.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxattn
from jaxattn.kv_cache import LAYOUTS, SlotMapping
from jaxattn.mla import MAX_DECODE_Q_LEN, absorb_query, project_values
from jaxattn.serve.models import layers
from jaxattn.serve.models.layers import rope, rope_frequencies
from jaxattn.serve.models.parallel import expert_parallel_axes, param_shardings, tensor_parallel_rules
from jaxattn.sharding import MeshAxes, tensor_parallel_mesh


@dataclasses.dataclass(frozen=True)
class DeepSeekConfig:
    vocab_size: int
    dim: int
    num_layers: int
    num_q_heads: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    hidden_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dtype: str = "bfloat16"
    tie_embeddings: bool = False
    q_lora_rank: int | None = None   # queries through a compressed rank (V2, V3): q_a_proj, q_a_norm, q_b_proj
    rope_scaling: layers.YarnRopeScaling | None = None
    # DeepSeek's mixture of experts (layers.MoE) from layer first_k_dense_replace on; 0 experts: dense MLPs
    num_experts: int = 0
    num_experts_per_tok: int = 6
    moe_hidden_dim: int = 0
    norm_topk_prob: bool = False
    shared_expert_dim: int = 0       # n_shared_experts x moe_intermediate_size, added ungated
    first_k_dense_replace: int = 0
    routing: layers.MoERouting = layers.MoERouting(gated_shared_expert=False)

    @property
    def scale(self) -> float:
        scale = (self.qk_nope_dim + self.qk_rope_dim) ** -0.5
        return scale * self.rope_scaling.softmax_factor if self.rope_scaling else scale

    def replace(self, **changes) -> "DeepSeekConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, DeepSeekConfig] = {
    "tiny": DeepSeekConfig(vocab_size=512, dim=128, num_layers=2, num_q_heads=4, kv_lora_rank=32, qk_nope_dim=16,
                           qk_rope_dim=16, v_head_dim=16, hidden_dim=256, dtype="float32"),
    # DeepSeek-V2-Lite's attention shapes; use .replace(num_layers=...) to fit a budget.
    "v2-lite": DeepSeekConfig(vocab_size=102400, dim=2048, num_layers=27, num_q_heads=16, kv_lora_rank=512,
                              qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, hidden_dim=8 * 1408),
    # ... and its mixture of experts: 64 routed experts of 1408 (6 per token), 2 shared, layer 0 dense
    # (10944): benchmarks/bench_serving.py's deepseek-v2-lite; "v2-lite" keeps the dense stand-in.
    "v2-lite-moe": DeepSeekConfig(vocab_size=102400, dim=2048, num_layers=27, num_q_heads=16, kv_lora_rank=512,
                                  qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, hidden_dim=10944, num_experts=64,
                                  num_experts_per_tok=6, moe_hidden_dim=1408, shared_expert_dim=2 * 1408,
                                  first_k_dense_replace=1),
}

# attend(layer, q [T, Hq, Dn + Dr] (the whole query: no-RoPE part, then the RoPE'd part), latents [T, R + Dr],
#        w_uk [R, Hq, Dn], w_uv [R, Hq, Dv]) -> [T, Hq, Dv]
AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


class Attention(nnx.Module):
    """Multi-head latent attention around the caller's ``attend``: the queries' projection (through
    ``q_lora_rank`` or not) and ``kv_a_proj``'s latent + RoPE key, RoPE, the latent's norm, the up
    projections absorbed by ``attend``, the o projection. ``jaxattn.serve.models.fusion`` replaces
    the two projections of ``x`` (``q_a_proj`` or ``q_proj``, and ``kv_a_proj``) by one
    ``qkv_a_proj`` (``fused``)."""

    fused: bool = False

    def __init__(self, cfg: DeepSeekConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        heads = cfg.num_q_heads
        # Logical axes as Llama's (heads split, the shared latent replicated), for a future mesh.
        q_dim = heads * (cfg.qk_nope_dim + cfg.qk_rope_dim)
        if cfg.q_lora_rank:
            self.q_a_proj = layers.linear(cfg, cfg.dim, cfg.q_lora_rank, rngs, (None, None))
            self.q_a_norm = layers.rms_norm(cfg, cfg.q_lora_rank, rngs)
            self.q_b_proj = layers.linear(cfg, cfg.q_lora_rank, q_dim, rngs, (None, "heads"))
        else:
            self.q_proj = layers.linear(cfg, cfg.dim, q_dim, rngs, (None, "heads"))
        self.kv_a_proj = layers.linear(cfg, cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_dim, rngs, (None, None))
        self.kv_a_norm = layers.rms_norm(cfg, cfg.kv_lora_rank, rngs)
        self.kv_b_proj = layers.linear(cfg, cfg.kv_lora_rank, heads * (cfg.qk_nope_dim + cfg.v_head_dim), rngs,
                                       (None, "heads"))
        self.o_proj = layers.linear(cfg, heads * cfg.v_head_dim, cfg.dim, rngs, ("heads", None))

    def project(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x: [T, dim] -> (``q_a_proj``'s [T, q_lora_rank] or ``q_proj``'s [T, Hq (Dn + Dr)],
        ``kv_a_proj``'s [T, R + Dr])."""
        cfg = self.cfg
        if self.fused:
            qkv = self.qkv_a_proj(x)
            return qkv[:, :-(cfg.kv_lora_rank + cfg.qk_rope_dim)], qkv[:, -(cfg.kv_lora_rank + cfg.qk_rope_dim):]
        return (self.q_a_proj if cfg.q_lora_rank else self.q_proj)(x), self.kv_a_proj(x)

    def up_projections(self) -> tuple[jax.Array, jax.Array]:
        """``w_uk: [R, Hq, Dn]`` and ``w_uv: [R, Hq, Dv]``, the halves of ``kv_b_proj``."""
        cfg = self.cfg
        w = self.kv_b_proj.kernel[...].reshape(cfg.kv_lora_rank, cfg.num_q_heads, cfg.qk_nope_dim + cfg.v_head_dim)
        return w[..., :cfg.qk_nope_dim], w[..., cfg.qk_nope_dim:]

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Callable) -> jax.Array:
        """x: [T, dim], positions: int32[T] -> [T, dim]."""
        cfg = self.cfg
        q, kv = self.project(x)
        q = self.q_b_proj(self.q_a_norm(q)) if cfg.q_lora_rank else q
        q = q.reshape(x.shape[0], cfg.num_q_heads, -1)
        inv_freq = rope_frequencies(cfg.qk_rope_dim, cfg.rope_theta, cfg.rope_scaling)
        q_rope = rope(q[..., cfg.qk_nope_dim:], positions, inv_freq)
        k_rope = rope(kv[:, None, cfg.kv_lora_rank:], positions, inv_freq)[:, 0]
        if cfg.rope_scaling and cfg.rope_scaling.attention_factor != 1.0:
            q_rope, k_rope = (x * jnp.asarray(cfg.rope_scaling.attention_factor, x.dtype) for x in (q_rope, k_rope))
        # The query stays whole, RoPE written over its last Dr columns (in place in q's buffer).
        q = q.at[..., cfg.qk_nope_dim:].set(q_rope)
        latents = jnp.concatenate([self.kv_a_norm(kv[:, :cfg.kv_lora_rank]), k_rope], axis=-1)
        out = attend(q, latents, *self.up_projections())
        return self.o_proj(out.reshape(x.shape[0], -1))


class DeepSeek(layers.Decoder):
    """Decoder over packed tokens: ``tokens int32[T]`` -> logits ``[T, vocab]`` (float32), the
    shared layers (``jaxattn.serve.models.layers``) around MLA blocks; a ``PagedModel``
    (``jaxattn.serve.models.base``) served through ``mla_paged_attention`` and ``mla_prefill``."""

    attention_ops: tuple[str, ...] = ("mla_paged_attention", "mla_prefill")

    def __init__(self, cfg: DeepSeekConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs, Attention)

    def forward_paged(self, tokens: jax.Array, caches: list[jaxattn.MLACache], meta: jaxattn.AttentionMetadata,
                      slots: SlotMapping | jax.Array, backend: str = "auto",
                      plan: jaxattn.AttentionPlan | None = None) -> tuple[jax.Array, list[jaxattn.MLACache]]:
        """``forward_paged(self, ...)``, the step the engine runs."""
        return forward_paged(self, tokens, caches, meta, slots, backend, plan)

    def init_caches(self, num_pages: int, page_size: int, layout: str = "HND", dtype=None,
                    mesh: Mesh | None = None, axes: MeshAxes = None) -> list[jaxattn.MLACache]:
        """One zeroed latent pool per layer (``dtype`` defaults to the model's). ``layout`` is
        accepted for the engine: with one latent "KV head", HND and NHD are the same pool. With a
        ``mesh``, every device holds the whole pools (MLA is not split: ``jaxattn.serve.models.parallel``)."""
        if layout not in LAYOUTS:
            raise ValueError(f"DeepSeek.init_caches: layout must be one of {LAYOUTS}, got {layout!r}")
        cfg = self.cfg
        sharding = None
        if mesh is not None:
            mesh, axes = tensor_parallel_mesh(mesh, axes)
            tensor_parallel_rules(cfg, mesh, axes, expert_parallel_axes(self) is not None)   # shard_model's checks
            sharding = NamedSharding(mesh, PartitionSpec())
        return [jaxattn.MLACache.create(num_pages, page_size, cfg.kv_lora_rank, cfg.qk_rope_dim,
                                        dtype=dtype or cfg.dtype, sharding=sharding) for _ in range(cfg.num_layers)]

    def param_shardings(self, mesh: Mesh, axes: MeshAxes = None) -> nnx.State:
        """``jaxattn.serve.models.parallel.param_shardings(self, mesh, axes)``: MLPs, experts and the
        vocabulary split, MLA replicated."""
        return param_shardings(self, mesh, axes)


def plan_step(model: DeepSeek, num_tokens: int, caches: list[jaxattn.MLACache], meta: jaxattn.AttentionMetadata,
              backend: str = "auto") -> jaxattn.AttentionPlan:
    """The step's attention plan (``jaxattn.plan``), shared by every layer's call: of
    ``mla_paged_attention`` when every query is at most ``MAX_DECODE_Q_LEN`` tokens
    (``meta.max_q_len``), else of ``mla_prefill``; queries of ``num_tokens`` tokens in the model's
    dtype over caches like ``caches[0]``."""
    cfg = model.cfg
    dtype = jnp.dtype(cfg.dtype)

    def shape(*dims: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(dims, dtype)

    if meta.max_q_len is not None and meta.max_q_len <= MAX_DECODE_Q_LEN:
        return jaxattn.plan(meta, caches[0], shape(num_tokens, cfg.num_q_heads, cfg.kv_lora_rank),
                            op="mla_paged_attention", q_rope=shape(num_tokens, cfg.num_q_heads, cfg.qk_rope_dim),
                            scale=cfg.scale, backend=backend)
    return jaxattn.plan(meta, caches[0], shape(num_tokens, cfg.num_q_heads, cfg.qk_nope_dim + cfg.qk_rope_dim),
                        op="mla_prefill", w_uk=shape(cfg.kv_lora_rank, cfg.num_q_heads, cfg.qk_nope_dim),
                        w_uv=shape(cfg.kv_lora_rank, cfg.num_q_heads, cfg.v_head_dim), scale=cfg.scale,
                        backend=backend)


def forward_paged(model: DeepSeek, tokens: jax.Array, caches: list[jaxattn.MLACache], meta: jaxattn.AttentionMetadata,
                  slots: SlotMapping | jax.Array, backend: str = "auto",
                  plan: jaxattn.AttentionPlan | None = None) -> tuple[jax.Array, list[jaxattn.MLACache]]:
    """One step over packed tokens with paged latents: writes each layer's latents at ``slots``
    and attends on the step's ``plan`` (``plan_step``'s when None: made once, not per layer),
    absorbed (``mla_paged_attention``) or over expanded K/V (``mla_prefill``) as it was made;
    returns (hidden ``[T, dim]``, updated caches)."""
    new_caches = list(caches)
    scale = model.cfg.scale
    if plan is None:
        plan = plan_step(model, tokens.shape[0], caches, meta, backend)

    def attend(layer: int, q: jax.Array, latents: jax.Array, w_uk: jax.Array, w_uv: jax.Array) -> jax.Array:
        cache = new_caches[layer] = new_caches[layer].write(latents, slots)
        if plan.op == "mla_paged_attention":
            nope_dim = w_uk.shape[2]
            out = jaxattn.mla_paged_attention(absorb_query(q[..., :nope_dim], w_uk), q[..., nope_dim:], cache, plan,
                                              scale=scale)
            return project_values(out, w_uv)
        return jaxattn.mla_prefill(q, None, cache, plan, w_uk, w_uv, scale=scale)

    return model.hidden(tokens, meta.positions(tokens.shape[0]), attend), new_caches
