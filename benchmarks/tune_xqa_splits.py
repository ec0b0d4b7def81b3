"""How many CTAs per sequence XQA should use at low-batch decode: a sweep of the SM count its split
formula is given (``jaxattn.backends.trtllm.split_sm_count``), one device run.

    python -m benchmarks.tune_xqa_splits [--multiples 1,2,3,4,6,8] [--points frontier|all] [--fp8]

XQA's generic kernel (bf16/fp16 pages) splits each (request, KV head) over
``min(SMs / (B * Hkv), ceil(max_kv / tile))`` CTAs; the Hopper fp8 kernel over
``round(SMs * 3 / (B * Hkv) / 4)``. For each point (bf16, Hq=32, Hkv=8, D=128, page 64, HND pool
randomly permuted), each multiple m of the device's SM count is passed as that count, and the
table gives the GPU time per call of the whole ``backend="trtllm"`` call and of the XQA kernel alone
(profiler, median of 3 rounds of 20 calls), against the copy rate; each point's first row is
``split_sm_count``'s own choice. With fp8 pages, compare the XQA column: the handler's
``zero_rows_without_keys`` kernel follows XQA with programmatic dependent launch, so it starts
early, waits for XQA, and its duration (part of the whole call's sum) repeats most of XQA's. The
last table breaks one point's call into its kernels. ``--fp8`` runs the same points with the pages in float8_e4m3fn
(``benchmarks.common.fp8_inputs``), which XQA's Hopper kernel serves: its split formula gives a
quarter of the CTAs the generic kernel's does, so larger multiples matter there.
Writes the xqa-splits (``--fp8``: xqa-splits-fp8) section of benchmarks/TUNING.md.
"""

from __future__ import annotations

import argparse
import statistics

import jax

import jaxattn
from benchmarks.common import (HKV, HQ, PAGE, TUNING, D, Case, command_line, copy_bandwidth, device_event_seconds,
                               device_name, fp8_inputs, make_inputs, utc_now, write_section)
from jaxattn.backends import trtllm

FRONTIER = [(b, kv) for b in (1, 2, 4) for kv in (4096, 16384, 32768, 131072)]
ALL = FRONTIER + [(8, 4096), (16, 4096), (64, 4096), (8, 32768)]


def profile(call, rounds: int = 3, calls: int = 20) -> tuple[float, float, dict[str, float]]:
    """(median whole-call seconds, median XQA-kernel seconds, one round's per-kernel seconds)."""
    jax.block_until_ready(call())
    events = [device_event_seconds(call, calls) for _ in range(rounds)]
    whole = statistics.median(sum(e.values()) for e in events)
    xqa = statistics.median(sum(t for name, t in e.items() if "kernel_mha" in name) for e in events)
    return whole, xqa, events[-1]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_xqa_splits", description=__doc__.splitlines()[0])
    parser.add_argument("--multiples", default=None,
                        help="multiples of the SM count to try (default 1,2,3,4,6,8; with --fp8 1,2,4,8,16,32)")
    parser.add_argument("--points", choices=("frontier", "all"), default="frontier")
    parser.add_argument("--fp8", action="store_true", help="float8_e4m3fn pages (XQA's Hopper kernel)")
    args = parser.parse_args()
    multiples = [float(m) for m in (args.multiples or ("1,2,4,8,16,32" if args.fp8 else "1,2,3,4,6,8")).split(",")]
    sms = trtllm.sm_count()
    copy_rate = copy_bandwidth()
    lines = [f"Device: {device_name()} ({sms} SMs); jax {jax.__version__}; {utc_now()}; command: `{command_line()}`; "
             f"copy rate {copy_rate / 1e12:.2f} TB/s; {'float8_e4m3fn' if args.fp8 else 'bf16'} pages, bf16 q, "
             f"Hq={HQ}, Hkv={HKV}, D={D}, page {PAGE}. GPU time per call (profiler, median of 3 rounds of 20 calls).",
             "", "| B | kv | SM count given | whole call us | XQA us | of copy rate (whole) |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    default_split = trtllm.split_sm_count
    breakdown = None
    for batch, kv in FRONTIER if args.points == "frontier" else ALL:
        case = Case.decode(batch, kv)
        x = make_inputs(case)
        q, cache, meta = x.q, fp8_inputs(x).cache if args.fp8 else x.cache, x.meta
        kv_bytes = case.kv_bytes // 2 if args.fp8 else case.kv_bytes
        for m in [None] + multiples:       # None: split_sm_count's own choice, recorded as the call makes it
            chosen = []
            pick = default_split if m is None else (lambda *_, count=int(round(m * sms)): count)
            trtllm.split_sm_count = lambda *a, pick=pick: chosen.append(pick(*a)) or chosen[-1]
            fn = jax.jit(lambda q, c, mt: jaxattn.paged_attention(q, c, mt, backend="trtllm"))
            whole, xqa, events = profile(lambda: fn(q, cache, meta))
            label = f"{chosen[-1]} (split_sm_count)" if m is None else str(chosen[-1])
            lines.append(f"| {batch} | {kv} | {label} | {whole * 1e6:.1f} | {xqa * 1e6:.1f} | "
                         f"{kv_bytes / whole / copy_rate:.0%} |")
            print(lines[-1], flush=True)
            if m == 1 and batch == 1 and kv == 32768:
                breakdown = events
            jax.clear_caches()
        trtllm.split_sm_count = default_split
    if breakdown:
        lines += ["", "B=1 kv=32768, the device's SM count: kernels of one call", "", "| us | kernel |", "|---|---|"]
        lines += [f"| {t * 1e6:.2f} | `{name[:120]}` |" for name, t in sorted(breakdown.items(), key=lambda x: -x[1])]
    name, heading = ("xqa-splits-fp8", "XQA split count, fp8 pages (benchmarks/tune_xqa_splits.py --fp8)") if args.fp8 \
        else ("xqa-splits", "XQA split count (benchmarks/tune_xqa_splits.py)")
    print(write_section(name, "\n".join(lines), heading=heading, path=TUNING))


if __name__ == "__main__":
    main()
