"""Per-kernel profile of the engine's decode step (Llama-3-8B shapes, random weights): where a
step's GPU time goes, by kind of kernel, against what each kind must move.

    python -m benchmarks.profile_step [--layers 32] [--batch 64] [--contexts 1024,4096] [--backend auto]
                                      [--kv-dtype float8_e4m3fn] [--section NAME]

For each context: the GPU time of one step (``steps`` chained steps under the profiler, divided by
``steps``) per kernel name, grouped into kinds by name: GEMMs (the weight reads at decode batch
sizes), attention, KV writes (XLA's scatters into the pools), sampling / logits (argmax over the
vocabulary), and XLA's other fusions (norms, RoPE, residuals, page-table bookkeeping). Each kind's
bound: GEMMs, the weight bytes over the copy rate measured in the same run; attention, the KV
bytes; the rest, 0. Each kind also says how many kernels it launches per step: the attention
work that is not a kernel of its own (metadata, operand preparation) shows as launches that grow
with the layer count. Writes the step_profile section of benchmarks/RESULTS.md (``--section``: another).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import re

import jax
from flax import nnx

from benchmarks.common import (
    copy_bandwidth,
    device_events,
    device_name,
    write_section,
)
from benchmarks.engine_step import decode_step, step_bytes
from jaxattn.serve.models.llama import PRESETS, Llama

# (kind, pattern of kernel names), first match wins
KINDS = [
    ("attention", r"xqa|fmha|attn|attention|mha|flash|paged|cudnn"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|matmul|dot"),
    ("KV writes", r"scatter|dynamic.update.slice|dynamic_update_slice"),
    ("argmax / logits", r"argmax|reduce.*(max|select)|select.*reduce"),
    ("copies", r"memcpy|memset|copy"),
    ("other XLA fusions", r"."),
]


def kind_of(name: str) -> str:
    return next(kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE))


def by_kind(events: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float, int]]:
    """``device_events``' kernels grouped by ``kind_of``: ``{kind: (seconds, launches, kernels)}``,
    the kinds with the most seconds first."""
    kinds: dict[str, list] = {}
    for name, (seconds, launches) in events.items():
        entry = kinds.setdefault(kind_of(name), [0.0, 0.0, 0])
        entry[0] += seconds
        entry[1] += launches
        entry[2] += 1
    return {kind: tuple(entry) for kind, entry in sorted(kinds.items(), key=lambda item: -item[1][0])}


def profile(model: Llama, backend: str, batch: int, context: int, steps: int, kv_dtype=None,
            fuse_projections: bool = True) -> tuple[dict[str, tuple[float, float]], list]:
    """((GPU seconds, launches) per step by kernel name, the step's weights)."""
    model_step, state, weights, _ = decode_step(model, backend, batch, context, steps, kv_dtype=kv_dtype,
                                                fuse_projections=fuse_projections)
    for _ in range(3):
        state = jax.block_until_ready(model_step(state))
    box = [state]

    def call():
        box[0] = model_step(box[0])
        return box[0]

    return device_events(call, steps), weights


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12, help="kernels listed one by one")
    parser.add_argument("--kv-dtype", default=None, help="the caches' dtype (default the model's), e.g. float8_e4m3fn")
    parser.add_argument("--unfused", action="store_true",
                        help="q/k/v and gate/up projections apart (default: fused, as the Engine runs them)")
    parser.add_argument("--section", default="step_profile", help="the section of RESULTS.md it writes")
    args = parser.parse_args(argv)
    cfg = PRESETS[args.preset].replace(num_layers=args.layers)
    model = Llama(cfg, nnx.Rngs(0))
    bandwidth = copy_bandwidth()
    lines = [f"Device: {device_name()}; date {datetime.date.today()}; jax {jax.__version__}; {args.preset} shapes, "
             f"{cfg.num_layers} layers, batch {args.batch}, backend {args.backend}, "
             f"{args.kv_dtype or cfg.dtype} caches, q/k/v and gate/up projections "
             f"{'apart' if args.unfused else 'fused'}; copy rate {bandwidth / 1e12:.2f} TB/s (same run).",
             f"Command: `python -m benchmarks.profile_step --layers {args.layers} --batch {args.batch} "
             f"--contexts {args.contexts} --backend {args.backend}"
             f"{f' --kv-dtype {args.kv_dtype}' if args.kv_dtype else ''}{' --unfused' if args.unfused else ''}`", ""]
    for context in (int(c) for c in args.contexts.split(",")):
        events, weights = profile(model, args.backend, args.batch, context, args.steps, args.kv_dtype,
                                  not args.unfused)
        seconds = {name: s for name, (s, _) in events.items()}
        launches = {name: n for name, (_, n) in events.items()}
        weight_bytes, kv_bytes = step_bytes(cfg, weights, args.batch, context)
        bounds = {"GEMM": weight_bytes / bandwidth, "attention": kv_bytes / bandwidth}
        total = sum(seconds.values())
        kinds = by_kind(events)
        roofline = (weight_bytes + kv_bytes) / bandwidth
        lines += [f"**Context {context}**: GPU time {total * 1e3:.2f} ms per step; roofline {roofline * 1e3:.2f} ms "
                  f"({100 * roofline / total:.0f}% of the GPU time); {sum(launches.values()):.0f} launches per step.",
                  "", "| kind | ms per step | share | bound ms | kernels | launches per step |",
                  "|---|---|---|---|---|---|"]
        for kind, (s, n, kernels) in kinds.items():
            lines.append(f"| {kind} | {s * 1e3:.3f} | {100 * s / total:.1f}% | {bounds.get(kind, 0.0) * 1e3:.3f} "
                         f"| {kernels} | {n:.0f} |")
        lines += ["", "| kernel | kind | us per step | launches per step |", "|---|---|---|---|"]
        for name, s in sorted(seconds.items(), key=lambda item: -item[1])[:args.top]:
            lines.append(f"| `{name[:90]}` | {kind_of(name)} | {s * 1e6:.1f} | {launches[name]:.0f} |")
        lines.append("")
        del weights
        gc.collect()                 # the next context's caches need this one's memory
        print("\n".join(lines[-(len(kinds) + args.top + 8):]), flush=True)
    heading = "Where a decode step's GPU time goes" + (f" ({args.kv_dtype} caches)" if args.kv_dtype else "")
    print(write_section(args.section, "\n".join(lines), heading=heading))


if __name__ == "__main__":
    main()
