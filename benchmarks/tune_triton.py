"""Block-size sweep for jaxattn's Triton kernels, timed with CUDA events (one device run).

    python -m benchmarks.tune_triton [--head-dims 128,64,256] [--quick] [--short]
    python -m benchmarks.tune_triton --decode-points 1x512,1x4096,2x4096,4x4096,1x32768

The kernels of ``jaxattn.kernels.triton_attention`` are launched directly from torch (the device
image has it) with the same arguments ``jaxattn.backends.triton`` passes, and timed with
``triton.testing.do_bench`` (CUDA events, L2 flushed before each call, median). Every candidate
is compiled first, in parallel worker processes (``JITFunction.warmup`` fills Triton's on-disk
cache). Each table's best candidates are then timed again in interleaved rounds, and the table
reports the median over rounds and the spread (max - min) / median; a difference smaller than the
spread is noise.

Points (bf16, Hq=32, Hkv=8, page 64, HND pool randomly permuted, causal):
  decode   B=64 x kv 4096 (the issue's decode point) and B=8 x kv 4096: decode + reduce kernels
  prefill  B=8 x 4096 new tokens: the 2D kernel
  mixed    63 decodes at kv 4096 + one 8192-token prefill: the 2D kernel's part of a split launch
           (the prefill); then, at each table's winner, split (decode + reduce + 2D) against one 2D
           launch over the whole batch with our prefill tiles and with vLLM's decode tiles.
  short    (``--short``, instead of the above) B=64 and B=8 sequences verifying 4 or 16 draft
           tokens at kv 4096: the 2D kernel's tiles for speculative-decode steps.
  decode   (``--decode-points BxKV,...``, instead of the above) decode-only batches of B sequences
           at KV length KV: the decode + reduce kernels' tiles and KV segments (at B <= 4, 1 to 128
           segments of 16- to 64-key tiles: the tiny decodes whose split ``decode_config`` sets by
           a rule, at least 8 tiles a segment).
Writes the triton-tiles (``--short``: triton-short-tiles; ``--decode-points``: triton-decode-tiles)
section of benchmarks/TUNING.md (``--quick``: only ``$OUT``) and prints it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import math
import multiprocessing
import os
import statistics
import time

from benchmarks.common import HKV, HQ, PAGE, TUNING, block_tables, command_line, utc_now, write_section

# vLLM's unified kernel: BLOCK_M 16 for every batch, 32-key tiles (block_m, block_n, warps, stages).
VLLM_TILES = (16, 32, 4, 2)

DECODE_POINTS = (("decode B=64 x kv 4096", 64, 4096), ("decode B=8 x kv 4096", 8, 4096))
PREFILL_POINTS = (("prefill B=8 x 4096", (4096,) * 8, (4096,) * 8, 0),
                  ("mixed prefill part (63 decodes + 8192)", (1,) * 63 + (8192,), (4096,) * 63 + (8192,), 63))
# Short queries (speculative decode: every sequence verifies q_len drafts): the 2D kernel.
SHORT_POINTS = (("spec B=64 q_len 4 x kv 4096", (4,) * 64, (4096,) * 64, 0),
                ("spec B=64 q_len 16 x kv 4096", (16,) * 64, (4096,) * 64, 0),
                ("spec B=8 q_len 4 x kv 4096", (4,) * 8, (4096,) * 8, 0))


def pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: kernel name, grid, pointer dtypes (torch dtype names), constexprs, warps, stages."""

    kernel: str
    grid: tuple[int, int, int]
    dtypes: tuple[str, ...]
    constants: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class Batch:
    """A paged batch: query lengths, KV lengths (one per sequence), head dim."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    head_dim: int

    @property
    def tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def width(self) -> int:
        return max(-(-k // PAGE) for k in self.kv_lens)

    @property
    def num_pages(self) -> int:
        return 1 + sum(-(-k // PAGE) for k in self.kv_lens)

    @property
    def flops(self) -> float:
        pairs = sum(q * k - q * (q - 1) / 2 for q, k in zip(self.q_lens, self.kv_lens))
        return 4.0 * self.head_dim * HQ * pairs


def shared_constants(batch: Batch) -> dict:
    """The constexprs ``jaxattn.backends.triton.attention`` passes for a bf16 HND pool."""
    d = batch.head_dim
    return dict(T=batch.tokens, B=len(batch.q_lens), P=batch.width, HQ=HQ, G=HQ // HKV, D=d, D_P=pow2_ceil(d),
                PAGE=PAGE, NUM_PAGES=batch.num_pages, SK_P=HKV * PAGE * d, SK_H=PAGE * d, SK_T=d,
                SCALE=1 / math.sqrt(d), SOFTCAP=0.0, WINDOW=0, CAUSAL=True, FP8=False, DOT_F32=False,
                PRECISION="tf32")


def decode_launches(batch: Batch, block_n: int, nseg: int, warps: int, stages: int, mixed: bool) -> list[Launch]:
    """Decode kernel + reduce for the leading decodes (``mixed``) or a decode-only batch."""
    c = shared_constants(batch)
    b, group = len(batch.q_lens), HQ // HKV
    decode = dict(c, G_P=pow2_ceil(group), QT=1, BLOCK_M=max(16, pow2_ceil(group)), BLOCK_N=block_n, NSEG=nseg)
    reduce = {k: c[k] for k in "T B HQ G D D_P FP8".split()}
    reduce.update(LOG_B=(b + 1).bit_length() + 1, G_P=pow2_ceil(group), QT=1, NSEG=nseg, HAS_SINKS=False,
                  WRITE_ALL=not mixed)
    ptr = ("bfloat16",) * 3 + ("int32",) * 4 + ("float32",) * 4
    return [Launch("paged_decode_kernel", (b, HKV, nseg), ptr, tuple(sorted(decode.items())), warps, stages),
            Launch("paged_decode_reduce_kernel", (batch.tokens if not mixed else b, HKV, 1),
                   ("int32",) * 2 + ("float32",) * 5 + ("bfloat16",),
                   tuple(sorted(reduce.items())), 4, 1)]


def prefill_launch(batch: Batch, block_m: int, block_n: int, warps: int, stages: int) -> Launch:
    c = shared_constants(batch)
    b, g_p = len(batch.q_lens), pow2_ceil(HQ // HKV)
    block_m = max(block_m, g_p)
    c.update(LOG_B=(b + 1).bit_length() + 1, G_P=g_p, BLOCK_M=block_m, BLOCK_N=block_n, HAS_SINKS=False)
    ptr = ("bfloat16",) * 3 + ("int32",) * 4 + ("float32",) * 3 + ("bfloat16",) * 2
    grid = (batch.tokens // (block_m // g_p) + b + 2, HKV, 1)
    return Launch("paged_prefill_kernel", grid, ptr, tuple(sorted(c.items())), warps, stages)


def _compile(launch: Launch) -> str | None:
    """Worker: compile one launch into Triton's cache; returns an error line or None."""
    import torch
    from jaxattn.kernels import triton_attention as kernels
    try:
        getattr(kernels, launch.kernel).warmup(
            *(getattr(torch, d) for d in launch.dtypes), grid=launch.grid, num_warps=launch.num_warps,
            num_stages=launch.num_stages, **dict(launch.constants))
        return None
    except Exception as err:  # noqa: BLE001 (a config that does not compile is reported, not fatal)
        return f"{type(err).__name__}: {str(err).splitlines()[0][:80] if str(err) else ''}"


