"""Where one paged-attention call's GPU time goes: the kernels of a jitted ``paged_attention``
call, per workload of ``bench_jax_peers`` and per backend, split into the backend's attention
kernels and the per-call work around them: XLA's own kernels (metadata preparation, split
combines, zeroed rows, copies) and jaxattn's metadata checks (``kernels/sanitize.py`` on CUDA).

    python -m benchmarks.profile_calls [--workloads "decode B=1 kv=4096,prefill B=1 x 512"]
                                       [--backends auto,trtllm,cudnn,triton,fa4] [--budget-s 420]

For each workload and backend that takes it: GPU time per call (the summed durations of the
kernels it launches, ``benchmarks.common.device_events``, median of ``--rounds`` rounds of
``--calls`` calls after a warm-up call; compilation excluded), the part in the backend's kernels
and in the per-call work (each with its launches per call), and the three costliest kernels of
the per-call work by name. A backend that refuses the workload is listed with its reason. This is
the profile behind the jax_peers rows that trail a peer: a miss in the attention kernel and a miss
in the per-call work around it call for different fixes. Writes the call_profile section of benchmarks/RESULTS.md.
``--smoke`` runs two tiny workloads on the xla backend on any device (CPU: wall time as one
event) and writes only $OUT.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import jax

import jaxattn
from benchmarks.bench_jax_peers import WORKLOADS
from benchmarks.common import (Budget, Case, command_line, device_events, device_name, make_inputs, utc_now,
                               write_section)
from jaxattn.attention import backend_for

# The per-call work: kernels XLA generates itself (fusions, copies, memsets) and jaxattn's metadata
# checks (the Triton kernel of kernels/sanitize.py); every other kernel is the backend's.
PER_CALL_KERNEL = re.compile(r"fusion|^wrapped_|^copy|^memset|^memcpy|^input_|^loop_|^concatenate|^transpose"
                             r"|^slice|^dynamic|^scatter|^gather|^select|^iota|^broadcast|^reduce|^convert|^compare"
                             r"|^sanitize_kernel", re.IGNORECASE)
SMOKE_WORKLOADS = (Case.decode(2, 100), Case.prefill(1, 40))


def is_per_call_kernel(name: str) -> bool:
    return bool(PER_CALL_KERNEL.search(name))


def workload_names(text: str) -> list[str]:
    """``--workloads``' names: split at the commas outside brackets ("kv=U[2048,4096]" is one name)."""
    return [name for name in re.split(r",(?![^\[]*\])", text) if name]


def split_events(events: dict[str, tuple[float, float]]) -> dict:
    """``device_events``' ``{name: (seconds, launches)}`` per call -> the backend's kernels and the
    per-call work's: seconds and launches of each, and the per-call kernels by time, costliest first."""
    per_call = {name: v for name, v in events.items() if is_per_call_kernel(name)}
    own = {name: v for name, v in events.items() if name not in per_call}
    return dict(total=sum(s for s, _ in events.values()),
                kernel=sum(s for s, _ in own.values()), kernel_launches=sum(n for _, n in own.values()),
                per_call=sum(s for s, _ in per_call.values()),
                per_call_launches=sum(n for _, n in per_call.values()),
                top_per_call=sorted(((s, name) for name, (s, _) in per_call.items()), reverse=True)[:3])


def profile_call(call, rounds: int, calls: int, on_gpu: bool) -> dict:
    """``split_events`` of the round with the median GPU time (CPU: wall time as one event)."""
    jax.block_until_ready(call())
    if not on_gpu:
        start = time.perf_counter()
        for _ in range(calls):
            out = call()
        jax.block_until_ready(out)
        return split_events({"cpu wall time (smoke)": ((time.perf_counter() - start) / calls, 1.0)})
    splits = sorted((split_events(device_events(call, calls)) for _ in range(rounds)), key=lambda r: r["total"])
    return splits[len(splits) // 2]


def profile_workload(case: Case, names: list[str], rounds: int, calls: int, on_gpu: bool) -> list[dict]:
    x = make_inputs(case)
    rows = []
    for name in names:
        row = dict(workload=case.name, backend=name)
        try:
            fn = jax.jit(lambda q, c, m, name=name: jaxattn.paged_attention(q, c, m, backend=name))
            row.update(profile_call(lambda: fn(x.q, x.cache, x.meta), rounds, calls, on_gpu))
            if name == "auto":
                row["backend"] = f"auto ({backend_for(x.q, x.cache, x.meta)})"
        except ValueError as err:       # the backend refuses this call (or is not installed)
            row["refused"] = " ".join(str(err).split())[:160]
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
        jax.clear_caches()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| workload | backend | GPU us / call | backend kernels us (launches) | metadata and XLA kernels us "
             "(launches) | their costliest kernels (us) |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['workload']} | {r['backend']} | refused: {r['refused']} | | | |")
            continue
        top = ", ".join(f"{name.split('(')[0]} {s * 1e6:.1f}" for s, name in r["top_per_call"])   # no C++ signature
        lines.append(f"| {r['workload']} | {r['backend']} | {r['total'] * 1e6:.1f} | {r['kernel'] * 1e6:.1f} "
                     f"({r['kernel_launches']:.0f}) | {r['per_call'] * 1e6:.1f} ({r['per_call_launches']:.0f}) | {top} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_calls", description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="",
                        help="comma-separated workload names (default: every one); a comma inside [] is the name's")
    parser.add_argument("--backends", default="auto,trtllm,cudnn,triton,fa4", help="comma-separated backends")
    parser.add_argument("--rounds", type=int, default=3, help="profiled rounds per row (the median is kept)")
    parser.add_argument("--calls", type=int, default=10, help="calls per profiled round")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new workload after this")
    parser.add_argument("--smoke", action="store_true", help="two tiny workloads on xla (any device); $OUT only")
    args = parser.parse_args(argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    if not on_gpu and not args.smoke:
        sys.exit("profile_calls needs a GPU (or --smoke)")
    names = ["xla"] if args.smoke else [b for b in args.backends.split(",") if b]
    wanted = workload_names(args.workloads)
    workloads = SMOKE_WORKLOADS if args.smoke else [w for w in WORKLOADS if not wanted or w.name in wanted]
    unknown = set(wanted) - {w.name for w in WORKLOADS}
    if unknown:
        sys.exit(f"unknown workloads {sorted(unknown)}; known: {[w.name for w in WORKLOADS]}")
    budget, rows, skipped = Budget(args.budget_s), [], []
    for case in workloads:
        if budget.spent(case):
            skipped.append(case.name)
            continue
        rows += profile_workload(case, names, args.rounds, args.calls, on_gpu)
    text = (f"- device: {device_name()}; jax {jax.__version__}; date: {utc_now()}; command: `{command_line()}`\n"
            "- bf16, Hq 32, Hkv 8, D 128, page 64, HND; GPU time per call from the profiler (median of "
            f"{args.rounds} rounds of {args.calls} calls); metadata and XLA kernels: jaxattn's metadata "
            "checks (sanitize_kernel) and the fusions, copies and memsets XLA generates (the backend's "
            "arguments, combines, zeroed rows); backend kernels: the rest.\n\n" + table(rows))
    if skipped:
        text += "\n\nNot run (time budget): " + ", ".join(skipped) + "."
    print(write_section("call_profile", text, heading="Where a call's GPU time goes (benchmarks/profile_calls.py)",
                        update=not args.smoke))


if __name__ == "__main__":
    main()
