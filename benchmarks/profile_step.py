"""Per-kernel profile of the engine's decode step (Llama-3-8B shapes, random weights): where a
step's GPU time goes, by kind of kernel, against what each kind must move.

    python -m benchmarks.profile_step [--layers 32] [--batch 64] [--contexts 1024,4096] [--backend auto]
                                      [--kv-dtype float8_e4m3fn] [--max-seq-len 2048] [--section NAME]
    python -m benchmarks.profile_step --mixed 155+1x512,124+32x16 [--rows 156] [--max-step-tokens 2048]
                                      [--contexts 512] --section step_profile_mixed

For each context: the GPU time of one step (``steps`` chained steps under the profiler, divided by
``steps``) per kernel name, grouped into kinds by name: GEMMs (the weight reads at decode batch
sizes), attention, KV writes (XLA's scatters into the pools), sampling / logits (argmax over the
vocabulary), and XLA's other fusions (norms, RoPE, residuals, page-table bookkeeping). The step's
roofline and each kind's bound count bytes and FLOPs (``bench_serving.step_bound``, with the copy
rate and the matmul rate of an 8192^3 GEMM measured in the same run): GEMMs, the weight bytes or
2 x params x the step's tokens, whichever takes longer (at 256 rows an H200's GEMMs are
compute-bound); attention, its K/V bytes or its FLOPs; the rest, 0. Each kind also says how many
kernels it launches per step: the attention work that is not a kernel of its own (metadata,
operand preparation) shows as launches that grow with the layer count. The block tables are as
wide as the context needs, or ``--max-seq-len`` keys when given (the engine's tables: what
``auto`` chooses by). Writes the step_profile section of benchmarks/RESULTS.md (``--section``:
another).

``--mixed D+CxN,...`` profiles the engine's mixed steps instead (``engine_step.mixed_step``): D
decodes and C prompt chunks of N tokens each in a step of ``--rows`` rows (the engine's
``max_seqs``) and the smallest of the engine's mixed-step token buckets that holds them
(``step.mixed_buckets(rows, --max-step-tokens)``), its ``max_q_len`` the engine's (``min(tokens,
--prefill-chunk)``), every sequence at each ``--contexts``, in block tables ``--max-seq-len``
keys wide; each profiled call redoes the same step (the table is not advanced). Its bounds
count the tokens the step needed (its padding is overhead).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import re

import jax
from flax import nnx

from benchmarks.common import (
    PAGE,
    copy_bandwidth,
    device_events,
    device_name,
    gemm_rate,
    write_section,
)
from benchmarks.engine_step import decode_step, mixed_step, step_record
from jaxattn.serve.engine import DEFAULT_PREFILL_CHUNK
from jaxattn.serve.models.llama import PRESETS, Llama
from jaxattn.serve.step import mixed_buckets

# (kind, pattern of kernel names), first match wins
KINDS = [
    ("attention", r"xqa|fmha|attn|attention|mha|flash|paged|cudnn|mla_"),
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
            fuse_projections: bool = True, width: int = 0) -> tuple[dict[str, tuple[float, float]], list]:
    """((GPU seconds, launches) per step by kernel name, the step's weights; ``width``:
    ``decode_step``'s)."""
    model_step, state, weights, _ = decode_step(model, backend, batch, context, steps, kv_dtype=kv_dtype,
                                                fuse_projections=fuse_projections, width=width)
    return profile_chain(model_step, state, steps), weights


def parse_mixed(text: str) -> list[tuple[int, int, int]]:
    """``--mixed``'s ``D+CxN`` specs as ``(decodes, chunks, chunk)``."""
    specs = []
    for spec in text.split(","):
        match = re.fullmatch(r"(\d+)\+(\d+)x(\d+)", spec.strip())
        if not match:
            raise ValueError(f"--mixed: expected D+CxN (decodes + chunks x chunk tokens), got {spec!r}")
        specs.append(tuple(int(g) for g in match.groups()))
    return specs


def mixed_shapes(text: str, rows: int, max_step_tokens: int) -> list[tuple[int, int, int, int]]:
    """``--mixed``'s specs with the token bucket each runs in, ``(decodes, chunks, chunk, tokens)``:
    the smallest of ``step.mixed_buckets(rows, max_step_tokens)`` that holds it."""
    buckets = mixed_buckets(rows, max_step_tokens)
    shapes = []
    for decodes, chunks, chunk in parse_mixed(text):
        tokens = next((t for t in buckets if t >= decodes + chunks * chunk), None)
        if tokens is None:
            raise ValueError(f"--mixed: {decodes}+{chunks}x{chunk} is more than {max_step_tokens} tokens")
        shapes.append((decodes, chunks, chunk, tokens))
    return shapes


def step_bounds(model: Llama, record, copy_rate: float, matmul_rate: float,
                kv_dtype=None) -> tuple[float, dict[str, float]]:
    """A step's roofline (``bench_serving.step_bound`` of its ``StepRecord``) and its GEMM and
    attention bounds."""
    from benchmarks.bench_serving import model_costs, step_bound      # bench_serving imports this module

    costs = model_costs(model, PAGE, kv_dtype)
    gemm_flops = 2 * costs.matmul_params * record.tokens + 2 * costs.head_params * record.rows
    kv_bytes = (record.context_tokens + record.tokens) * costs.kv_bytes_per_token
    return step_bound(record, costs, copy_rate, matmul_rate), {
        "GEMM": max(costs.weight_bytes / copy_rate, gemm_flops / matmul_rate),
        "attention": max(kv_bytes / copy_rate, costs.flops_per_pair * record.attention_pairs / matmul_rate)}


def profile_chain(model_step, state, steps: int) -> dict[str, tuple[float, float]]:
    """(GPU seconds, launches) per step by kernel name of ``steps`` chained ``model_step`` calls."""
    for _ in range(3):
        state = jax.block_until_ready(model_step(state))
    box = [state]

    def call():
        box[0] = model_step(box[0])
        return box[0]

    return device_events(call, steps)


def report(title: str, events: dict[str, tuple[float, float]], roofline: float, bounds: dict[str, float],
           top: int) -> list[str]:
    """One step's profile: its GPU time against ``roofline``, by kind against ``bounds``, and its
    ``top`` kernels."""
    seconds = {name: s for name, (s, _) in events.items()}
    launches = {name: n for name, (_, n) in events.items()}
    total = sum(seconds.values())
    kinds = by_kind(events)
    lines = [f"**{title}**: GPU time {total * 1e3:.2f} ms per step; roofline {roofline * 1e3:.2f} ms "
             f"({100 * roofline / total:.0f}% of the GPU time); {sum(launches.values()):.0f} launches per step.",
             "", "| kind | ms per step | share | bound ms | kernels | launches per step |",
             "|---|---|---|---|---|---|"]
    for kind, (s, n, kernels) in kinds.items():
        lines.append(f"| {kind} | {s * 1e3:.3f} | {100 * s / total:.1f}% | {bounds.get(kind, 0.0) * 1e3:.3f} "
                     f"| {kernels} | {n:.0f} |")
    lines += ["", "| kernel | kind | us per step | launches per step |", "|---|---|---|---|"]
    for name, s in sorted(seconds.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"| `{name[:90]}` | {kind_of(name)} | {s * 1e6:.1f} | {launches[name]:.0f} |")
    return lines + [""]


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
    parser.add_argument("--mixed", default="",
                        help="mixed steps instead of decode steps: comma-separated D+CxN (D decodes, C prompt chunks "
                             "of N tokens)")
    parser.add_argument("--rows", type=int, default=156, help="a mixed step's rows (the engine's max_seqs)")
    parser.add_argument("--max-step-tokens", type=int, default=2048, help="the engine's largest mixed step")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help="the engine's prefill_chunk: a mixed step's max_q_len is min(its tokens, this)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="the engine's max_seq_len: the block tables are this many keys wide (bench_serving's "
                             "chat and decode-heavy engines: 2048; default: 2048 for --mixed, else as the context "
                             "needs)")
    args = parser.parse_args(argv)
    if args.max_seq_len is not None and args.max_seq_len < 1:
        parser.error(f"--max-seq-len: expected a positive number of keys, got {args.max_seq_len}")
    if args.mixed and args.max_seq_len is None:
        args.max_seq_len = 2048
    # checked before anything is measured: a bad spec must not cost the device time of the good ones
    shapes = mixed_shapes(args.mixed, args.rows, args.max_step_tokens) if args.mixed else []
    cfg = PRESETS[args.preset].replace(num_layers=args.layers)
    model = Llama(cfg, nnx.Rngs(0))
    bandwidth, matmul_rate = copy_bandwidth(), gemm_rate()
    lines = [f"Device: {device_name()}; date {datetime.date.today()}; jax {jax.__version__}; {args.preset} shapes, "
             f"{cfg.num_layers} layers, {f'mixed steps of {args.rows} rows' if args.mixed else f'batch {args.batch}'}, "
             f"backend {args.backend}, "
             f"{args.kv_dtype or cfg.dtype} caches, q/k/v and gate/up projections "
             f"{'apart' if args.unfused else 'fused'}; copy rate {bandwidth / 1e12:.2f} TB/s, matmul rate "
             f"{matmul_rate / 1e12:.0f} TFLOP/s (bf16 8192^3 GEMM), same run.",
             f"Command: `python -m benchmarks.profile_step --preset {args.preset} --layers {args.layers} "
             + (f"--mixed {args.mixed} --rows {args.rows} --max-step-tokens {args.max_step_tokens} "
                f"--prefill-chunk {args.prefill_chunk} --max-seq-len {args.max_seq_len} " if args.mixed
                else f"--batch {args.batch} " + (f"--max-seq-len {args.max_seq_len} " if args.max_seq_len else ""))
             + f"--contexts {args.contexts} --backend {args.backend}"
             f"{f' --kv-dtype {args.kv_dtype}' if args.kv_dtype else ''}{' --unfused' if args.unfused else ''}`", ""]
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.mixed:
        for context in contexts:
            for decodes, chunks, chunk, tokens in shapes:
                model_step, state, weights, record = mixed_step(model, args.backend, args.rows, tokens, decodes,
                                                                chunks, chunk, context, args.max_seq_len, args.kv_dtype,
                                                                not args.unfused, min(tokens, args.prefill_chunk))
                roofline, bounds = step_bounds(model, record, bandwidth, matmul_rate, args.kv_dtype)
                lines += report(f"{decodes} decodes + {chunks} x {chunk} prompt tokens at context {context}, "
                                f"a step of {args.rows} rows x {tokens} tokens ({record.tokens} needed)",
                                profile_chain(model_step, state, args.steps), roofline, bounds, args.top)
                del model_step, state, weights
                gc.collect()
                print("\n".join(lines[-(args.top + 16):]), flush=True)
        heading = "Where a mixed step's GPU time goes"
        print(write_section(args.section, "\n".join(lines), heading=heading))
        return
    for context in contexts:
        events, weights = profile(model, args.backend, args.batch, context, args.steps, args.kv_dtype,
                                  not args.unfused, args.max_seq_len or 0)
        record = step_record(args.batch, 0, 1, context, args.batch, args.batch)
        lines += report(f"Context {context}", events,
                        *step_bounds(model, record, bandwidth, matmul_rate, args.kv_dtype), args.top)
        del weights
        gc.collect()                 # the next context's caches need this one's memory
        print("\n".join(lines[-(args.top + 16):]), flush=True)
    heading = "Where a decode step's GPU time goes" + (f" ({args.kv_dtype} caches)" if args.kv_dtype else "")
    print(write_section(args.section, "\n".join(lines), heading=heading))


if __name__ == "__main__":
    main()
