"""``python -m jaxattn.demo``: greedy generation with a small random-weight decoder whose every
step (page allocation, KV writes, attention in all layers) is one jitted, donated function.

Runs on CPU with the ``xla`` backend and on GPU with whatever ``auto`` picks there; prints the
backend that ran for prefill and decode steps and the tokens/s of each phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn.attention import backend_for


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int
    dim: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    page_size: int
    dtype: str


PRESETS = {
    "tiny": ModelConfig(vocab=512, dim=128, layers=2, q_heads=4, kv_heads=2, head_dim=32, hidden=256,
                        page_size=16, dtype="float32"),
    "small": ModelConfig(vocab=32000, dim=2048, layers=8, q_heads=16, kv_heads=4, head_dim=128, hidden=5632,
                         page_size=64, dtype="bfloat16"),
}


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Random weights (nothing is downloaded)."""
    dtype = jnp.dtype(cfg.dtype)

    def dense(key, fan_in, *shape):
        return (jax.random.normal(key, (fan_in, *shape), jnp.float32) / np.sqrt(fan_in)).astype(dtype)

    keys = iter(jax.random.split(key, 2 + 5 * cfg.layers))
    layers = [dict(
        wqkv=dense(next(keys), cfg.dim, (cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim),
        wo=dense(next(keys), cfg.q_heads * cfg.head_dim, cfg.dim),
        w_gate_up=dense(next(keys), cfg.dim, 2 * cfg.hidden),
        w_down=dense(next(keys), cfg.hidden, cfg.dim),
        norms=jnp.ones((2, cfg.dim), dtype),
    ) for _ in range(cfg.layers)]
    return dict(embed=dense(next(keys), 1, cfg.vocab, cfg.dim)[0] * 4, layers=layers,
                final_norm=jnp.ones((cfg.dim,), dtype), unembed=dense(next(keys), cfg.dim, cfg.vocab))


def rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype) * weight


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """x: [T, H, D], positions: int32[T]."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None, None].astype(jnp.float32) * freq
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def forward(cfg: ModelConfig, params: dict, caches: list[jaxattn.KVCache], tokens: jax.Array,
            meta: jaxattn.AttentionMetadata, slots: jax.Array, backend: str):
    """tokens: int32[T] -> (hidden [T, dim], caches)."""
    positions = meta.positions(tokens.shape[0])
    x = params["embed"][tokens]
    new_caches = []
    for layer, cache in zip(params["layers"], caches):
        h = rms_norm(x, layer["norms"][0])
        qkv = (h @ layer["wqkv"]).reshape(tokens.shape[0], -1, cfg.head_dim)
        q, k, v = jnp.split(qkv, [cfg.q_heads, cfg.q_heads + cfg.kv_heads], axis=1)
        q, k = rope(q, positions), rope(k, positions)
        cache = cache.write(k, v, slots)
        attn = jaxattn.paged_attention(q, cache, meta, backend=backend)
        x = x + attn.reshape(tokens.shape[0], -1) @ layer["wo"]
        gate, up = jnp.split(rms_norm(x, layer["norms"][1]) @ layer["w_gate_up"], 2, axis=-1)
        x = x + (jax.nn.silu(gate) * up) @ layer["w_down"]
        new_caches.append(cache)
    return rms_norm(x, params["final_norm"]), new_caches


@functools.partial(jax.jit, static_argnames=("cfg", "max_q_len", "backend"), donate_argnames=("caches", "table"))
def step(cfg: ModelConfig, params: dict, caches: list[jaxattn.KVCache], table: jaxattn.PageTable,
         tokens: jax.Array, seq_ids: jax.Array, q_lens: jax.Array, *, max_q_len: int, backend: str):
    """One engine step: allocate pages, write KV and attend in every layer, pick greedy tokens.

    tokens: int32[T] packed new tokens of sequences ``seq_ids`` (int32[B]) with ``q_lens`` each.
    Returns (next token of each sequence int32[B], ok bool[B], caches, table).
    """
    table, ok = table.extend(seq_ids, table.seq_lens[jnp.maximum(seq_ids, 0)] + q_lens)
    q_lens = jnp.where(ok, q_lens, 0)
    meta = table.metadata(seq_ids, q_lens, max_q_len=max_q_len)
    slots = table.slot_mapping(seq_ids, q_lens, tokens.shape[0])
    hidden, caches = forward(cfg, params, caches, tokens, meta, slots, backend)
    last = jnp.maximum(meta.cu_q_lens[1:] - 1, 0)
    logits = hidden[last].astype(jnp.float32) @ params["unembed"].astype(jnp.float32)
    return jnp.argmax(logits, -1).astype(jnp.int32), ok, caches, table


def generate(cfg: ModelConfig, params: dict, prompts: np.ndarray, new_tokens: int, backend: str,
             num_pages: int) -> tuple[np.ndarray, dict]:
    """Prefills all prompts in one step, then decodes; returns tokens [B, new_tokens] and timings."""
    batch, prompt_len = prompts.shape
    pages_per_seq = -(-(prompt_len + new_tokens) // cfg.page_size)
    caches = [jaxattn.KVCache.create(num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim, dtype=cfg.dtype)
              for _ in range(cfg.layers)]
    table = jaxattn.PageTable.create(num_pages, batch, pages_per_seq, cfg.page_size)
    seq_ids = jnp.arange(batch, dtype=jnp.int32)

    t0 = time.perf_counter()
    token, ok, caches, table = step(cfg, params, caches, table, jnp.asarray(prompts.reshape(-1)), seq_ids,
                                    jnp.full((batch,), prompt_len, jnp.int32), max_q_len=prompt_len, backend=backend)
    token.block_until_ready()
    t1 = time.perf_counter()
    out = [token]
    for _ in range(new_tokens - 1):
        token, ok, caches, table = step(cfg, params, caches, table, token, seq_ids, jnp.ones((batch,), jnp.int32),
                                        max_q_len=1, backend=backend)
        out.append(token)
    tokens = np.asarray(jnp.stack(out, axis=1))
    t2 = time.perf_counter()
    if not bool(ok.all()):
        raise RuntimeError("the page pool is too small for this run")
    return tokens, {"prefill_s": t1 - t0, "decode_s": t2 - t1}


def chosen_backends(cfg: ModelConfig, batch: int, prompt_len: int, backend: str) -> dict[str, str]:
    """Backend paged_attention runs for this model's prefill and decode steps."""
    cache = jaxattn.KVCache.create(2, cfg.page_size, cfg.kv_heads, cfg.head_dim, dtype=cfg.dtype)
    chosen = {}
    for phase, q_len in (("prefill", prompt_len), ("decode", 1)):
        meta = jaxattn.AttentionMetadata(jnp.zeros((batch + 1,), jnp.int32), jnp.zeros((batch,), jnp.int32),
                                         jnp.zeros((batch, 1), jnp.int32), jnp.zeros((), jnp.int32), max_q_len=q_len)
        q = jnp.zeros((batch * q_len, cfg.q_heads, cfg.head_dim), cfg.dtype)
        chosen[phase] = str(backend_for(q, cache, meta, backend=backend))
    return chosen


