"""A Llama-style decoder in Flax NNX (RMSNorm, RoPE, GQA attention, SwiGLU MLP) over packed
tokens, with attention supplied by the caller: paged through ``jaxattn.paged_attention`` in
serving (``forward_paged``), or dense in tests. Weights are random; nothing is downloaded."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import jaxattn


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
}

# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttendFn = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (half-split convention). x: [T, H, D], positions: int32[T]."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None, None].astype(jnp.float32) * freq
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _linear(cfg: LlamaConfig, fan_in: int, fan_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(fan_in, fan_out, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(fan_in ** -0.5))


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.qkv = _linear(cfg, cfg.dim, (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, rngs)
        self.out = _linear(cfg, cfg.num_q_heads * cfg.head_dim, cfg.dim, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Callable) -> jax.Array:
        cfg = self.cfg
        qkv = self.qkv(x).reshape(x.shape[0], -1, cfg.head_dim)
        q, k, v = jnp.split(qkv, [cfg.num_q_heads, cfg.num_q_heads + cfg.num_kv_heads], axis=1)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        return self.out(attend(q, k, v).reshape(x.shape[0], -1))


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.gate_up = _linear(cfg, cfg.dim, 2 * cfg.hidden_dim, rngs)
        self.down = _linear(cfg, cfg.hidden_dim, cfg.dim, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        return self.down(jax.nn.silu(gate) * up)


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        norm = dict(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(cfg.dim, **norm)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.dim, **norm)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, attend: Callable) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, attend)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """Decoder over packed tokens: ``tokens int32[T]`` -> logits ``[T, vocab]`` (float32)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.dim, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.dim, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.dtype, rngs=rngs)
        self.lm_head = _linear(cfg, cfg.dim, cfg.vocab_size, rngs)

    def hidden(self, tokens: jax.Array, positions: jax.Array, attend: AttendFn) -> jax.Array:
        """Final normalized hidden states ``[T, dim]``."""
        x = self.embed(tokens)
        for i, block in enumerate(self.layers):
            x = block(x, positions, lambda q, k, v, i=i: attend(i, q, k, v))
        return self.norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:
        return self.lm_head(hidden).astype(jnp.float32)

    def init_caches(self, num_pages: int, page_size: int, layout: str = "HND", dtype=None) -> list[jaxattn.KVCache]:
        """One zeroed KV cache per layer (``dtype`` defaults to the model's)."""
        cfg = self.cfg
        return [jaxattn.KVCache.create(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                                       dtype=dtype or cfg.dtype, layout=layout) for _ in range(cfg.num_layers)]


def forward_paged(model: Llama, tokens: jax.Array, caches: list[jaxattn.KVCache], meta: jaxattn.AttentionMetadata,
                  slots: jax.Array, backend: str = "auto") -> tuple[jax.Array, list[jaxattn.KVCache]]:
    """One step over packed tokens with paged KV: writes each layer's K/V at ``slots``, attends
    with ``jaxattn.paged_attention``; returns (hidden ``[T, dim]``, updated caches)."""
    new_caches = list(caches)

    def attend(layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        new_caches[layer] = new_caches[layer].write(k, v, slots)
        return jaxattn.paged_attention(q, new_caches[layer], meta, backend=backend)

    return model.hidden(tokens, meta.positions(tokens.shape[0]), attend), new_caches
