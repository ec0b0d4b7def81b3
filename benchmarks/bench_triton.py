"""jaxattn's Triton kernels vs the other backends on one GPU (one command, one device run).

    python -m benchmarks.bench_triton [--quick] [--skip ROWS] [--only ROWS] [--rounds N]

Workloads (bf16, Hq=32, Hkv=8, D=128, page 64, HND pages in a randomly permuted pool, causal):
  decode   B=64 sequences x 1 token at kv_len 4096 (meta.max_q_len = 1)
  prefill  B=8 x 4096 new tokens
  mixed    63 decodes at kv_len 4096 + one 8192-token prefill
  16k      batch 1, a 16384-token prompt
Rows: triton split (decode kernels for the leading decodes + the 2D kernel for the rest), triton
single (the 2D kernel alone over every sequence, our prefill tiles), triton single with vLLM's
tiles (BLOCK_M 16, 32-key tiles: what vLLM's unified kernel uses for every batch), trtllm (XQA)
for decode, cudnn for the others, auto (trtllm decodes + cudnn rest) for the mixed batch, and xla
where it fits in time.

Timing: one jitted call runs R independent calls of a row on R different query sets (XLA captures
them into one command buffer); time per call = wall time / R after ``block_until_ready``. All rows
of a workload are compiled and warmed first, then timed in interleaved rounds (row 1, row 2, ...,
row 1, ...); a row's time is the median of its rounds, its spread (max - min) / median. Each
workload runs in a child process, so a crashing peer (the cudnn row once segfaulted here) costs
only its own rows: the workload is then re-run without the peers. TFLOP/s count 4 * D * Hq *
visible (query, key) pairs. Block sizes were chosen by ``benchmarks/tune_triton.py`` (benchmarks/TUNING.md).
Writes the table into the triton section of benchmarks/RESULTS.md (and $OUT when set).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from benchmarks.common import D, Case, command_line, device_name, make_inputs, write_section
from jaxattn import backends
from jaxattn.backends import triton as tb
from jaxattn.backends.base import AttentionParams

VLLM_TILES = tb.PrefillConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)
WORKLOADS = [  # (case, R: the row's calls in one timed jitted call)
    (Case("decode B=64 x kv 4096", (1,) * 64, (4096,) * 64), 20),
    (Case("prefill B=8 x 4096", (4096,) * 8, (4096,) * 8), 3),
    (Case("mixed 63 decodes + 8192 prefill", (1,) * 63 + (8192,), (4096,) * 63 + (8192,)), 4),
    (Case("batch-1 16k prompt", (16384,), (16384,)), 3),
]


def query_sets(w: Case, repeats: int, seed: int = 0) -> tuple:
    """``(qs, cache, meta)``: ``w``'s inputs (``make_inputs``) with ``repeats`` independent query sets."""
    x = make_inputs(w, seed)
    keys = jax.random.split(jax.random.key(seed + 1), repeats - 1)
    return (x.q, *(jax.random.normal(k, x.q.shape, x.q.dtype) for k in keys)), x.cache, x.meta


def runner(kind: str, **kw):
    """A function ``(q, cache, meta) -> out`` for one row of the table."""
    if kind.startswith("triton"):
        params = AttentionParams(scale=1 / np.sqrt(D), causal=True, sliding_window=None, softcap=None,
                                 has_sinks=False)
        return lambda q, c, m: tb.attention(q, c, m, params, None, **kw)
    return lambda q, c, m: jaxattn.paged_attention(q, c, m, backend=kind)


