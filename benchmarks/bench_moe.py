"""Grouped GEMMs for a mixture of experts' routed experts, by tokens per step and model shapes,
against the copy and matmul rates measured in the same run.

    python -m benchmarks.bench_moe [--models deepseek-v2-lite,qwen1.5-moe-a2.7b,qwen3-30b-a3b,mixtral-8x7b]
        [--tokens 1,8,32,128,512,2048] [--trials 20] [--fp8] [--table PATH] [--section NAME] [--smoke]

One MoE layer's routed experts (no router, no shared expert), random bf16 weights, each token routed
to k distinct experts drawn uniformly (seed 0; the timed calls cycle through ``ROUTINGS`` routings,
so that a call does not find its experts in L2 from the call before), by each of
``jaxattn.serve.models.experts``' strategies (``GEMMS``: "ragged_dot", three ``jax.lax.ragged_dot``
over the token copies grouped by expert; "dense", every expert on every token, E / k times the
FLOPs; "triton", the Triton grouped GEMM over expert-aligned blocks), and "tokamax"
(``tokamax.ragged_dot`` in place of ``jax.lax.ragged_dot``) where tokamax is installed
(``scripts/fetch_moe_wheels.sh`` fetches it and what it imports for the GPU machine). Per row: GPU
time per call (the profiler; median wall time on a CPU), the experts the tokens touch, the fastest
variant and the one ``choose_gemm`` takes for the models ("auto"), the fastest's touched experts'
weight bytes over its time as a share of the copy rate and its routed FLOPs (2 x 3 x dim x F x k per
token) over its time as a share of the matmul rate, and the fastest against ragged_dot. ``--fp8``
runs the same on FP8 expert stacks as the model holds them (per-channel scales, each kernel
transposed: ``quantization.Fp8Experts``; the Triton kernel reads FP8 and multiplies FP8 rows,
quantized per row, FP8 x FP8 (``grouped_gemm``'s docstring says which MMAs), dense converts
them and scales its products, ragged_dot dequantizes first). Writes the ``--section`` section of
benchmarks/RESULTS.md (default "moe_grouped_gemm", with ``--fp8`` "moe_grouped_gemm_fp8");
``--smoke`` runs tiny shapes (CPU, seconds) and writes only ``$OUT``. ``--table PATH`` also writes
the measured table that ``choose_gemm`` reads (``jaxattn.serve.models.expert_gemm_table``;
``jaxattn/tuning/moe_sm_90.json`` for an H100 or H200), keeping the entries of other keys that PATH
holds (a ``--fp8`` run adds its entries to a bf16 run's).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import itertools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, device_name, device_seconds, gemm_rate, rel_error, write_section
from jaxattn.choice_table import current_arch
from jaxattn.serve.models import expert_gemm_table
from jaxattn.serve.models.experts import GEMMS, choose_gemm, routed_experts
from jaxattn.serve.models.quantization import Fp8Experts


@dataclasses.dataclass(frozen=True)
class Shape:
    """One MoE layer's routed experts: ``experts`` of hidden size ``hidden``, ``k`` per token;
    ``shared``: the groups of ``hidden`` units of its shared expert, which ``fusion`` adds to the
    stacks as experts every token takes (the Engine's default without tensor parallelism; timed by
    ``tune_grouped_gemm``, not by this benchmark of the routed experts)."""
    dim: int
    hidden: int
    experts: int
    k: int
    shared: int = 0


SHAPES = {"deepseek-v2-lite": Shape(2048, 1408, 64, 6, shared=2),
          "qwen1.5-moe-a2.7b": Shape(2048, 1408, 60, 4, shared=4),
          "qwen3-30b-a3b": Shape(2048, 768, 128, 8), "mixtral-8x7b": Shape(4096, 14336, 8, 2)}
SMOKE = {"tiny": Shape(64, 32, 8, 2, shared=1)}
ROUTINGS = 8                # routings the timed calls cycle through (seeds 0 .. ROUTINGS - 1)


def tokamax_experts() -> Callable | None:
    """``routed_experts`` with tokamax's ``ragged_dot``, or None where tokamax is not installed."""
    if importlib.util.find_spec("tokamax") is None:
        return None
    import tokamax

    return functools.partial(routed_experts, ragged_dot=tokamax.ragged_dot)


