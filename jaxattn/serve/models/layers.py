"""The layers the reference decoders share (``Llama``, ``DeepSeek``): linear and RMSNorm helpers
with Flax logical axes, RoPE, the SwiGLU MLP and its top-k mixture of experts, the pre-norm
residual block around a model's own attention module, and the embedding / LM head ends of the stack.

A model is a ``Decoder`` built with its own attention module: the stack's attributes ``embed``,
``layers``, ``norm`` and (without tied embeddings) ``lm_head`` give its weights the same paths
whatever the attention."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxattn.serve.models.experts import GEMMS, Fp8Stack, routed_experts

Axes = tuple[str | None, ...]


class DecoderConfig(Protocol):
    """The config fields these layers read (``LlamaConfig`` and ``DeepSeekConfig`` have them)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_dim(self) -> int: ...
    @property
    def norm_eps(self) -> float: ...
    @property
    def dtype(self) -> str: ...
    @property
    def tie_embeddings(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's rope scaling: long wavelengths are slowed by ``factor``, short ones kept, and
    the band between ``original_max_position_embeddings / high_freq_factor`` and ``... /
    low_freq_factor`` interpolated smoothly."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (DeepSeek-V2/V3's rope scaling, as transformers computes it): frequencies blended
    between interpolated (``/ factor``) and kept, by a linear ramp over the dimensions whose
    rotations over ``original_max_position_embeddings`` positions lie between ``beta_slow`` and
    ``beta_fast``; rotated parts scaled by ``attention_factor`` (``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)``, mscale(s, m) = 0.1 m ln s + 1); and DeepSeek's softmax scale
    multiplied by ``mscale(factor, mscale_all_dim) ** 2`` (``softmax_factor``)."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @staticmethod
    def _mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    @property
    def attention_factor(self) -> float:
        if self.mscale and self.mscale_all_dim:
            return self._mscale(self.factor, self.mscale) / self._mscale(self.factor, self.mscale_all_dim)
        return self._mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        return self._mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def frequencies(self, head_dim: int, theta: float) -> np.ndarray:
        """float64[head_dim // 2]: the blended inverse frequencies."""
        def dimension(rotations: float) -> float:
            return head_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / ((high - low) or 0.001), 0, 1)
        kept = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        return kept / self.factor * ramp + kept * (1 - ramp)