def compile_all(launches: list[Launch]) -> None:
    """Fills Triton's cache with every launch's kernel, in parallel processes."""
    unique = list(dict.fromkeys(launches))
    t0 = time.time()
    workers = max(1, min(len(unique), (os.cpu_count() or 2) - 2))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = [e for e in pool.map(_compile, unique) if e]
    print(f"compiled {len(unique)} kernels in {time.time() - t0:.0f} s with {workers} workers; "
          f"{len(errors)} failed{', first: ' + errors[0] if errors else ''}", flush=True)


class Problem:
    """Device tensors of one batch (torch, CUDA), shared by every launch over it."""

    def __init__(self, batch: Batch, num_decodes: int, seed: int = 0):
        import numpy as np
        import torch
        tables = block_tables(batch.kv_lens, seed)
        gen = torch.Generator("cuda").manual_seed(seed)
        dev = dict(device="cuda")
        shape = (batch.num_pages, HKV, PAGE, batch.head_dim)
        self.q = torch.randn(batch.tokens, HQ, batch.head_dim, generator=gen, dtype=torch.bfloat16, **dev)
        self.k = torch.randn(shape, generator=gen, dtype=torch.bfloat16, **dev)
        self.v = torch.randn(shape, generator=gen, dtype=torch.bfloat16, **dev)
        self.tables = torch.tensor(tables, **dev)
        self.kv_lens = torch.tensor(batch.kv_lens, dtype=torch.int32, **dev)
        self.cu = torch.tensor(np.concatenate([[0], np.cumsum(batch.q_lens)]), dtype=torch.int32, **dev)
        self.nd = torch.tensor([num_decodes], dtype=torch.int32, **dev)
        self.no_decodes = torch.zeros(1, dtype=torch.int32, **dev)
        self.sinks = torch.zeros(1, dtype=torch.float32, **dev)
        self.scale = torch.zeros(1, dtype=torch.float32, **dev)   # k_scale and v_scale (bf16 pages: unread)
        self.out = torch.zeros_like(self.q)
        self.batch = batch

    def runner(self, launches: list[Launch], single: bool = False):
        """A function running ``launches`` in order (decode, reduce, 2D) on this problem."""
        import torch
        from jaxattn.kernels import triton_attention as kernels
        calls = []
        for launch in launches:
            kernel = getattr(kernels, launch.kernel)[launch.grid]
            kw = dict(launch.constants, num_warps=launch.num_warps, num_stages=launch.num_stages)
            if launch.kernel == "paged_decode_kernel":
                nseg = dict(launch.constants)["NSEG"]
                b, d = len(self.batch.q_lens), self.batch.head_dim
                seg_acc = torch.empty(b, HQ, nseg, d, dtype=torch.float32, device="cuda")
                seg_ml = torch.empty(b, HQ, nseg, 2, dtype=torch.float32, device="cuda")
                args = (self.q, self.k, self.v, self.tables, self.kv_lens, self.cu, self.nd, self.scale, self.scale,
                        seg_acc, seg_ml)
            elif launch.kernel == "paged_decode_reduce_kernel":
                args = (self.cu, self.nd, self.sinks, self.scale, self.scale, seg_acc, seg_ml, self.out)
            else:
                nd = self.no_decodes if single else self.nd
                args = (self.q, self.k, self.v, self.tables, self.kv_lens, self.cu, nd, self.sinks, self.scale,
                        self.scale, self.out, self.out)
            calls.append((kernel, args, kw))

        def run():
            for kernel, args, kw in calls:
                kernel(*args, **kw)
        return run


