"""``python -m jaxattn.serve.demo``: continuous-batching greedy generation whose every step (page
allocation, KV writes, attention in all layers) is one jitted function over donated KV caches and
page table.

The model is a random-weight Llama-style preset (CPU: ``tiny`` on the ``xla`` backend; GPU:
``small`` on whatever ``auto`` picks), or with ``--model DIR`` a local Hugging Face checkpoint
directory (``jaxattn.serve.models.from_pretrained``). Prompts are random token ids, or read from
``--prompt-ids FILE`` (one prompt per line, token ids separated by spaces), or given as text with
``--prompt`` when the ``tokenizers`` package is installed and DIR has a ``tokenizer.json`` (which
then also decodes the outputs).

Tensor parallelism: ``--tp N`` splits the model over N devices of this process; with
``--coordinator HOST:PORT --num-processes N --process-id I`` each process joins a
``jax.distributed`` job and the model is split over every process's devices (one process per
GPU: add ``--local-devices I``). Every process runs the same engine on the same requests; process
0 prints. On a 2-GPU host::

    python -m jaxattn.serve.demo --coordinator localhost:12355 --num-processes 2 --process-id 0 --local-devices 0 &
    python -m jaxattn.serve.demo --coordinator localhost:12355 --num-processes 2 --process-id 1 --local-devices 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn.attention import backend_for
from jaxattn.serve.cli_args import DTYPES, positive_int, tp_mesh
from jaxattn.serve.engine import Engine
from jaxattn.serve.models import from_pretrained
from jaxattn.serve.models.llama import PRESETS, LlamaConfig, random_model


def attention_plans(cfg: LlamaConfig, engine: Engine) -> dict[str, str]:
    """What ``paged_attention`` runs for the engine's largest decode-only and mixed steps."""
    cache = engine.runner.caches[0]
    shapes = engine.buckets.shapes
    plans = {}
    for phase, shape in {"decode step": shapes[len(engine.buckets.rows) - 1], "prefill/mixed step": shapes[-1]}.items():
        b = shape.rows
        meta = jaxattn.AttentionMetadata(jnp.zeros((b + 1,), jnp.int32), jnp.zeros((b,), jnp.int32),
                                         engine.runner.table.block_tables[:b], jnp.zeros((), jnp.int32),
                                         max_q_len=shape.max_q_len)
        q = jnp.zeros((shape.tokens, cfg.num_q_heads, cfg.head_dim), cfg.dtype)
        plans[phase] = str(backend_for(q, cache, meta, backend=engine.backend))
    return plans


def progress_bar(width: int = 30) -> Callable[[int, int], None]:
    """A one-line progress bar on stderr: requests done / total, elapsed time."""
    start = time.perf_counter()
    interactive = sys.stderr.isatty()

    def show(done: int, total: int) -> None:
        if not interactive and done < total:
            return
        filled = width * done // max(total, 1)
        sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests "
                         f"{time.perf_counter() - start:6.1f}s")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def read_prompt_ids(path: str, vocab_size: int) -> list[np.ndarray]:
    """The prompts of a file with one prompt per line, token ids separated by whitespace (blank
    lines are skipped); ValueError naming the line of a token that is not an int in
    ``[0, vocab_size)``, or when the file has no prompt."""
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = np.array([int(word) for word in line.split()], np.int64)
            except ValueError:
                ids = np.array([-1])
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise ValueError(f"--prompt-ids {path}, line {number}: expected token ids (ints in "
                                 f"[0, {vocab_size}) separated by spaces), got {line.strip()[:80]!r}")
            prompts.append(ids.astype(np.int32))
    if not prompts:
        raise ValueError(f"--prompt-ids {path} has no prompt (one line of token ids per prompt)")
    return prompts


def load_tokenizer(model_dir: str | None) -> tuple[object | None, str | None]:
    """``(tokenizers.Tokenizer of model_dir/tokenizer.json, None)``, or ``(None, why not)``: no
    such file, or the optional ``tokenizers`` package is not installed."""
    path = os.path.join(model_dir, "tokenizer.json") if model_dir else None
    if path is None or not os.path.isfile(path):
        return None, "needs --model DIR with a DIR/tokenizer.json"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None, f"needs the tokenizers package to read {path} (pip install tokenizers)"
    return Tokenizer.from_file(path), None