def main(argv: list[str] | None = None) -> None:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small" if on_gpu else "tiny")
    parser.add_argument("--backend", default="auto", choices=("auto",) + jaxattn.backends.BACKENDS)
    parser.add_argument("--batch", type=int, default=16 if on_gpu else 4)
    parser.add_argument("--prompt-len", type=int, default=512 if on_gpu else 64)
    parser.add_argument("--new-tokens", type=int, default=128 if on_gpu else 32)
    args = parser.parse_args(argv)
    cfg = PRESETS[args.preset]
    pages_per_seq = -(-(args.prompt_len + args.new_tokens) // cfg.page_size)
    num_pages = 1 + args.batch * pages_per_seq
    params = init_params(cfg, jax.random.key(0))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab, size=(args.batch, args.prompt_len), dtype=np.int32)

    print(f"jaxattn demo on {jax.devices()[0].device_kind} ({jax.default_backend()}): preset {args.preset} "
          f"({cfg.layers} layers, dim {cfg.dim}, {cfg.q_heads}/{cfg.kv_heads} heads x {cfg.head_dim}, {cfg.dtype}), "
          f"batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, page {cfg.page_size}")
    for phase, name in chosen_backends(cfg, args.batch, args.prompt_len, args.backend).items():
        print(f"  {phase} attention backend: {name}")
    generate(cfg, params, prompts, args.new_tokens, args.backend, num_pages)          # compiles both steps
    tokens, times = generate(cfg, params, prompts, args.new_tokens, args.backend, num_pages)
    prefill_tps = args.batch * args.prompt_len / times["prefill_s"]
    decode_tps = args.batch * (args.new_tokens - 1) / times["decode_s"]
    print(f"  prefill: {args.batch * args.prompt_len} tokens in {times['prefill_s'] * 1e3:.1f} ms "
          f"= {prefill_tps:,.0f} tokens/s")
    print(f"  decode:  {args.batch * (args.new_tokens - 1)} tokens in {times['decode_s'] * 1e3:.1f} ms "
          f"= {decode_tps:,.0f} tokens/s ({times['decode_s'] / (args.new_tokens - 1) * 1e3:.2f} ms/step)")
    print(f"  sequence 0 continues with: {tokens[0, :16].tolist()}")


if __name__ == "__main__":
    main()