def timed_rounds(fns: dict, qs, cache, meta, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each row ``label -> (fn, R)``, one value per round; the rounds interleave
    the rows. Each timing is one jitted call running the row on ``qs[:R]``."""
    steps = {}
    for label, (fn, n) in fns.items():
        step = jax.jit(lambda qs, c, m, fn=fn: tuple(fn(q, c, m) for q in qs))
        jax.block_until_ready(step(qs[:n], cache, meta))
        jax.block_until_ready(step(qs[:n], cache, meta))
        steps[label] = (step, n)
        print(f"  warmed {label}", flush=True)
    times = {label: [] for label in steps}
    for _ in range(rounds):
        for label, (step, n) in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(qs[:n], cache, meta))
            times[label].append((time.perf_counter() - t0) / n)
    return times


def rows_for(w: Case) -> list[tuple[str, str, dict]]:
    rows = [("triton split", "triton", dict(launch="split")), ("triton single", "triton", dict(launch="single")),
            ("triton single, vLLM tiles", "triton", dict(launch="single", prefill=VLLM_TILES))]
    # cuDNN is the prefill peer (its decode-only run crashed the process on the H200, 2026-11-22).
    decode_only = w.max_q_len == 1
    rows.append(("trtllm", "trtllm", {}) if decode_only else ("cudnn", "cudnn", {}))
    if w.q_lens[0] == 1 and not decode_only:
        rows.append(("auto (trtllm decodes + cudnn rest)", "auto", {}))
    if decode_only or w.batch == 8:
        rows.append(("xla", "xla", {}))
    return rows


def check(fn, qs, cache, meta) -> float:
    """Relative error of a row's output against triton split on the first query set."""
    ref = jax.jit(runner("triton", launch="split"))(qs[0], cache, meta).astype(jnp.float32)
    out = jax.jit(fn)(qs[0], cache, meta).astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def run_workload(index: int, rows: list[int], rounds: int) -> list[dict]:
    """Times ``rows`` (indices into ``rows_for``) of workload ``index`` in this process; one dict
    per row."""
    w, repeats = WORKLOADS[index]
    qs, cache, meta = query_sets(w, repeats)
    fns, results = {}, []
    for label, kind, kw in (rows_for(w)[i] for i in rows):
        reason = None if kind in ("triton", "auto") else backends.unavailable_reason(kind)
        if reason is not None:
            results.append(dict(label=label, error=reason[:80]))
            continue
        fns[label] = (runner(kind, **kw), 1 if kind == "xla" else repeats)
    times = timed_rounds(fns, qs, cache, meta, rounds)
    for label, (fn, _) in fns.items():
        results.append(dict(label=label, times=times[label], err=check(fn, qs, cache, meta)))
    return results


_RESULT = "RESULT "


def workload_in_child(index: int, labels: list[str], rounds: int) -> list[dict]:
    """``run_workload`` in a child process; if the child dies, the workload runs again without the
    peers, which are reported with the exit code."""
    all_labels = [label for label, _, _ in rows_for(WORKLOADS[index][0])]
    cmd = [sys.executable, "-m", "benchmarks.bench_triton", "--child", str(index), "--rounds", str(rounds),
           "--child-rows", ",".join(str(all_labels.index(label)) for label in labels)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    print(proc.stdout, end="", flush=True)
    results = [json.loads(line[len(_RESULT):]) for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode == 0:
        return results
    peers = [label for label in labels if not label.startswith("triton")]
    if not peers or len(peers) == len(labels):
        return [dict(label=label, error=f"process died (exit {proc.returncode})") for label in labels]
    print(f"workload {index}: the child died (exit {proc.returncode}); again without {peers}", flush=True)
    return (workload_in_child(index, [label for label in labels if label not in peers], rounds)
            + [dict(label=label, error=f"process died (exit {proc.returncode}) in this row's run")
               for label in peers])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="decode and mixed workloads only")
    parser.add_argument("--skip", default="", help="';'-separated row labels to leave out (e.g. cudnn)")
    parser.add_argument("--only", default="", help="';'-separated row labels to run alone (no RESULTS.md update)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds per row")
    parser.add_argument("--child", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--child-rows", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    skip, only = set(filter(None, args.skip.split(";"))), set(filter(None, args.only.split(";")))
    if args.child >= 0:
        for result in run_workload(args.child, [int(i) for i in args.child_rows.split(",")], args.rounds):
            print(_RESULT + json.dumps(result), flush=True)
        return
    command = command_line()
    # The parent never touches the GPU (JAX would take most of its memory): the children time.
    lines = [f"Device: {device_name()}; jax {jax.__version__}; "
             f"{datetime.date.today().isoformat()}; command: `{command}`; {args.rounds} interleaved rounds\n",
             "| workload | row | time (median) | spread | TFLOP/s | KV TB/s | vs triton split | rel. err vs split |",
             "|---|---|---|---|---|---|---|---|"]
    summary = {}
    for index, (w, _) in enumerate(WORKLOADS):
        if args.quick and index not in (0, 2):
            continue
        labels = [label for label, _, _ in rows_for(w) if label not in skip and (not only or label in only)]
        by_label = {r["label"]: r for r in workload_in_child(index, labels, args.rounds)}
        for label in labels:
            r = by_label[label]
            if "error" in r:
                lines.append(f"| {w.name} | {label} | n/a: {r['error']} | | | | | |")
                continue
            t = statistics.median(r["times"])
            summary[(w.name, label)] = t
            split = summary.get((w.name, "triton split"), t)
            lines.append(f"| {w.name} | {label} | {t * 1e3:.3f} ms | {(max(r['times']) - min(r['times'])) / t:.1%} | "
                         f"{w.flops / t / 1e12:.0f} | {w.kv_bytes / t / 1e12:.2f} | {t / split:.2f}x | "
                         f"{r['err']:.1e} |")
            print(lines[-1], flush=True)
    lines.append("\nTargets:")
    lines += _targets(summary)
    text = "\n".join(lines)
    print(text)
    write_section("triton", text, heading="triton (jaxattn's Triton kernels)", update=not only)


def _targets(s: dict) -> list[str]:
    out = []

    def ratio(a, b):
        return s[a] / s[b] if a in s and b in s else None

    decode, prefill, mixed = (w.name for w, _ in WORKLOADS[:3])
    r = ratio((decode, "triton split"), (decode, "trtllm"))
    out.append(f"- decode: triton / XQA time = {r:.2f} (target <= 1.25)" if r else "- decode: XQA not measured")
    r = ratio((prefill, "cudnn"), (prefill, "triton split"))
    out.append(f"- prefill: triton / cuDNN TFLOP/s = {r:.2f} (target >= 0.6)" if r else "- prefill: cuDNN not measured")
    for base in ("triton single", "triton single, vLLM tiles"):
        r = ratio((mixed, base), (mixed, "triton split"))
        out.append(f"- mixed: {base} / split time = {r:.2f} (target >= 2)" if r else f"- mixed: {base} not measured")
    return out


if __name__ == "__main__":
    main()
