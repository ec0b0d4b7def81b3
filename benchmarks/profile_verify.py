"""What a speculative verify step costs against a decode step: the engine's jitted step on random
caches, GPU time from the profiler, by batch and drafts per row (Llama-3-8B shapes, random weights).

    python -m benchmarks.profile_verify [--layers 32] [--batches 1,4,16,64] [--ks 2,4,8] [--context 1024]
        [--backend auto] [--steps 10] [--smoke]

Each case compiles one step (``benchmarks.engine_step.decode_step``): K = 0 is the decode step
(one token per row), K > 0 the speculating step (K + 1 query tokens per row, n-gram drafts
verified in the step; random weights keep about none, so every step is a verify step of K + 1
tokens that gains one). On a GPU each batch also gets a table of its steps' GPU time by kind of
kernel (``profile_step.by_kind``: GEMMs, attention, KV writes, ...), so the cost of verifying shows
where it lands. Unlike ``bench_speculative``, no engine and none of its other step shapes
are compiled, so the whole grid fits a short GPU call. Writes the "speculative_verify" section of
benchmarks/RESULTS.md; ``--smoke`` runs a tiny model (any device) and writes only ``$OUT``.
"""

from __future__ import annotations

import argparse
import datetime
import gc

import jax
from flax import nnx

from benchmarks.common import device_name, profiled, wall_seconds, write_section
from benchmarks.engine_step import decode_step
from benchmarks.profile_step import by_kind, profile_chain
from jaxattn.serve.models.llama import PRESETS, Llama


def step_seconds(model: Llama, backend: str, batch: int, context: int, draft_tokens: int,
                 steps: int) -> tuple[float, str, dict[str, tuple[float, float]]]:
    """(GPU seconds per step, what ``paged_attention`` runs, ``profile_step.profile_chain``'s
    events) of ``steps`` chained steps after 3 warm-up steps; off a GPU, the median wall time and
    no events."""
    model_step, state, _, plan = decode_step(model, backend, batch, context, steps, draft_tokens=draft_tokens)
    if jax.devices()[0].platform != "gpu":
        for _ in range(3):
            state = jax.block_until_ready(model_step(state))
        return profiled(model_step, state, steps, measure=wall_seconds)[1], plan, {}
    events = profile_chain(model_step, state, steps)
    return sum(seconds for seconds, _ in events.values()), plan, events


def kinds_table(batch: int, events: dict[int, dict[str, tuple[float, float]]], top: int = 6) -> list[str]:
    """One batch's steps (``{K: profile_chain's events}``, K = 0 the decode step) by kind of kernel,
    ms per step, with the verify steps' difference from the decode step; then the ``top`` kernels
    of the decode step and of the largest K's."""
    steps = {k: {kind: seconds for kind, (seconds, _, _) in by_kind(by_name).items()} for k, by_name in events.items()}
    ks = sorted(steps)
    kinds = sorted({kind for by in steps.values() for kind in by}, key=lambda kind: -steps[ks[-1]].get(kind, 0.0))
    head = " | ".join("decode" if k == 0 else f"K={k} (+ms)" for k in ks)
    lines = [f"**B = {batch}**, ms per step by kind of kernel:", "", f"| kind | {head} |",
             "|---|" + "---|" * len(ks)]
    for kind in kinds:
        base = steps[0].get(kind, 0.0)
        cells = [f"{base * 1e3:.3f}"] + [f"{steps[k].get(kind, 0.0) * 1e3:.3f} ({(steps[k].get(kind, 0.0) - base) * 1e3:+.3f})"
                                         for k in ks[1:]]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += ["", "| step | its largest kernels, us per step (launches) |", "|---|---|"]
    for k in (0, ks[-1]) if len(ks) > 1 else (0,):
        largest = sorted(events[k].items(), key=lambda item: -item[1][0])[:top]
        lines.append(f"| {'decode' if k == 0 else f'K={k}'} | "
                     + "; ".join(f"`{name[:60]}` {s * 1e6:.0f} ({n:.0f})" for name, (s, n) in largest) + " |")
    return lines + [""]


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
    rows, kind_tables = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        decode, decode_plan, decode_events = step_seconds(model, args.backend, batch, args.context, 0, args.steps)
        rows.append(f"| {batch} | - | {batch} | {decode * 1e3:.3f} | 1.00x | {decode_plan} |")
        print(rows[-1], flush=True)
        events = {0: decode_events}
        for k in (int(k) for k in args.ks.split(",")):
            verify, plan, events[k] = step_seconds(model, args.backend, batch, args.context, k, args.steps)
            rows.append(f"| {batch} | {k} | {batch * (k + 1)} | {verify * 1e3:.3f} | {verify / decode:.2f}x | {plan} |")
            print(rows[-1], flush=True)
            gc.collect()
        if decode_events:
            table = kinds_table(batch, events)
            print("\n".join(table), flush=True)
            kind_tables += table
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
        "",
        *kind_tables,
    ]
    print(write_section("speculative_verify", "\n".join(lines), update=not args.smoke,
                        heading="Speculative verify step vs decode step (benchmarks/profile_verify.py)"))


if __name__ == "__main__":
    main()