def read_prompts(args: argparse.Namespace, vocab_size: int, tokenizer) -> list[np.ndarray]:
    """The prompts of ``--prompt-ids`` and ``--prompt``, else ``--requests`` random ones."""
    prompts = []
    if args.prompt_ids is not None:
        prompts += read_prompt_ids(args.prompt_ids, vocab_size)
    for text in args.prompt or ():
        prompts.append(np.asarray(tokenizer.encode(text).ids, np.int32))
        if not prompts[-1].size:
            raise ValueError(f"--prompt {text!r} encodes to no tokens")
    if prompts:
        return prompts
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, size=int(rng.integers(max(1, args.prompt_len // 4), args.prompt_len + 1)))
            for _ in range(args.requests)]


def build_parser(on_gpu: bool) -> argparse.ArgumentParser:
    """The demo's options; defaults depend on whether a GPU runs it."""
    summary, *details = __doc__.replace("``", "").split("\n\n")
    parser = argparse.ArgumentParser(prog="python -m jaxattn.serve.demo", description=summary.split(": ", 1)[1],
                                     epilog="\n\n".join(details))
    model = parser.add_argument_group("model")
    model.add_argument("--model", metavar="DIR", help="local Hugging Face checkpoint directory (config.json, "
                       "*.safetensors) to serve instead of a random-weight preset")
    model.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="random-weight model shapes without --model (default: small on GPU, tiny on CPU)")
    model.add_argument("--layers", type=positive_int, metavar="N", default=None,
                       help="override the preset's number of layers")
    model.add_argument("--dtype", choices=DTYPES, default=None,
                       help="weights and activations (default: the checkpoint's, or the preset's)")
    model.add_argument("--backend", default="auto", choices=("auto",) + jaxattn.backends.ALL_BACKENDS,
                       help="paged_attention backend (default: auto)")
    prompts = parser.add_argument_group("requests")
    prompts.add_argument("--prompt-ids", metavar="FILE",
                         help="prompts as token ids: one prompt per line, ids separated by spaces")
    prompts.add_argument("--prompt", action="append", metavar="TEXT",
                         help="a text prompt (repeat for more); needs --model DIR with a tokenizer.json and "
                              "the tokenizers package")
    prompts.add_argument("--requests", type=positive_int, metavar="N", default=64 if on_gpu else 12,
                         help="number of random prompts, when no --prompt-ids or --prompt is given "
                              "(default: %(default)s)")
    prompts.add_argument("--prompt-len", type=positive_int, metavar="N", default=512 if on_gpu else 48,
                         help="longest random prompt, in tokens (default: %(default)s)")
    prompts.add_argument("--new-tokens", type=positive_int, metavar="N", default=128 if on_gpu else 24,
                         help="tokens to generate per request (default: %(default)s)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-seqs", type=positive_int, metavar="N", default=32 if on_gpu else 4,
                        help="sequences in flight (default: %(default)s)")
    engine.add_argument("--max-step-tokens", type=positive_int, metavar="N", default=2048 if on_gpu else 32,
                        help="tokens one step computes, decodes and prompt chunks (default: %(default)s)")
    engine.add_argument("--page-size", type=positive_int, metavar="N", default=64 if on_gpu else 16,
                        help="tokens per KV cache page (default: %(default)s)")
    parallel = parser.add_argument_group("tensor parallelism")
    parallel.add_argument("--tp", type=positive_int, metavar="N", default=None,
                          help="split the model over this many devices "
                               "(default: all of them with --coordinator, else 1)")
    add_distributed_arguments(parallel)
    parser.add_argument("--output", metavar="FILE",
                        help="write every request's generated tokens to this JSON file (process 0)")
    return parser


def add_distributed_arguments(parser) -> None:
    parser.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0: join a jax.distributed job")
    parser.add_argument("--num-processes", type=positive_int, metavar="N",
                        help="processes in the job (with --coordinator)")
    parser.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 .. num-processes - 1")
    parser.add_argument("--local-devices", metavar="IDS",
                        help="comma-separated local device ids this process uses (one GPU each)")


def join_distributed(argv: list[str] | None) -> None:
    """With ``--coordinator``, joins the ``jax.distributed`` job: before anything asks JAX for its
    devices (the full parser's defaults depend on the platform)."""
    early = argparse.ArgumentParser(add_help=False)
    add_distributed_arguments(early)
    args, _ = early.parse_known_args(argv)
    if not args.coordinator:
        return
    if args.num_processes is None or args.process_id is None:
        early.error("--coordinator needs --num-processes and --process-id")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU collectives across processes
    local = None if args.local_devices is None else [int(i) for i in args.local_devices.split(",")]
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id, local_device_ids=local)