def time_ms(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def sweep_table(title: str, header: str, candidates: list[tuple[str, object]], rounds: int, top: int,
                flops: float | None) -> tuple[list[str], str]:
    """Times every ``(row label, runner)`` once, then the ``top`` best again in ``rounds``
    interleaved rounds. Returns the table lines and the winner's label."""
    first, failed = {}, {}
    for label, fn in candidates:
        try:
            first[label] = time_ms(fn)
        except Exception as err:  # noqa: BLE001 (e.g. out of shared memory at launch)
            failed[label] = f"{type(err).__name__}: {str(err).splitlines()[0][:60] if str(err) else ''}"
    runners = dict(candidates)
    best = sorted(first, key=first.get)[:top]
    times = {label: [] for label in best}
    for _ in range(rounds):
        for label in best:
            times[label].append(time_ms(runners[label]))
    final = {label: statistics.median(v) for label, v in times.items()}
    winner = min(final, key=final.get)
    columns = " ms (first pass) | ms (median of rounds) | spread |" + (" TFLOP/s |" if flops else "")
    lines = [f"\n{title}\n", header + columns, "|---" * (header.count("|") + columns.count("|") - 1) + "|"]
    for label, _ in candidates:
        if label in failed:
            lines.append(f"{label} failed: {failed[label]} | | |" + (" |" if flops else ""))
            continue
        t, median, spread = first[label], "", ""
        if label in final:
            t = final[label]
            median = f"**{t:.4f}**" if label == winner else f"{t:.4f}"
            spread = f"{(max(times[label]) - min(times[label])) / t:.1%}"
        lines.append(f"{label} {first[label]:.4f} | {median} | {spread} |" +
                     (f" {flops / (t * 1e-3) / 1e12:.0f} |" if flops else ""))
    print("\n".join(lines), flush=True)
    return lines, winner


def decode_candidates(head_dim: int, batch: int, quick: bool):
    """(block_n, segments, warps, stages); small batches need more segments to fill the GPU."""
    if quick:
        return [(64, 2, 4, 2), (64, 2, 4, 3)]
    if batch <= 4:
        return list(itertools.product((16, 32, 64), (1, 2, 4, 8, 16, 32, 64, 128), (4,), (2, 3)))
    if batch < 32:
        return list(itertools.product((32, 64), (4, 8, 16), (4,), (2, 3)))
    block_ns = (32, 64, 128) if head_dim <= 128 else (16, 32, 64)
    return list(itertools.product(block_ns, (1, 2, 4), (4, 8), (2, 3, 4)))


def prefill_candidates(head_dim: int, quick: bool):
    """(block_m, block_n, warps, stages)."""
    if quick:
        return [(128, 64, 8, 2), (128, 128, 8, 2)]
    if head_dim <= 64:
        return list(itertools.product((64, 128, 256), (64, 128), (4, 8), (2, 3)))
    if head_dim <= 128:
        return list(itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4)))
    return list(itertools.product((32, 64, 128), (32, 64), (4, 8), (1, 2, 3)))


