"""Launch-configuration sweep for the Triton grouped GEMM of a mixture of experts (one device run).

    python -m benchmarks.tune_grouped_gemm [--model deepseek-v2-lite] [--tokens 1,512] [--trials 10]
        [--block-rows 64,128] [--configs LABEL,...] [--shared N] [--table jaxattn/tuning/grouped_gemm_sm_90.json]
        [--smoke]

``jaxattn.kernels.grouped_gemm`` alone (no routing or combine), at one model's expert shapes
(``benchmarks.bench_moe.SHAPES``): SwiGLU's gate and up (``dim x F``, two weight stacks; since
2026-12-07 evening each block row gathered from the tokens' rows, a random token each, as the model
runs it: the earlier entries were timed over rows in block order) and down (``F x dim``), bf16 and
FP8 weights (per-channel scales; as the model runs them, each expert's kernel transposed and the
rows FP8, quantized per row outside the timed call), the token copies spread evenly over the
experts they touch (``min(E, tokens k)``) and every token's copy to each group of the shared
expert that ``fusion`` appends to the stacks (``--shared``, default the model's: DeepSeek-V2-Lite's
two; the runs before the option timed the routed copies only), in the blocks ``routed_experts``
would make (``--block-rows``: blocks of other sizes, to weigh them).
Every configuration of ``CONFIGS`` is timed (GPU time per call from the profiler, median of
``--trials``); one that needs more shared memory than the GPU has, or that Triton does not
compile, is reported as such. The calls
cycle through ``ROTATIONS`` placements of the blocks over the experts, so that a call does not find
its weights in L2 from the call before (the 2026-11-27 table predates this: at 1 token its weights
partly stayed in the H100's 50 MB L2). Writes the grouped-gemm-tiles section of benchmarks/TUNING.md
(``--smoke``: tiny shapes on the CPU, only ``$OUT``); ``--table PATH`` also writes the fastest per
case to the measured table ``grouped_gemm.choose_tiles`` reads (``jaxattn.kernels.grouped_gemm_table``;
a run keeps the file's entries of other keys).
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from benchmarks.bench_moe import SHAPES, SMOKE
from benchmarks.common import (TUNING, command_line, copy_bandwidth, device_name, device_seconds, utc_now,
                               write_section)
from jaxattn import choice_table
from jaxattn.kernels import grouped_gemm_table
from jaxattn.kernels.grouped_gemm import Tiles, default_tiles, grouped_gemm, quantize_rows
from jaxattn.serve.models.experts import block_rows, num_blocks

CONFIGS = (Tiles(64, 64, 4, 3), Tiles(32, 128, 4, 4), Tiles(32, 256, 4, 3), Tiles(64, 128, 4, 4),
           Tiles(128, 64, 4, 4), Tiles(64, 256, 8, 3), Tiles(16, 256, 4, 4), Tiles(128, 128, 8, 3),
           Tiles(64, 128, 4, 4, swap_ab=True), Tiles(128, 128, 4, 3, swap_ab=True), Tiles(128, 128, 8, 3, swap_ab=True),
           Tiles(64, 256, 4, 4, swap_ab=True), Tiles(128, 256, 4, 2, swap_ab=True),
           Tiles(128, 64, 8, 4), Tiles(256, 64, 8, 3), Tiles(128, 64, 4, 4, block_tiles_first=True),
           Tiles(256, 64, 8, 3, block_tiles_first=True), Tiles(128, 128, 8, 3, block_tiles_first=True),
           Tiles(64, 256, 4, 4, swap_ab=True, block_tiles_first=True))
ROTATIONS = 8               # placements of the blocks over the experts the timed calls cycle through


def block_experts(tokens: int, experts: int, k: int, block_m: int, shared: int = 0) -> np.ndarray:
    """``int32[blocks]``: the expert of each block when ``tokens k`` copies spread evenly over
    ``min(E, tokens k)`` experts and each of ``shared`` more experts (``E .. E + shared - 1``, a
    shared expert fused into the stacks) takes every token; -1 past the last group
    (``routed_experts``' block count over ``E + shared`` experts, ``k + shared`` per token)."""
    copies = tokens * k
    touched = min(experts, copies)
    blocks = num_blocks(tokens, experts + shared, k + shared, block_m)
    per_expert = [copies // touched + (e < copies % touched) for e in range(touched)] + [0] * (experts - touched) + \
        [tokens] * shared
    used = np.concatenate([np.full(-(-c // block_m), e, np.int32) for e, c in enumerate(per_expert)])
    return np.concatenate([used, np.full(blocks - used.size, -1, np.int32)])


def placements(tokens: int, experts: int, k: int, block_m: int, shared: int = 0) -> list[jax.Array]:
    """``ROTATIONS`` placements of ``block_experts``' blocks over the routed experts (each shifted
    by the touched experts' count; the shared experts stay the stacks' last), which the timed calls
    cycle through so that a call does not find its weights in L2 from the call before."""
    blocks = block_experts(tokens, experts, k, block_m, shared)
    touched = min(experts, tokens * k)
    routed = (blocks >= 0) & (blocks < experts)
    return [jnp.asarray(np.where(routed, (blocks + i * touched) % experts, blocks).astype(np.int32))
            for i in range(ROTATIONS)]


def token_rows(rng: np.random.Generator, tokens: int, block_expert: jax.Array, block_m: int) -> jax.Array:
    """``int32[blocks x block_m]``: a random token for each row of the used blocks, -1 (padding) for
    the rest: the ``row_index`` by which gate and up gather their rows from ``[tokens, K]``."""
    used = np.repeat(np.asarray(block_expert) >= 0, block_m)
    return jnp.asarray(np.where(used, rng.integers(0, tokens, used.size), -1).astype(np.int32))


def time_placements(run: Callable, rows: jax.Array, turns: list[jax.Array], stacks: list[jax.Array],
                    trials: int, what: object) -> float | None:
    """Seconds per call of the jitted ``run(rows, block_expert, *stacks)``, the calls cycling
    through the placements ``turns``; None (and a line naming ``what``) where it needs more shared
    memory than the GPU has or Triton does not compile it."""
    try:
        run(rows, turns[0], *stacks).block_until_ready()
    except (jax.errors.JaxRuntimeError, CompilationError, OutOfResources) as error:
        print(f"{what}: {str(error).splitlines()[0][:160]}", flush=True)
        return None
    cycle = itertools.cycle(turns)
    return device_seconds(lambda: run(rows, next(cycle), *stacks), trials)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_grouped_gemm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v2-lite", choices=list(SHAPES))
    parser.add_argument("--tokens", default="1,512", help="tokens per call, comma-separated")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--block-rows", default="", help="rows per block timed, comma-separated (default: the "
                                                        "model's, experts.block_rows at each token count)")
    parser.add_argument("--weights", default="bf16,fp8", help="the weights timed, comma-separated: bf16, fp8")
    parser.add_argument("--table", metavar="PATH", help="also write the measured table choose_tiles reads there "
                                                        "(jaxattn/tuning/grouped_gemm_sm_90.json), keeping its "
                                                        "other entries")
    parser.add_argument("--configs", default="", help="only these configurations of CONFIGS, by their labels, "
                                                     "comma-separated: e.g. '256x64 w8 s3,256x64 w8 s3 by block'")
    parser.add_argument("--shared", type=int, default=None,
                        help="experts every token takes besides its k (a shared expert fused into the stacks, "
                             "in groups of the experts' hidden size; default: the model's, bench_moe.Shape.shared; "
                             "0: the routed experts alone, as the runs before this option timed them)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and configurations (CPU, seconds)")
    args = parser.parse_args(argv)
    shape = next(iter(SMOKE.values())) if args.smoke else SHAPES[args.model]
    shared = shape.shared if args.shared is None else args.shared
    if shared < 0:
        parser.error(f"--shared must be >= 0, got {shared}")
    configs = (Tiles(32, 32, 4, 1), Tiles(64, 32, 4, 1), Tiles(32, 32, 4, 1, swap_ab=True),
               Tiles(32, 32, 4, 1, block_tiles_first=True)) if args.smoke else CONFIGS
    if args.configs:
        wanted = args.configs.split(",")
        unknown = set(wanted) - {label(t) for t in configs}
        if unknown:
            parser.error(f"--configs: no configuration labelled {', '.join(sorted(unknown))}; the labels: "
                         f"{', '.join(label(t) for t in configs)}")
        configs = tuple(t for t in configs if label(t) in wanted)
    rng = np.random.default_rng(0)
    kinds = args.weights.split(",")
    if not set(kinds) <= set(grouped_gemm_table.WEIGHTS):
        parser.error(f"--weights takes {', '.join(grouped_gemm_table.WEIGHTS)}, got {args.weights}")
    earlier = grouped_gemm_table.load(args.table) if args.table and os.path.exists(args.table) else None
    copy_rate = copy_bandwidth(1 << 24, trials=3) if args.smoke else copy_bandwidth()
    rows_out, entries = [], []
    experts = shape.experts + shared        # the stacks' experts, shared groups last
    cases = [(tokens, block_m) for tokens in (int(t) for t in args.tokens.split(","))
             for block_m in ([int(b) for b in args.block_rows.split(",")] if args.block_rows
                             else [block_rows(tokens, experts, shape.k + shared)])]
    for tokens, block_m in cases:
        turns = placements(tokens, shape.experts, shape.k, block_m, shared)
        block_expert = turns[0]
        for fp8 in (kind == "fp8" for kind in kinds):
            for k, n, swiglu in ((shape.dim, shape.hidden, True), (shape.hidden, shape.dim, False)):
                # as routed_experts runs them: gate and up gather each block row from the tokens' rows
                scales = {"row_index": token_rows(rng, tokens, block_expert, block_m)} if swiglu else {}
                rows = jnp.asarray(rng.normal(size=(tokens if swiglu else block_expert.size * block_m, k)),
                                   jnp.bfloat16)
                dtype, magnitude = (jnp.float8_e4m3fn, 8.0) if fp8 else (jnp.bfloat16, k ** -0.5)
                stacks = [jnp.asarray(rng.normal(size=(experts, k, n)) * magnitude, dtype)
                          for _ in range(2 if swiglu else 1)]
                if fp8:     # as routed_experts runs FP8 experts: "enk" stacks (Fp8Experts'), FP8 rows
                    stacks = [jnp.swapaxes(w, 1, 2).copy() for w in stacks]
                    rows, row_scale = quantize_rows(rows)
                    scale = jnp.full((experts, 1, n), k ** -0.5 / magnitude, jnp.float32)
                    scales.update(scale=scale, scale_block=(k, 1), row_scale=row_scale, weight_layout="enk",
                                  out_dtype=jnp.bfloat16, **({"up_scale": scale} if swiglu else {}))
                times = {}
                for tiles in configs:
                    run = jax.jit(lambda r, b, *w, tiles=tiles: grouped_gemm(r, b, *w, block_m=block_m, tiles=tiles,
                                                                               **scales))
                    seconds = time_placements(run, rows, turns, stacks, args.trials, tuple(tiles))
                    if seconds is not None:
                        times[tiles] = seconds
                fastest = min(times, key=times.get)
                key = grouped_gemm_table.Key("fp8" if fp8 else "bf16", swiglu, block_m, k, n)
                entries.append(grouped_gemm_table.Entry(key, fastest, {label(t): round(1e6 * s, 1)
                                                                       for t, s in times.items()}))
                chosen = default_tiles(fp8_enk=fp8)     # per-channel FP8 scales: no scale depth
                weight_bytes = (min(shape.experts, tokens * shape.k) + shared) * sum(w[0].nbytes for w in stacks)
                cells = [str(tokens), "bf16" if not fp8 else "FP8", f"{k} x {n}" + (" SwiGLU" if swiglu else ""),
                         str(block_m), str(block_expert.size),
                         *[f"{1e6 * times[t]:.1f}" if t in times else "failed" for t in configs],
                         str(tuple(fastest)), f"{weight_bytes / times[fastest] / copy_rate:.0%}",
                         f"{times[chosen] / times[fastest]:.2f}" if chosen in times else "-"]
                rows_out.append("| " + " | ".join(cells) + " |")
                print(rows_out[-1], flush=True)
                # after every case, so that a run cut short leaves what it measured
                if args.table:
                    write_table(args.table, earlier, entries)
                write_tuning(configs, rows_out, copy_rate, args)


def write_tuning(configs: tuple[Tiles, ...], rows: list[str], copy_rate: float, args: argparse.Namespace) -> None:
    """The grouped-gemm-tiles section of benchmarks/TUNING.md (``--smoke``: ``$OUT`` only)."""
    columns = ["tokens", "weights", "K x N", "block rows", "blocks", *[f"{label(t)} us" for t in configs],
               "fastest (block_n, block_k, warps, stages, swap_ab, block_tiles_first)", "fastest % of copy rate",
               "default_tiles / fastest"]
    lines = [f"Device: {device_name()}; {utc_now()}; jax {jax.__version__}; model shapes {args.model}; GPU time per "
             "call (profiler), median of the trials; failed: needs more shared memory than the GPU has, or did not "
             "compile (swap: Tiles.swap_ab). % of copy rate: the touched experts' weight bytes over the fastest's "
             f"time, against the copy rate measured in the same run, {copy_rate / 1e9:,.0f} GB/s (read + write).",
             f"Command: `{command_line()}`", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows]
    write_section("grouped-gemm-tiles", "\n".join(lines), path=TUNING, update=not args.smoke,
                  heading="Triton grouped GEMM launch configurations (benchmarks/tune_grouped_gemm.py)")


def label(tiles: Tiles) -> str:
    """A configuration's name in the table and its column: "128x64 w4 s4", "... swap", "... by block"
    (``Tiles.block_tiles_first``)."""
    return f"{tiles.block_n}x{tiles.block_k} w{tiles.num_warps} s{tiles.num_stages}" + \
        (" swap" if tiles.swap_ab else "") + (" by block" if tiles.block_tiles_first else "")


def write_table(path: str, earlier: grouped_gemm_table.Table | None,
                entries: list[grouped_gemm_table.Entry]) -> None:
    """Writes ``path``: this run's entries, then those of other keys that it held before the run
    (``earlier``)."""
    new = grouped_gemm_table.Table(arch=choice_table.current_arch() or "cpu", command=command_line(),
                                   device=device_name(), date=utc_now(), jax=jax.__version__, comment="",
                                   entries=tuple(entries))
    grouped_gemm_table.dump(choice_table.merged_entries(earlier, new), path)


if __name__ == "__main__":
    main()
