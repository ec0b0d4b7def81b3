"""``python -m jaxattn.demo``: continuous-batching greedy generation with a random-weight
Llama-style model whose every step (page allocation, KV writes, attention in all layers) is one
jitted function over donated KV caches and page table.

CPU: the tiny preset with the ``xla`` backend. GPU: a larger preset with whatever ``auto`` picks.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxattn
from jaxattn.attention import backend_for
from jaxattn.engine import Engine, progress_bar
from jaxattn.models.llama import PRESETS, Llama, LlamaConfig


def attention_plans(cfg: LlamaConfig, engine: Engine) -> dict[str, str]:
    """What ``paged_attention`` runs for the engine's decode-only and mixed steps."""
    cache = engine.caches[0]
    plans = {}
    for phase, (num_tokens, max_q_len) in {"decode step": (engine.max_seqs, 1),
                                           "prefill/mixed step": (engine.max_seqs + engine.chunk_size,
                                                                  engine.chunk_size)}.items():
        b = engine.max_seqs
        meta = jaxattn.AttentionMetadata(jnp.zeros((b + 1,), jnp.int32), jnp.zeros((b,), jnp.int32),
                                         engine.table.block_tables, jnp.zeros((), jnp.int32), max_q_len=max_q_len)
        q = jnp.zeros((num_tokens, cfg.num_q_heads, cfg.head_dim), cfg.dtype)
        plans[phase] = str(backend_for(q, cache, meta, backend=engine.backend))
    return plans


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small" if on_gpu else "tiny")
    parser.add_argument("--layers", type=positive_int, default=None, help="override the preset's number of layers")
    parser.add_argument("--backend", default="auto", choices=("auto",) + jaxattn.backends.BACKENDS)
    parser.add_argument("--requests", type=positive_int, default=64 if on_gpu else 12)
    parser.add_argument("--max-seqs", type=positive_int, default=32 if on_gpu else 4)
    parser.add_argument("--prompt-len", type=positive_int, default=512 if on_gpu else 48, help="longest prompt")
    parser.add_argument("--new-tokens", type=positive_int, default=128 if on_gpu else 24)
    parser.add_argument("--chunk-size", type=positive_int, default=512 if on_gpu else 32)
    parser.add_argument("--page-size", type=positive_int, default=64 if on_gpu else 16)
    args = parser.parse_args(argv)

    cfg = PRESETS[args.preset]
    if args.layers is not None:
        cfg = cfg.replace(num_layers=args.layers)
    model = Llama(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(0)

    def make_engine() -> Engine:
        return Engine(model, max_seqs=args.max_seqs, max_seq_len=args.prompt_len + args.new_tokens,
                      page_size=args.page_size, chunk_size=args.chunk_size, backend=args.backend)

    def add_requests(engine: Engine, count: int) -> None:
        for _ in range(count):
            length = int(rng.integers(max(1, args.prompt_len // 4), args.prompt_len + 1))
            engine.add_request(rng.integers(0, cfg.vocab_size, size=length), args.new_tokens)

    print(f"jaxattn demo on {jax.devices()[0].device_kind} ({jax.default_backend()}): {args.preset} preset, "
          f"{cfg.num_layers} layers, dim {cfg.dim}, heads {cfg.num_q_heads}/{cfg.num_kv_heads} x {cfg.head_dim}, "
          f"{cfg.dtype}; {args.requests} requests, prompts <= {args.prompt_len}, {args.new_tokens} new tokens each, "
          f"{args.max_seqs} sequences in flight, prefill chunk {args.chunk_size}, page {args.page_size}")
    engine = make_engine()
    for phase, plan in attention_plans(cfg, engine).items():
        print(f"  attention backend, {phase}: {plan}")

    warmup = make_engine()                       # compiles both step shapes
    add_requests(warmup, 2)
    warmup.run()
    del warmup

    add_requests(engine, args.requests)
    prompt_tokens = sum(r.prompt.size for r in engine.waiting)
    start = time.perf_counter()
    steps = 0

    def on_step(done: int, total: int, bar=progress_bar()) -> None:
        nonlocal steps
        steps += 1
        bar(done, total)

    done = engine.run(on_step)
    elapsed = time.perf_counter() - start
    generated = sum(len(r.output) for r in done)
    print(f"  {len(done)} requests, {prompt_tokens} prompt + {generated} generated tokens in {elapsed:.2f} s, "
          f"{steps} steps ({elapsed / steps * 1e3:.2f} ms/step)")
    print(f"  throughput: {generated / elapsed:,.0f} generated tokens/s, "
          f"{(prompt_tokens + generated) / elapsed:,.0f} total tokens/s")
    print(f"  request 0 generated: {done[0].output[:12]} ...")


if __name__ == "__main__":
    main()
