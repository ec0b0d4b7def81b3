"""``python -m jaxattn.demo``: continuous-batching greedy generation with a random-weight
Llama-style model whose every step (page allocation, KV writes, attention in all layers) is one
jitted function over donated KV caches and page table.

CPU: the tiny preset with the ``xla`` backend. GPU: a larger preset with whatever ``auto`` picks.

Tensor parallelism: ``--tp N`` splits the model over N devices of this process; with
``--coordinator HOST:PORT --num-processes N --process-id I`` each process joins a
``jax.distributed`` job and the model is split over every process's devices (one process per
GPU: add ``--local-devices I``). Every process runs the same engine on the same requests; process
0 prints. On a 2-GPU host::

    python -m jaxattn.demo --coordinator localhost:12355 --num-processes 2 --process-id 0 --local-devices 0 &
    python -m jaxattn.demo --coordinator localhost:12355 --num-processes 2 --process-id 1 --local-devices 1
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType

import jaxattn
from jaxattn.attention import backend_for
from jaxattn.engine import Engine, progress_bar
from jaxattn.models.llama import PRESETS, Llama, LlamaConfig, shard_model

# Defaults that depend on the platform, known only after jax.distributed.initialize (it must run
# before JAX picks its devices).
DEFAULTS = {"gpu": dict(preset="small", requests=64, max_seqs=32, prompt_len=512, new_tokens=128, chunk_size=512,
                        page_size=64),
            "cpu": dict(preset="tiny", requests=12, max_seqs=4, prompt_len=48, new_tokens=24, chunk_size=32,
                        page_size=16)}


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags; with ``--coordinator``, this process has joined the ``jax.distributed`` job."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpu, cpu = DEFAULTS["gpu"], DEFAULTS["cpu"]

    def platform_default(name: str) -> str:
        return f"default: {gpu[name]} on GPU, {cpu[name]} on CPU"

    parser.add_argument("--preset", choices=sorted(PRESETS), help=platform_default("preset"))
    parser.add_argument("--layers", type=positive_int, default=None, help="override the preset's number of layers")
    parser.add_argument("--backend", default="auto", choices=("auto",) + jaxattn.backends.BACKENDS)
    for flag, name, text in (("--requests", "requests", ""), ("--max-seqs", "max_seqs", ""),
                             ("--prompt-len", "prompt_len", "longest prompt; "), ("--new-tokens", "new_tokens", ""),
                             ("--chunk-size", "chunk_size", ""), ("--page-size", "page_size", "")):
        parser.add_argument(flag, type=positive_int, help=text + platform_default(name))
    parser.add_argument("--tp", type=positive_int, default=None,
                        help="split the model over this many devices (default: all of them with --coordinator, else 1)")
    parser.add_argument("--coordinator", help="HOST:PORT of process 0: join a jax.distributed job")
    parser.add_argument("--num-processes", type=positive_int, help="processes in the job (with --coordinator)")
    parser.add_argument("--process-id", type=int, help="this process's index, 0 .. num-processes - 1")
    parser.add_argument("--local-devices", help="comma-separated local device ids this process uses (one GPU each)")
    parser.add_argument("--output", help="write every request's generated tokens to this JSON file (process 0)")
    args = parser.parse_args(argv)
    if args.coordinator:
        if args.num_processes is None or args.process_id is None:
            parser.error("--coordinator needs --num-processes and --process-id")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU collectives across processes
        local = None if args.local_devices is None else [int(i) for i in args.local_devices.split(",")]
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id, local_device_ids=local)
    for name, value in DEFAULTS["gpu" if jax.default_backend() == "gpu" else "cpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.tp = args.tp or (jax.device_count() if args.coordinator else 1)
    if args.tp > jax.device_count():
        parser.error(f"--tp {args.tp}: there are only {jax.device_count()} devices")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    leader = jax.process_index() == 0
    say = print if leader else lambda *_: None
    tp = args.tp
    mesh = None if tp == 1 else jax.make_mesh((tp,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:tp])

    cfg = PRESETS[args.preset]
    if args.layers is not None:
        cfg = cfg.replace(num_layers=args.layers)
    model = Llama(cfg, nnx.Rngs(0))
    if mesh is not None:
        shard_model(model, mesh)
    rng = np.random.default_rng(0)

    def make_engine() -> Engine:
        return Engine(model, max_seqs=args.max_seqs, max_seq_len=args.prompt_len + args.new_tokens,
                      page_size=args.page_size, chunk_size=args.chunk_size, backend=args.backend, mesh=mesh)

    def add_requests(engine: Engine, count: int) -> None:
        for _ in range(count):
            length = int(rng.integers(max(1, args.prompt_len // 4), args.prompt_len + 1))
            engine.add_request(rng.integers(0, cfg.vocab_size, size=length), args.new_tokens)

    say(f"jaxattn demo on {jax.devices()[0].device_kind} ({jax.default_backend()}): {args.preset} preset, "
          f"{cfg.num_layers} layers, dim {cfg.dim}, heads {cfg.num_q_heads}/{cfg.num_kv_heads} x {cfg.head_dim}, "
          f"{cfg.dtype}; {args.requests} requests, prompts <= {args.prompt_len}, {args.new_tokens} new tokens each, "
          f"{args.max_seqs} sequences in flight, prefill chunk {args.chunk_size}, page {args.page_size}; "
          f"tensor parallel over {tp} devices, {jax.process_count()} processes")
    engine = make_engine()
    for phase, plan in attention_plans(cfg, engine).items():
        say(f"  attention backend, {phase}: {plan}")

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
        if leader:
            bar(done, total)

    done = engine.run(on_step)
    elapsed = time.perf_counter() - start
    generated = sum(len(r.output) for r in done)
    say(f"  {len(done)} requests, {prompt_tokens} prompt + {generated} generated tokens in {elapsed:.2f} s, "
          f"{steps} steps ({elapsed / steps * 1e3:.2f} ms/step)")
    say(f"  throughput: {generated / elapsed:,.0f} generated tokens/s, "
          f"{(prompt_tokens + generated) / elapsed:,.0f} total tokens/s")
    say(f"  request 0 generated: {done[0].output[:12]} ...")
    if args.output and leader:
        with open(args.output, "w") as f:
            json.dump([r.output for r in done], f)


if __name__ == "__main__":
    main()