def main(argv: list[str] | None = None) -> None:
    join_distributed(argv)
    on_gpu = jax.default_backend() == "gpu"
    parser = build_parser(on_gpu)
    args = parser.parse_args(argv)
    tp = args.tp or (jax.device_count() if args.coordinator else 1)
    if args.coordinator and tp != jax.device_count():
        parser.error(f"--tp {tp}: with --coordinator the model is split over every device of the job "
                     f"({jax.device_count()})")
    if not args.coordinator and tp > jax.local_device_count():
        parser.error(f"--tp {tp}: there are only {jax.local_device_count()} devices")
    devices = jax.devices() if args.coordinator else jax.local_devices()[:tp]
    mesh = tp_mesh(devices)
    leader = jax.process_index() == 0
    say = print if leader else lambda *_: None
    if args.model is not None and (args.preset is not None or args.layers is not None):
        parser.error("--preset and --layers choose a random-weight model: not with --model")
    tokenizer, no_tokenizer = load_tokenizer(args.model)
    if args.prompt and tokenizer is None:
        parser.error(f"--prompt {no_tokenizer}; or give token ids with --prompt-ids")
    if args.model is not None:
        try:
            model = from_pretrained(args.model, dtype=args.dtype, mesh=mesh)
        except (ValueError, OSError, ImportError) as err:
            parser.error(f"--model {args.model}: {err}")
        cfg = model.cfg
        name = f"checkpoint {args.model}"
    else:
        preset = args.preset or ("small" if on_gpu else "tiny")
        model = random_model(preset, layers=args.layers, dtype=args.dtype, mesh=mesh)
        cfg = model.cfg
        name = f"{preset} preset (random weights)"

    given = args.prompt_ids is not None or bool(args.prompt)
    try:
        prompts = read_prompts(args, cfg.vocab_size, tokenizer)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    max_seq_len = max(p.size for p in prompts) + args.new_tokens

    def make_engine() -> Engine:
        return Engine(model, max_seqs=args.max_seqs, max_seq_len=max_seq_len, page_size=args.page_size,
                      max_step_tokens=args.max_step_tokens, backend=args.backend, mesh=mesh)

    say(f"jaxattn demo on {jax.devices()[0].device_kind} ({jax.default_backend()}): {name}, "
          f"{cfg.num_layers} layers, dim {cfg.dim}, heads {cfg.num_q_heads}/{cfg.num_kv_heads} x {cfg.head_dim}, "
          f"{cfg.dtype}; {len(prompts)} requests, prompts <= {max_seq_len - args.new_tokens} tokens, "
          f"{args.new_tokens} new tokens each, {args.max_seqs} sequences in flight, "
          f"{args.max_step_tokens} tokens per step, page {args.page_size}; tensor parallel over {tp} devices, "
          f"{jax.process_count()} processes")
    try:
        engine = make_engine()
        plans = attention_plans(cfg, engine)
    except ValueError as err:                    # a backend that cannot run here, or not these shapes
        parser.error(f"--backend {args.backend}: {err}")
    for phase, plan in plans.items():
        say(f"  attention backend, {phase}: {plan}")

    say(f"  compiled {len(engine.buckets.shapes)} step shapes in {engine.warmup(sampled=False):.1f} s")
    for prompt in prompts:
        engine.add_request(prompt, args.new_tokens)
    prompt_tokens = sum(p.size for p in prompts)
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
    for request in done if given else done[:1]:
        if tokenizer is not None:
            say(f"  request {request.id}: {tokenizer.decode(request.prompt.tolist())!r} -> "
                  f"{tokenizer.decode(request.output)!r}")
        else:
            say(f"  request {request.id} generated: {request.output if given else request.output[:12]}")

    if args.output and leader:
        with open(args.output, "w") as f:
            json.dump([r.output for r in done], f)


if __name__ == "__main__":
    main()