def short_candidates(head_dim: int, quick: bool):
    """(block_m, block_n, warps, stages) for short-query steps: small query tiles."""
    if quick:
        return [(16, 64, 4, 3), (64, 64, 4, 3)]
    block_ns = (32, 64, 128) if head_dim <= 128 else (32, 64)
    return list(itertools.product((16, 32, 64), block_ns, (4, 8), (2, 3, 4)))


def parse_decode_points(text: str) -> list[tuple[str, int, int]]:
    """``--decode-points``' ``BxKV`` list as ``(name, batch, kv_len)``."""
    points = []
    for item in text.split(","):
        batch, _, kv = item.strip().partition("x")
        if not (batch.isdigit() and kv.isdigit() and int(batch) > 0 and int(kv) > 0):
            raise ValueError(f"--decode-points: expected BxKV (e.g. 1x4096), got {item!r}")
        points.append((f"decode B={batch} x kv {kv}", int(batch), int(kv)))
    return points


def decode_plans(d: int, points, quick: bool) -> list[tuple]:
    """``sweep_plans``' plans for decode-only batches (decode + reduce kernels) at ``points``."""
    plans = []
    for name, b, kv in points:
        batch = Batch((1,) * b, (kv,) * b, d)
        rows = [(f"| {bn} | {s} | {w} | {st} |", decode_launches(batch, bn, s, w, st, mixed=False))
                for bn, s, w, st in decode_candidates(d, b, quick)]
        plans.append((f"D={d}, {name} (decode + reduce)", "| block_n | segments | warps | stages |", batch, b, rows,
                      None))
    return plans


def tune_short(d: int, quick: bool, rounds: int, lines: list[str], save) -> None:
    """Sweeps the 2D kernel's tiles on the short-query points at head dim ``d``."""
    plans = []
    for name, q_lens, kv_lens, nd in SHORT_POINTS:
        batch = Batch(q_lens, kv_lens, d)
        rows = [(f"| {bm} | {bn} | {w} | {st} |", [prefill_launch(batch, bm, bn, w, st)])
                for bm, bn, w, st in short_candidates(d, quick)]
        plans.append((f"D={d}, {name} (2D kernel)", "| block_m | block_n | warps | stages |", batch, nd, rows,
                      batch.flops))
    sweep_plans(plans, rounds, lines, save)


def sweep_plans(plans: list[tuple], rounds: int, lines: list[str], save) -> list[list[int]]:
    """Compiles every candidate of ``plans`` ((title, header, batch, num_decodes, [(label,
    launches)], flops) each), then sweeps each plan's table; appends the tables to ``lines``
    (``save()`` after each) and returns each table's winner as its numbers."""
    import torch
    compile_all([launch for plan in plans for _, launches in plan[4] for launch in launches])
    winners = []
    for title, header, batch, nd, rows, flops in plans:
        problem = Problem(batch, nd)
        # A candidate whose warm-up failed is still launched: the launch reports the real error.
        candidates = [(label, problem.runner(launches)) for label, launches in rows]
        table, winner = sweep_table(title, header, candidates, rounds, 6, flops)
        lines += table
        winners.append(parse(winner))
        save()
        del problem
        torch.cuda.empty_cache()
    return winners


def parse(label: str) -> list[int]:
    return [int(x) for x in label.strip("| ").split(" | ")]