def routing(shape: Shape, tokens: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(weights float64[T, k], chosen int32[T, k])``: k distinct experts per token, uniform."""
    rng = np.random.default_rng(seed)
    chosen = np.argsort(rng.random((tokens, shape.experts)), axis=1)[:, :shape.k].astype(np.int32)
    return rng.dirichlet(np.ones(shape.k), size=tokens), chosen


def inputs(shape: Shape, tokens: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """``(x, weights, chosen, gate_proj, up_proj, down_proj)`` in bf16, uniform routing."""
    weights, chosen = routing(shape, tokens, seed)
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (tokens, shape.dim), jnp.bfloat16)
    scale = shape.dim ** -0.5
    gate, up = (jax.random.normal(key, (shape.experts, shape.dim, shape.hidden), jnp.bfloat16) * scale
                for key in keys[1:3])
    down = jax.random.normal(keys[3], (shape.experts, shape.hidden, shape.dim), jnp.bfloat16) * shape.hidden ** -0.5
    return x, jnp.asarray(weights, jnp.bfloat16), jnp.asarray(chosen), gate, up, down


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_moe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES),
                        help="model shapes, comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--tokens", default="1,8,32,128,512,2048", help="tokens per call, comma-separated")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--fp8", action="store_true", help="FP8 experts (per-channel scales, experts.Fp8Stack): "
                                                           "the section moe_grouped_gemm_fp8")
    parser.add_argument("--table", metavar="PATH", help="also write the measured table choose_gemm reads there "
                                                        "(jaxattn/tuning/moe_sm_90.json), keeping its other entries")
    parser.add_argument("--section", help="the RESULTS.md section written (default: moe_grouped_gemm, with --fp8 "
                                          "moe_grouped_gemm_fp8)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, seconds); RESULTS.md is left alone")
    args = parser.parse_args(argv)
    section = args.section or ("moe_grouped_gemm_fp8" if args.fp8 else "moe_grouped_gemm")
    shapes = SMOKE if args.smoke else {name: SHAPES[name] for name in args.models.split(",")}
    tokens = [1, 4] if args.smoke else [int(t) for t in args.tokens.split(",")]
    if args.smoke:
        copy_rate, matmul_rate = copy_bandwidth(1 << 24, trials=3), gemm_rate(256, jnp.float32, trials=3)
    else:
        copy_rate, matmul_rate = copy_bandwidth(), gemm_rate()
    variants = {gemm: functools.partial(routed_experts, gemm=gemm) for gemm in GEMMS}
    if (tokamax := tokamax_experts()) is not None:
        variants["tokamax"] = tokamax
    compiled = {name: jax.jit(fn) for name, fn in variants.items()}
    columns = ["model", "tokens", "experts touched", *[f"{name} us" for name in variants], "fastest", "auto takes",
               "fastest % of copy rate", "fastest % of matmul rate", "fastest vs ragged_dot"]
    rows, errors, entries = [], [], []
    for model, shape in shapes.items():
        expert_bytes = 3 * shape.dim * shape.hidden * (1 if args.fp8 else 2)
        for count in tokens:
            operands = inputs(shape, count)
            # the calls cycle through ROUTINGS routings: a call's experts are not in L2 from the one before
            routings = itertools.cycle([operands[2], *(jnp.asarray(routing(shape, count, seed)[1])
                                                       for seed in range(1, ROUTINGS))])
            if args.fp8:
                # the model's FP8 stacks, as its Fp8Experts hold them
                operands = (*operands[:3], *(Fp8Experts.from_stack(w, (None, None, None)).stack()
                                             for w in operands[3:]))
            touched = len(np.unique(np.asarray(operands[2])))
            reference = compiled["ragged_dot"](*operands)
            seconds = {}
            for name, fn in compiled.items():
                errors.append(rel_error(fn(*operands), reference))
                seconds[name] = device_seconds(lambda: fn(*operands[:2], next(routings), *operands[3:]), args.trials)
            fastest = min(seconds, key=seconds.get)
            key = expert_gemm_table.Key("fp8" if args.fp8 else "bf16", shape.experts, shape.k, shape.dim, shape.hidden,
                                        count)
            entries.append(expert_gemm_table.Entry(key, tuple(sorted(seconds, key=seconds.get)),
                                                   {name: round(1e6 * s, 1) for name, s in seconds.items()}))
            flops = 2 * 3 * shape.dim * shape.hidden * shape.k * count
            cells = [model, str(count), f"{touched} / {shape.experts}", *[f"{1e6 * s:.1f}" for s in seconds.values()],
                     fastest, choose_gemm(count, shape.experts, shape.k, shape.dim, shape.hidden, args.fp8),
                     f"{100 * touched * expert_bytes / seconds[fastest] / copy_rate:.0f}%",
                     f"{100 * flops / seconds[fastest] / matmul_rate:.0f}%",
                     f"{seconds['ragged_dot'] / seconds[fastest]:.2f}x"]
            rows.append("| " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    command = (f"python -m benchmarks.bench_moe --models {','.join(shapes)} --tokens {','.join(map(str, tokens))} "
               f"--trials {args.trials}" + (" --fp8" if args.fp8 else "") + (" --smoke" if args.smoke else "")
               + (f" --table {args.table}" if args.table else "") + (f" --section {section}" if args.section else ""))
    if args.table:
        write_table(args.table, command, entries)
    weights = "FP8 experts (per-channel scales; triton: FP8 rows, per-row scales)" if args.fp8 else "bf16"
    lines = [
        f"Device: {device_name()}; date {datetime.date.today()}; jax {jax.__version__}; "
        f"{weights}; one MoE layer's routed "
        f"experts, uniform random routing (seed 0; timed over {ROUTINGS} routings in turn); copy rate "
        f"{copy_rate / 1e9:,.0f} GB/s (read + write), matmul "
        f"rate {matmul_rate / 1e12:.3g} TFLOP/s, measured in the same run. tokamax "
        f"{'measured' if 'tokamax' in variants else 'not installed: not measured'}.",
        f"Command: `{command}`",
        "",
        "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows,
        "",
        "us: GPU time per call (profiler). % of copy rate: the touched experts' weight bytes / the fastest's time "
        "over the copy rate; % of matmul rate: 2 x 3 x "
        f"dim x F x k FLOPs per token / time. Largest relative difference from ragged_dot's output: {max(errors):.1e}.",
    ]
    print(write_section(section, "\n".join(lines),
                        update=not args.smoke, heading="Grouped GEMMs of a mixture of experts (benchmarks/bench_moe.py)"
                        + (": FP8 experts" if args.fp8 else "")))


def write_table(path: str, command: str, entries: list[expert_gemm_table.Entry]) -> None:
    """Writes ``path``: this run's entries, then those of other keys that ``path`` holds."""
    new = expert_gemm_table.Table(arch=current_arch() or "cpu", command=command, device=device_name(),
                                  date=str(datetime.date.today()), jax=jax.__version__, comment="",
                                  entries=tuple(entries))
    old = expert_gemm_table.load(path) if os.path.exists(path) else None
    expert_gemm_table.dump(expert_gemm_table.merged(old, new), path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
