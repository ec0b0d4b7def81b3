"""Paged prefill, side by side on one GPU: jaxattn's cuDNN backend vs its peers on the same data.

    python -m benchmarks.bench_cudnn_prefill [--quick] [--budget-s 300]
    python -m benchmarks.bench_cudnn_prefill --compile-fa3   # only build flashinfer's fa3 module

Rows: jaxattn ``backend="cudnn"`` (jitted), flashinfer ``cudnn_batch_prefill_with_kv_cache``
(torch, the same cuDNN kernel), flashinfer ``BatchPrefillWithPagedKVCacheWrapper`` (fa3 on
SM90) and jaxattn ``backend="xla"``. Causal (bottom-right) prefill, bf16, Hq=32, Hkv=8, D=128,
page 64, HND pages in a randomly permuted pool shared by JAX and torch (dlpack, no copies).

Timing (compile, plan builds and flashinfer's JIT excluded). Every peer is a callable that runs R
prefills (R so that a call is ~2 ms of work), timed the same way: wall clock of a burst of
`long` calls minus that of `short` calls, over the calls in between (steady state: neither the
launch latency of the first call nor the wait for the last counts), median over trials. The
peers of a case take turns within each trial, in rotating order, so they run at the same GPU
clock: under sustained prefill load the H200 drops from 1980 to ~1725 MHz (power cap), so a peer
timed in short bursts after an idle pause looks up to ~12% faster than one timed under load.
  * JAX: one jitted call runs R prefills, each taking the previous one's output as its queries
    (a true dependency that adds no kernel); the last lands in a donated buffer that is passed
    back, so every address repeats and XLA replays its command buffer without re-recording.
  * torch: R calls captured in a CUDA graph (eager if capture fails), replayed.
TFLOP/s count 4 * D * Hq * (visible query-key pairs). Writes the table into the cuDNN section of
benchmarks/RESULTS.md (and $OUT when set).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable

# JAX and torch share the GPU: leave torch (flashinfer workspaces, fa3) room.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxattn  # noqa: E402
from benchmarks.common import (  # noqa: E402
    HKV, HQ, MATH_RATE, PAGE, D, Budget, Case, Inputs, add_torch_peer, command_line, device_name, make_inputs,
    notes_line, rel_error, repeats_for, require_backend, torch_peers, torch_replay, utc_now, write_section)
from jaxattn import _ffi_cudnn  # noqa: E402

PEERS = ("jaxattn cudnn", "flashinfer cudnn", "flashinfer fa3", "jaxattn xla")


# The point first, then prefill lengths 512..8192 x batch 1..16, then a chunked prefill.
SWEEP = [Case.prefill(8, 4096)] + [Case.prefill(b, n) for n in (512, 2048, 4096, 8192) for b in (1, 4, 8, 16)
                                   if (b, n) != (8, 4096)] + [Case.prefill(4, 300, 1200)]
QUICK = [Case.prefill(8, 4096), Case.prefill(1, 512), Case.prefill(4, 300, 1200)]


@dataclasses.dataclass
class Runner:
    call: Callable[[], object]     # enqueues one call of R prefills, returns its output
    sync: Callable[[], None]       # waits until everything enqueued has finished


def jax_runner(x: Inputs, backend: str, repeats: int) -> Runner:
    """A jitted chain of `repeats` dependent prefills (see the module docstring), warmed up."""

    def chain(q, cache, meta, out):
        for _ in range(repeats):
            q = out = jaxattn.paged_attention(q, cache, meta, backend=backend)
        return out

    chain = jax.jit(chain, donate_argnums=3)
    state = {"out": jnp.zeros(x.q.shape, x.q.dtype)}

    def call():
        state["out"] = chain(x.q, x.cache, x.meta, state["out"])
        return state["out"]

    runner = Runner(call, lambda: state["out"].block_until_ready())
    for _ in range(3):
        runner.call()
    runner.sync()
    return runner


def torch_runner(fn: Callable[[], object], repeats: int) -> tuple[Runner, str]:
    """`fn` (already warmed up) `repeats` times per call: a CUDA graph, else eagerly (``torch_replay``)."""
    import torch

    call, mode = torch_replay(fn, repeats)
    call()
    torch.cuda.synchronize()
    return Runner(call, torch.cuda.synchronize), mode


def time_peers(runners: dict[str, Runner], repeats: int, trials: int = 7, long: int = 12,
               short: int = 2) -> dict[str, float]:
    """Seconds per prefill of each runner, measured in turns (see the module docstring)."""

    def burst(runner: Runner, calls: int) -> float:
        runner.sync()
        start = time.perf_counter()
        for _ in range(calls):
            runner.call()
        runner.sync()
        return time.perf_counter() - start

    names = list(runners)
    samples = {name: [] for name in names}
    for trial in range(trials):
        for name in names[trial % len(names):] + names[:trial % len(names)]:
            t_short, t_long = burst(runners[name], short), burst(runners[name], long)
            samples[name].append((t_long - t_short) / ((long - short) * repeats))
    return {name: statistics.median(values) for name, values in samples.items()}


def flashinfer_runners(case: Case, x: Inputs):
    """name -> factory of a zero-argument callable returning the output tensor [T, Hq, D]."""
    import torch
    import flashinfer
    from flashinfer.cudnn.prefill import cudnn_batch_prefill_with_kv_cache

    q = torch.from_dlpack(x.q)
    k = torch.from_dlpack(x.cache.k_pages)
    v = torch.from_dlpack(x.cache.v_pages)
    tables = torch.from_dlpack(x.meta.block_tables)
    dev = q.device
    b, q_len, kv_len = case.batch, case.max_q_len, case.max_kv_len   # every sequence alike
    seq_q = torch.full((b, 1, 1, 1), q_len, dtype=torch.int32, device=dev)
    seq_kv = torch.full((b, 1, 1, 1), kv_len, dtype=torch.int32, device=dev)
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * q_len
    scale = 1 / math.sqrt(D)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    runners = {}

    def cudnn_call():
        return cudnn_batch_prefill_with_kv_cache(
            q, k, v, scale, workspace, max_token_per_sequence=q_len, max_sequence_kv=kv_len,
            actual_seq_lens_q=seq_q, actual_seq_lens_kv=seq_kv, block_tables=tables, causal=True,
            return_lse=False, batch_offsets_q=indptr, batch_offsets_o=indptr, batch_offsets_units="tokens",
            is_cuda_graph_compatible=True)[0]
    runners["flashinfer cudnn"] = lambda: cudnn_call

    def fa3():   # plans (and JIT-compiles the kernel on first use)
        pages_per_seq = tables.shape[1]
        kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * pages_per_seq
        last = torch.full((b,), (kv_len - 1) % PAGE + 1, dtype=torch.int32, device=dev)
        fa3_workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(fa3_workspace, "HND", backend="fa3")
        wrapper.plan(indptr, kv_indptr, tables.reshape(-1), last, HQ, HKV, D, PAGE, causal=True,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        return lambda: wrapper.run(q, (k, v))
    runners["flashinfer fa3"] = fa3
    return runners


def compile_fa3() -> None:
    """Builds flashinfer's fa3 paged-prefill module (a JIT compile of minutes) on a tiny problem,
    so that a later process loads it from flashinfer's cache."""
    import torch
    import flashinfer

    dev = torch.device("cuda")
    pages = torch.zeros(2, HKV, PAGE, D, dtype=torch.bfloat16, device=dev)
    q = torch.zeros(PAGE, HQ, D, dtype=torch.bfloat16, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(128 << 20, dtype=torch.uint8, device=dev), "HND", backend="fa3")
    indptr = torch.tensor([0, PAGE], dtype=torch.int32, device=dev)
    one = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    wrapper.plan(indptr, one, one[1:], torch.tensor([PAGE], dtype=torch.int32, device=dev), HQ, HKV, D, PAGE,
                 causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    wrapper.run(q, (pages, pages))
    torch.cuda.synchronize()


def bench_case(case: Case, with_xla: bool, row: dict, save) -> None:
    """Fills `row`, calling save() after each measurement (a run cut off keeps what it measured)."""
    x = make_inputs(case)
    repeats = repeats_for(case.flops / MATH_RATE, target_s=2e-3, least=1, most=32)
    out = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="cudnn"))(x.q, x.cache, x.meta)
    runners = {"jaxattn cudnn": jax_runner(x, "cudnn", repeats)}
    for name, factory in torch_peers(row, lambda: flashinfer_runners(case, x)).items():
        add_torch_peer(row, name, factory, repeats, reference=out, timer=torch_runner, into=runners)
    row["seconds"].update(time_peers(runners, repeats))
    save()
    if with_xla:
        try:
            xla = jax_runner(x, "xla", 1)
            row["seconds"]["jaxattn xla"] = time_peers({"xla": xla}, 1, trials=3, long=3, short=1)["xla"]
            row["notes"].append(f"cudnn vs xla rel err {rel_error(out, xla.call()):.1e}")
        except Exception as err:
            row["notes"].append(f"xla failed: {err!r}"[:200])
        save()