def tune_head_dim(d: int, quick: bool, rounds: int, lines: list[str], save) -> None:
    """Sweeps the decode and 2D configs at head dim ``d``, then times split vs one launch on the
    mixed batch at the winners; appends the tables to ``lines`` (``save()`` after each)."""
    # (title, header, batch, num_decodes, [(label, launches)], flops)
    plans = decode_plans(d, DECODE_POINTS, quick)
    for name, q_lens, kv_lens, nd in PREFILL_POINTS:
        batch = Batch(q_lens, kv_lens, d)
        rows = [(f"| {bm} | {bn} | {w} | {st} |", [prefill_launch(batch, bm, bn, w, st)])
                for bm, bn, w, st in prefill_candidates(d, quick)]
        plans.append((f"D={d}, {name} (2D kernel)", "| block_m | block_n | warps | stages |", batch, nd, rows,
                      Batch(q_lens[nd:], kv_lens[nd:], d).flops))
    winners = sweep_plans(plans, rounds, lines, save)

    batch = Batch(PREFILL_POINTS[1][1], PREFILL_POINTS[1][2], d)
    dec, full, pre = winners[0], winners[2], winners[3]
    split = decode_launches(batch, *dec, mixed=True) + [prefill_launch(batch, *pre)]
    ours = [prefill_launch(batch, *full)]
    vllm = [prefill_launch(batch, *VLLM_TILES)]
    compile_all(split + ours + vllm)
    problem = Problem(batch, PREFILL_POINTS[1][3])
    runs = {"split (decode + reduce + 2D)": problem.runner(split),
            "decode + reduce only": problem.runner(split[:2]),
            "2D part only": problem.runner(split[2:]),
            "single 2D launch, our prefill tiles": problem.runner(ours, single=True),
            "single 2D launch, vLLM tiles (16 x 32, 4 warps, 2 stages)": problem.runner(vllm, single=True)}
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            times[k].append(time_ms(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    lines += [f"\nD={d}, mixed 63 decodes + 8192 prefill, split vs one launch (decode {dec}, 2D part {pre}; "
              f"single launch: the prefill winner {full})\n",
              "| plan | ms (median of rounds) | spread | vs split |", "|---|---|---|---|"]
    for k, v in times.items():
        lines.append(f"| {k} | {med[k]:.4f} | {(max(v) - min(v)) / med[k]:.1%} | "
                     f"{med[k] / med['split (decode + reduce + 2D)']:.2f}x |")
    print("\n".join(lines[-8:]), flush=True)
    save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="128", help="comma-separated head dims, swept in this order")
    parser.add_argument("--quick", action="store_true", help="two candidates per table (checks the script)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved re-timing rounds of the best candidates")
    parser.add_argument("--short", action="store_true", help="only the short-query (speculative decode) tables")
    parser.add_argument("--decode-points", type=parse_decode_points, default=None, metavar="BxKV,...",
                        help="only decode tables, at these batches x KV lengths")
    parser.add_argument("--section", default=None,
                        help="the TUNING.md section it writes (default: the mode's: triton-tiles, triton-short-tiles, "
                             "triton-decode-tiles); another device's run keeps the first's")
    args = parser.parse_args()

    import torch
    import triton
    lines = [f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
             f"{utc_now()}; command: `{command_line()}`. Times are do_bench medians in ms; the best 6 of each table are "
             f"re-timed in {args.rounds} interleaved rounds (median of rounds, spread = (max - min) / median); "
             f"bold: the winner."]

    if args.decode_points:
        name, heading = ("triton-decode-tiles",
                         "Triton decode tiles and KV segments (`benchmarks/tune_triton.py --decode-points`)")
    elif args.short:
        name, heading = ("triton-short-tiles",
                         "Triton short-query tiles (speculative decode; `benchmarks/tune_triton.py --short`)")
    else:
        name, heading = "triton-tiles", "Triton block sizes (benchmarks/tune_triton.py)"
    if args.section:
        name, heading = args.section, f"{heading}: {args.section}"

    def save(update: bool = False) -> str:
        return write_section(name, "\n".join(lines), heading=heading, path=TUNING, update=update)

    for d in (int(x) for x in args.head_dims.split(",")):
        if args.decode_points:
            sweep_plans(decode_plans(d, args.decode_points, args.quick), args.rounds, lines, save)
        else:
            (tune_short if args.short else tune_head_dim)(d, args.quick, args.rounds, lines, save)
    print(save(update=not args.quick))


if __name__ == "__main__":
    main()