def rope_frequencies(head_dim: int, theta: float, scaling: Llama3RopeScaling | YarnRopeScaling | None = None
                     ) -> np.ndarray:
    """Rotary inverse frequencies float32[head_dim // 2] (in float64 before the cast, so they
    are the correctly rounded values)."""
    if isinstance(scaling, YarnRopeScaling):
        return scaling.frequencies(head_dim, theta).astype(np.float32)
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is not None:
        wavelen = 2 * np.pi / inv_freq
        context = scaling.original_max_position_embeddings
        # 0 at the low-frequency edge (wavelen = context / low_freq_factor), 1 at the high one
        smooth = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smooth = np.clip(smooth, 0.0, 1.0)
        inv_freq = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return inv_freq.astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding, half-split convention (dimension ``j`` pairs with ``j + D/2``, as in
    Hugging Face's ``rotate_half``). x: [T, H, D], positions: int32[T], inv_freq: [D/2]."""
    half = x.shape[-1] // 2
    angle = positions[:, None, None].astype(jnp.float32) * jnp.asarray(inv_freq)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def partitioned(init: Callable, axes: Axes) -> Callable:
    """``init`` annotated with logical ``axes``; placed by ``shard_model``, not at creation (Flax's
    eager sharding would need a mesh here)."""
    return nnx.with_partitioning(init, axes, eager_sharding=False)


def linear(cfg: DecoderConfig, fan_in: int, fan_out: int, rngs: nnx.Rngs, axes: Axes, bias: bool = False) -> nnx.Linear:
    """A linear layer whose kernel ``[fan_in, fan_out]`` is split on the logical ``axes`` (and its
    bias like the output columns)."""
    return nnx.Linear(fan_in, fan_out, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs,
                      kernel_init=partitioned(nnx.initializers.normal(fan_in ** -0.5), axes),
                      bias_init=partitioned(nnx.initializers.zeros_init(), axes[1:]))


def rms_norm(cfg: DecoderConfig, size: int, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(size, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)


def embedding(cfg: DecoderConfig, rngs: nnx.Rngs) -> nnx.Embed:
    """The token embedding ``[vocab, dim]``, split by vocabulary rows."""
    return nnx.Embed(cfg.vocab_size, cfg.dim, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs,
                     embedding_init=partitioned(nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0),
                                                ("vocab", None)))


def lm_head(cfg: DecoderConfig, rngs: nnx.Rngs) -> nnx.Linear:
    """The untied LM head ``[dim, vocab]``, split by vocabulary columns."""
    return linear(cfg, cfg.dim, cfg.vocab_size, rngs, (None, "vocab"))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, hidden columns (``hidden_dim``, default the
    config's) split on the logical axis "mlp". ``jaxattn.serve.models.fusion`` replaces
    ``gate_proj`` and ``up_proj`` by one ``gate_up_proj [dim, 2 * hidden]`` of ``fused_shards``
    groups (each: the gate columns, then the up columns, of ``hidden / fused_shards`` units)."""

    fused_shards: int = 0     # 0: gate_proj and up_proj apart

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs, hidden_dim: int | None = None):
        hidden_dim = hidden_dim or cfg.hidden_dim
        self.gate_proj = linear(cfg, cfg.dim, hidden_dim, rngs, (None, "mlp"))
        self.up_proj = linear(cfg, cfg.dim, hidden_dim, rngs, (None, "mlp"))
        self.down_proj = linear(cfg, hidden_dim, cfg.dim, rngs, ("mlp", None))

    def __call__(self, x: jax.Array) -> jax.Array:
        if not self.fused_shards:
            return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up_proj(x).reshape(*x.shape[:-1], self.fused_shards, 2, -1)
        hidden = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
        return self.down_proj(hidden.reshape(*x.shape[:-1], -1))


class MoEConfig(Protocol):
    """The config fields ``MoE`` reads besides ``DecoderConfig``'s (``MoERouting``'s too)."""

    @property
    def num_experts(self) -> int: ...
    @property
    def num_experts_per_tok(self) -> int: ...
    @property
    def moe_hidden_dim(self) -> int: ...
    @property
    def norm_topk_prob(self) -> bool: ...
    @property
    def shared_expert_dim(self) -> int: ...
    @property
    def routing(self) -> "MoERouting": ...


@dataclasses.dataclass(frozen=True)
class MoERouting:
    """How a router picks experts beyond softmax top-k (DeepSeek's options; the defaults are
    Mixtral's and Qwen's).

    Attributes:
      scoring: "softmax" over the router's logits, or "sigmoid" of each (DeepSeek-V3).
      n_group, topk_group: the experts in ``n_group`` equal groups, a token's experts chosen
        within its ``topk_group`` best groups (a group's score: its best expert's, or with
        ``sigmoid`` the sum of its best two); 1, 1: no groups.
      score_bias: add the router's ``e_score_correction_bias`` to the scores for choosing only
        (DeepSeek-V3's ``noaux_tc``), not to the weights.
      routed_scaling_factor: the chosen experts' weights are multiplied by it (after
        ``norm_topk_prob``'s renormalization).
      gated_shared_expert: the shared expert is scaled by ``sigmoid(shared_expert_gate(x))``
        (Qwen2-MoE); else added as is (DeepSeek's ``shared_experts``).
    """

    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    score_bias: bool = False
    routed_scaling_factor: float = 1.0
    gated_shared_expert: bool = True

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoERouting: scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if not (isinstance(self.n_group, int) and isinstance(self.topk_group, int)
                and 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"MoERouting: n_group and topk_group must be ints with 1 <= topk_group <= n_group, got "
                             f"{self.n_group!r} and {self.topk_group!r}")


# the logical axes of a MoE's stacked expert weights
EXPERT_AXES = {"gate_proj": ("experts", None, "expert_mlp"), "up_proj": ("experts", None, "expert_mlp"),
               "down_proj": ("experts", "expert_mlp", None)}


class MoE(nnx.Module):
    """A top-k mixture of SwiGLU experts (Mixtral's, Qwen2-MoE's, Qwen3-MoE's, DeepSeek-V2's and
    V3's): a linear ``router`` scores the ``num_experts`` experts (in float32; ``cfg.routing``,
    ``MoERouting``: softmax or sigmoid, groups, a score bias, a scaling factor), each token goes
    to its ``num_experts_per_tok`` best with their scores as weights (renormalized to sum to 1
    with ``norm_topk_prob``, cast to the model's dtype), and with ``shared_expert_dim`` a
    ``shared_expert`` MLP every token takes (scaled by ``sigmoid(shared_expert_gate(x))`` in
    Qwen2-MoE). The experts' weights are stacked, ``gate_proj`` / ``up_proj`` ``[E, dim, F]``
    and ``down_proj`` ``[E, F, dim]``, on the logical axes "experts" (E) and "expert_mlp" (F):
    tensor parallelism splits every expert's F columns, expert parallelism (``expert_parallel``,
    set by ``jaxattn.serve.models.parallel.enable_expert_parallel``) gives each device whole experts.
    ``jaxattn.serve.models.quantization.quantize`` makes each stack an ``Fp8Experts`` (FP8 values and
    scales, the same logical axes).

    The routed experts run as ``jaxattn.serve.models.experts.routed_experts`` with the strategy
    ``gemm`` ("auto": chosen per step shape from measurements; ``set_expert_gemm``).
    ``jaxattn.serve.models.fusion`` may move the shared expert into the stacks as their last
    ``fused_shared_experts`` experts (its hidden units in groups of ``moe_hidden_dim``), which
    every token then takes with weight 1 (Qwen2-MoE: its gate's sigmoid)."""

    expert_parallel: "ExpertParallel | None" = None
    tensor_parallel: "ExpertTensorParallel | None" = None
    gemm: str = "auto"
    fused_shared_experts: int = 0     # the stacks' last experts that are the shared expert's (fusion)

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        experts, hidden = cfg.num_experts, cfg.moe_hidden_dim
        if not 1 <= cfg.num_experts_per_tok <= experts:
            raise ValueError(f"MoE: num_experts_per_tok must be in [1, num_experts={experts}], got "
                             f"{cfg.num_experts_per_tok}")
        # a group's score under sigmoid scoring is the sum of its best two experts
        least = 2 if cfg.routing.scoring == "sigmoid" and cfg.routing.n_group > 1 else 1
        if experts % cfg.routing.n_group or experts // cfg.routing.n_group < least:
            raise ValueError(f"MoE: num_experts ({experts}) must split into routing.n_group={cfg.routing.n_group} "
                             f"equal groups of at least {least} experts")
        if hidden < 1:
            raise ValueError(f"MoE: moe_hidden_dim must be >= 1, got {hidden}")
        self.router = linear(cfg, cfg.dim, experts, rngs, (None, None))
        if cfg.routing.score_bias:
            self.score_bias = nnx.Param(jnp.zeros((experts,), jnp.float32))
        init = nnx.initializers.normal(cfg.dim ** -0.5)
        for name, shape in (("gate_proj", (experts, cfg.dim, hidden)), ("up_proj", (experts, cfg.dim, hidden)),
                            ("down_proj", (experts, hidden, cfg.dim))):
            setattr(self, name, nnx.Param(partitioned(init, EXPERT_AXES[name])(rngs.params(), shape, cfg.dtype)))
        if cfg.shared_expert_dim:
            self.shared_expert = MLP(cfg, rngs, cfg.shared_expert_dim)
            if cfg.routing.gated_shared_expert:
                self.shared_expert_gate = linear(cfg, cfg.dim, 1, rngs, (None, None))

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each token's experts and their weights: ``(weights float32[T, k], chosen int32[T, k])``."""
        cfg, routing = self.cfg, self.cfg.routing
        k, experts = cfg.num_experts_per_tok, cfg.num_experts
        logits = x.astype(jnp.float32) @ self.router.kernel[...].astype(jnp.float32)
        scores = jax.nn.softmax(logits, axis=-1) if routing.scoring == "softmax" else jax.nn.sigmoid(logits)
        choice = scores + self.score_bias[...] if routing.score_bias else scores
        if routing.n_group > 1:
            grouped = choice.reshape(choice.shape[0], routing.n_group, experts // routing.n_group)
            group_score = (jnp.max(grouped, axis=-1) if routing.scoring == "softmax"
                           else jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1))
            kept = jnp.sum(jax.nn.one_hot(jax.lax.top_k(group_score, routing.topk_group)[1], routing.n_group), axis=1)
            masked = 0.0 if routing.scoring == "softmax" else -jnp.inf
            choice = jnp.where(jnp.repeat(kept > 0, experts // routing.n_group, axis=1), choice, masked)
        chosen = jax.lax.top_k(choice, k)[1]
        weights = jnp.take_along_axis(scores, chosen, axis=1)
        if cfg.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * routing.routed_scaling_factor, chosen

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        weights, chosen = self.route(x)
        weights = weights.astype(x.dtype)
        gated = cfg.shared_expert_dim and cfg.routing.gated_shared_expert
        if self.fused_shared_experts:       # every token also takes the shared expert's groups
            tokens, shared = x.shape[0], self.fused_shared_experts
            scale = jax.nn.sigmoid(self.shared_expert_gate(x)) if gated else jnp.ones((tokens, 1), x.dtype)
            weights = jnp.concatenate([weights, jnp.broadcast_to(scale.astype(x.dtype), (tokens, shared))], axis=1)
            groups = cfg.num_experts + jnp.arange(shared, dtype=chosen.dtype)
            chosen = jnp.concatenate([chosen, jnp.broadcast_to(groups, (tokens, shared))], axis=1)
        # a stack quantized by jaxattn.serve.models.quantization (Fp8Experts) gives its values and scales
        experts = tuple(w.stack() if isinstance(w, nnx.Module) else w[...]
                        for w in (self.gate_proj, self.up_proj, self.down_proj))
        split = self.expert_parallel or self.tensor_parallel
        if split is None:
            y = routed_experts(x, weights, chosen, *experts, gemm=self.gemm)
        else:
            y = split(x, weights, chosen, *experts, gemm=self.gemm)
        if cfg.shared_expert_dim and not self.fused_shared_experts:
            shared = self.shared_expert(x)
            if gated:
                shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared
        return y


def set_expert_gemm(model: nnx.Module, gemm: str) -> nnx.Module:
    """Makes every ``MoE`` in ``model`` compute its routed experts with ``gemm``: "auto" (chosen per
    step shape, ``experts.choose_gemm``) or one of ``experts.GEMMS``. A static attribute: steps
    compiled afterwards use it. ValueError for another name or a model without experts."""
    if gemm != "auto" and gemm not in GEMMS:
        raise ValueError(f"set_expert_gemm: gemm must be 'auto' or one of {GEMMS}, got {gemm!r}")
    moes = [module for _, module in nnx.iter_graph(model) if isinstance(module, MoE)]
    if not moes:
        raise ValueError("set_expert_gemm: the model has no mixture of experts")
    for moe in moes:
        moe.gemm = gemm
    return model


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """A ``MoE``'s experts split over the mesh ``axes`` (whole experts per device, the stacked
    weights sharded on their first axis): with the tokens replicated, as tensor-parallel attention
    leaves them, each device runs its own experts on the copies routed to them and one all-reduce
    (a ``psum``) sums the devices' outputs, so no token moves (vLLM's expert parallelism within a
    tensor-parallel group; an all-to-all would pay once the tokens are split over devices)."""
    mesh: Mesh
    axes: str | tuple[str, ...]

    def __call__(self, x: jax.Array, weights: jax.Array, chosen: jax.Array, *experts, gemm: str = "auto") -> jax.Array:
        def local(x, weights, chosen, *experts):
            first = self.first(experts[0])
            return jax.lax.psum(routed_experts(x, weights, chosen, *experts, first=first, gemm=gemm), self.axes)

        specs = tuple(self.spec(name, stack) for name, stack in zip(EXPERT_AXES, experts))
        return jax.shard_map(local, mesh=self.mesh, in_specs=(PartitionSpec(),) * 3 + specs,
                             out_specs=PartitionSpec())(x, weights, chosen, *experts)

    def first(self, stack) -> jax.Array:
        """This device's first expert, inside the ``shard_map`` (``stack``: its part of a stack)."""
        return jax.lax.axis_index(self.axes) * stack.shape[0]

    def spec(self, name: str, stack) -> PartitionSpec:
        """The partition of the stack ``name``, and of each array of an ``Fp8Stack``: by experts."""
        return PartitionSpec(self.axes)


@dataclasses.dataclass(frozen=True)
class ExpertTensorParallel(ExpertParallel):
    """A ``MoE``'s experts split by their hidden units over the mesh ``axes`` (tensor parallelism:
    each device holds ``F / n`` of every expert's gate and up columns and down rows, and their
    scales' parts, as ``parallel.tensor_parallel_rules`` places the "expert_mlp" axis): with the
    tokens replicated, each device runs every routed copy through its slices inside ``shard_map``
    and one all-reduce (a ``psum``) adds the partial outputs (SwiGLU acts per hidden unit, so the
    slices' outputs sum to the whole). Under plain ``jit`` XLA's partitioner could not split the
    Triton grouped GEMM, a custom call: it would gather every expert's weights each step."""

    def first(self, stack) -> int:
        """Every device holds a part of every expert."""
        return 0

    def spec(self, name: str, stack):
        """The partition of the stack ``name`` (``EXPERT_AXES``): its "expert_mlp" dimension over
        ``axes``; an ``Fp8Stack``'s values in their layout and its scales (per expert, per output
        channel, or blocks) alike."""
        def split(*logical: str | None) -> PartitionSpec:
            return PartitionSpec(*(self.axes if axis == "expert_mlp" else None for axis in logical))

        experts_axis, rows, cols = EXPERT_AXES[name]
        if not isinstance(stack, Fp8Stack):
            return split(experts_axis, rows, cols)
        values = split(experts_axis, rows, cols) if stack.layout == "ekn" else split(experts_axis, cols, rows)
        scale = {1: split(experts_axis), 2: split(experts_axis, cols)}.get(stack.scale.ndim,
                                                                          split(experts_axis, rows, cols))
        return Fp8Stack(values, scale, stack.block, stack.layout)


class Block(nnx.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (an ``MoE`` with
    ``moe``). ``attention``
    builds the model's attention module from ``(cfg, rngs)``; it is called as
    ``attn(x [T, dim], positions int32[T], attend) -> [T, dim]``."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs, attention: Callable[[Any, nnx.Rngs], nnx.Module],
                 moe: bool = False):
        self.attn_norm = rms_norm(cfg, cfg.dim, rngs)
        self.attn = attention(cfg, rngs)
        self.mlp_norm = rms_norm(cfg, cfg.dim, rngs)
        self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Callable) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, attend)
        return x + self.mlp(self.mlp_norm(x))


def blocks(cfg: DecoderConfig, rngs: nnx.Rngs, attention: Callable[[Any, nnx.Rngs], nnx.Module]) -> nnx.List:
    """``cfg.num_layers`` blocks around ``attention`` modules; with ``num_experts``, their MLPs
    are ``MoE``s from layer ``first_k_dense_replace`` on (DeepSeek's; 0 elsewhere)."""
    experts, dense = getattr(cfg, "num_experts", 0), getattr(cfg, "first_k_dense_replace", 0)
    return nnx.List([Block(cfg, rngs, attention, bool(experts) and i >= dense) for i in range(cfg.num_layers)])


class Decoder(nnx.Module):
    """The stack every reference decoder shares: embedding, ``cfg.num_layers`` pre-norm blocks
    around the model's ``attention`` module, final RMSNorm, LM head (the embedding when tied)."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs, attention: Callable[[Any, nnx.Rngs], nnx.Module]):
        self.cfg = cfg
        self.embed = embedding(cfg, rngs)
        self.layers = blocks(cfg, rngs, attention)
        self.norm = rms_norm(cfg, cfg.dim, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = lm_head(cfg, rngs)

    def hidden(self, tokens: jax.Array, positions: jax.Array, attend: Callable) -> jax.Array:
        """Final normalized hidden states ``[T, dim]`` of ``tokens int32[T]`` at ``positions
        int32[T]``; layer ``i``'s attention module calls ``attend(i, ...)``."""
        x = self.embed(tokens)
        for i, block in enumerate(self.layers):
            x = block(x, positions, functools.partial(attend, i))
        return self.norm(x)

    def logits(self, hidden_states: jax.Array) -> jax.Array:
        """``[T, dim]`` -> float32 ``[T, vocab]`` through the LM head (the embedding when tied)."""
        head = self.embed.attend if self.cfg.tie_embeddings else self.lm_head
        return head(hidden_states).astype(jnp.float32)