def table(rows: list[dict]) -> str:
    head = ("| case | " + " | ".join(f"{p} us (TFLOP/s)" for p in PEERS)
            + " | cudnn / fi-cudnn | cudnn / fa3 |")
    lines = [head, "|" + "---|" * (len(PEERS) + 3)]
    for row in rows:
        sec = row["seconds"]
        cells = [f"{sec[p] * 1e6:.0f} ({row['flops'] / sec[p] / 1e12:.0f})" if p in sec else "-" for p in PEERS]
        ours = sec.get("jaxattn cudnn")
        ratios = [f"{sec[p] / ours:.3f}" if ours and p in sec else "-" for p in ("flashinfer cudnn", "flashinfer fa3")]
        lines.append(f"| {row['case']} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """The target ratio at the issue's point and over the sweep, and where fa3 is faster."""
    def ratio(row, peer):
        sec = row["seconds"]
        return sec[peer] / sec["jaxattn cudnn"] if peer in sec and "jaxattn cudnn" in sec else None

    cudnn = [(ratio(r, "flashinfer cudnn"), r["case"]) for r in rows if ratio(r, "flashinfer cudnn")]
    if not cudnn:
        return "Summary: no jaxattn cudnn / flashinfer cudnn ratio measured."
    lo, hi = min(cudnn), max(cudnn)
    faster = [f"{r['case']} ({1 / ratio(r, 'flashinfer fa3'):.2f}x)" for r in rows
              if ratio(r, "flashinfer fa3") and ratio(r, "flashinfer fa3") < 1]
    return (f"Summary: jaxattn cudnn / flashinfer cudnn speed ratio {cudnn[0][0]:.3f} at {cudnn[0][1]}, "
            f"min {lo[0]:.3f} ({lo[1]}), max {hi[0]:.3f} ({hi[1]}) over {len(cudnn)} cases (target >= 0.98). "
            f"flashinfer fa3 faster than jaxattn cudnn (fa3 speed / jaxattn cudnn speed): "
            f"{', '.join(faster) if faster else 'nowhere'}.")


def write_results(rows: list[dict], command: str) -> str:
    lib = _ffi_cudnn
    text = "\n".join([
        f"- device: {device_name()}; cuDNN {lib.format_version(lib.cudnn_version() or 0)}, jax {jax.__version__}",
        f"- date: {utc_now()}; command: `{command}`",
        f"- bf16, causal (bottom-right), Hq={HQ}, Hkv={HKV}, D={D}, page {PAGE}, HND, randomly permuted pool.",
        "- time per prefill in steady state, peers timed in turns (see the benchmark's docstring); ratios are",
        "  speed ratios (peer time / jaxattn cudnn time; > 1: jaxattn faster).",
        "",
        table(rows),
        "",
        summary(rows),
        "",
        notes_line(rows),
    ])
    return write_section("cudnn-prefill", text, heading='cuDNN paged prefill (`backend="cudnn"`)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three cases only")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting new cases after this")
    parser.add_argument("--xla-max-tokens", type=int, default=16384, help="skip the xla backend above this")
    parser.add_argument("--compile-fa3", action="store_true", help="only build flashinfer's fa3 module")
    args = parser.parse_args()
    if args.compile_fa3:
        compile_fa3()
        return
    require_backend("cudnn")
    command = command_line()
    budget, rows = Budget(args.budget_s), []
    for case in QUICK if args.quick else SWEEP:
        if budget.spent(case):
            continue
        row = {"case": str(case), "flops": case.flops, "seconds": {}, "notes": []}
        rows.append(row)
        bench_case(case, sum(case.q_lens) <= args.xla_max_tokens, row, lambda: write_results(rows, command))
        print(case, {k: f"{v * 1e6:.0f}us" for k, v in row["seconds"].items()}, row["notes"], flush=True)
    print(write_results(rows, command))


if __name__ == "__main__":
    main()
