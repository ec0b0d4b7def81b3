"""What a speculative verify step costs against a decode step: the engine's jitted step on random
caches, GPU time from the profiler, by batch and drafts per row (Llama-3-8B shapes, random weights).

    python -m benchmarks.profile_verify [--layers 32] [--batches 1,4,16,64] [--ks 2,4,8] [--context 1024]
        [--backend auto] [--steps 10] [--smoke]

Each case compiles one step (``benchmarks.engine_step.decode_step``): K = 0 is the decode step
(one token per row), K > 0 the speculating step (K + 1 query tokens per row, n-gram drafts
verified in the step; random weights keep about none, so every step is a verify step of K + 1
tokens that gains one). Unlike ``bench_speculative``, no engine and none of its other step shapes
are compiled, so the whole grid fits a short GPU call. Writes the "speculative_verify" section of
benchmarks/RESULTS.md; ``--smoke`` runs a tiny model (any device) and writes only ``$OUT``.
"""

from __future__ import annotations

import argparse
import datetime
import gc

import jax
from flax import nnx

from benchmarks.common import device_name, device_seconds, profiled, write_section
from benchmarks.engine_step import decode_step
from jaxattn.serve.models.llama import PRESETS, Llama


def step_seconds(model: Llama, backend: str, batch: int, context: int, draft_tokens: int,
                 steps: int) -> tuple[float, str]:
    """(GPU seconds per step, what ``paged_attention`` runs) of ``steps`` chained steps after 3 warm-up steps."""
    model_step, state, _, plan = decode_step(model, backend, batch, context, steps, draft_tokens=draft_tokens)
    for _ in range(3):
        state = jax.block_until_ready(model_step(state))
    _, seconds = profiled(model_step, state, steps, measure=device_seconds)
    return seconds, plan


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--ks", default="2,4,8", help="drafts per row, comma-separated")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="a tiny model (any device); RESULTS.md is left alone")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.layers, args.batches, args.ks, args.context, args.steps = "tiny", 2, "1,2", "2", 40, 3
    cfg = PRESETS[args.preset].replace(num_layers=args.layers)
    model = Llama(cfg, nnx.Rngs(0))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        decode, decode_plan = step_seconds(model, args.backend, batch, args.context, 0, args.steps)
        rows.append(f"| {batch} | - | {batch} | {decode * 1e3:.3f} | 1.00x | {decode_plan} |")
        print(rows[-1], flush=True)
        for k in (int(k) for k in args.ks.split(",")):
            verify, plan = step_seconds(model, args.backend, batch, args.context, k, args.steps)
            rows.append(f"| {batch} | {k} | {batch * (k + 1)} | {verify * 1e3:.3f} | {verify / decode:.2f}x | {plan} |")
            print(rows[-1], flush=True)
            gc.collect()
    command = (f"python -m benchmarks.profile_verify --preset {args.preset} --layers {args.layers} --batches "
               f"{args.batches} --ks {args.ks} --context {args.context} --backend {args.backend} --steps {args.steps}"
               + (" --smoke" if args.smoke else ""))
    lines = [
        f"Device: {device_name()}; date {datetime.date.today()}; jax {jax.__version__}; {args.preset} shapes, "
        f"{cfg.num_layers} layers, {cfg.dtype}, random weights; every row at context {args.context}; GPU time per step "
        f"from the profiler over {args.steps} chained steps after 3 warm-up steps (wall time off a GPU).",
        f"Command: `{command}`",
        "",
        "| B | K | tokens per step | ms per step | vs decode step | attention runs on |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "K = -: the decode step. K > 0: every row verifies K n-gram drafts (K + 1 query tokens, the drafts looked "
        "up, verified and the sequence cut back in the step); random weights keep about none, so each step gains "
        "one token per row: the cost of a verify step, the worst case of speculation.",
    ]
    print(write_section("speculative_verify", "\n".join(lines), update=not args.smoke,
                        heading="Speculative verify step vs decode step (benchmarks/profile_verify.py)"))


if __name__ == "__main__":
    main()
