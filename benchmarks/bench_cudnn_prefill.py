"""Paged prefill, side by side on one GPU: jaxattn's cuDNN backend vs its peers on the same data.

    python -m benchmarks.bench_cudnn_prefill [--quick] [--budget-s 240]

Rows: jaxattn ``backend="cudnn"`` (jitted), flashinfer ``cudnn_batch_prefill_with_kv_cache``
(torch, the same cuDNN kernel), flashinfer ``BatchPrefillWithPagedKVCacheWrapper`` (fa3 on
SM90) and jaxattn ``backend="xla"``. Causal (bottom-right) prefill, bf16, Hq=32, Hkv=8, D=128,
page 64, HND pages in a randomly permuted pool shared by JAX and torch (dlpack, no copies).

Timing, compile and graph builds excluded, median of repeats after warm-up:
  * JAX: one jitted call runs R dependent prefills back to back (unrolled, so XLA captures them
    into one command buffer), its result in a donated buffer fed back so the command buffer is
    replayed, not re-recorded; 10 calls back to back, time per prefill = wall time / (10 R). The
    chain adds one tiny fusion per prefill; jaxattn's own length/offset preparation is counted.
  * torch: R calls captured in a CUDA graph (eager if capture fails), timed with CUDA events.
TFLOP/s count 4 * D * Hq * (visible query-key pairs). Writes the table into the cuDNN section of
benchmarks/RESULTS.md (and $OUT when set).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import statistics
import sys
import time
import traceback

# JAX and torch share the GPU: leave torch (flashinfer workspaces, fa3) room.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxattn  # noqa: E402
from benchmarks.common import (  # noqa: E402
    HKV, HQ, PAGE, D, Inputs, device_name, make_inputs, rel_error, write_section)
from jaxattn import _ffi_cudnn  # noqa: E402

PEERS = ("jaxattn cudnn", "flashinfer cudnn", "flashinfer fa3", "jaxattn xla")


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    q_len: int      # new tokens per sequence
    kv_len: int     # total tokens per sequence (context + new)

    @property
    def flops(self) -> float:
        pairs = self.q_len * self.kv_len - self.q_len * (self.q_len - 1) / 2
        return 4.0 * D * HQ * pairs * self.batch

    def __str__(self) -> str:
        ctx = "" if self.q_len == self.kv_len else f" over {self.kv_len}"
        return f"B={self.batch} x {self.q_len}{ctx}"


SWEEP = [Case(8, 4096, 4096), Case(1, 512, 512), Case(1, 2048, 2048), Case(1, 8192, 8192), Case(4, 1024, 1024),
         Case(4, 4096, 4096), Case(8, 512, 512), Case(8, 2048, 2048), Case(16, 1024, 1024), Case(16, 2048, 2048),
         Case(4, 300, 1200)]
QUICK = [Case(8, 4096, 4096), Case(1, 512, 512), Case(4, 300, 1200)]


def repeats_for(case: Case, rate: float = 4e14, target_s: float = 2e-3) -> int:
    """Prefills per timed call: enough work to hide one dispatch."""
    return int(min(32, max(1, math.ceil(target_s / (case.flops / rate)))))


def time_jax(x: Inputs, backend: str, repeats: int, trials: int = 7, calls: int = 10) -> tuple[float, jax.Array]:
    """Seconds per prefill: a jitted chain of `repeats` dependent prefills, called `calls` times
    back to back. The result goes into a donated buffer that is passed back in, so buffer
    addresses repeat and XLA replays its recorded command buffer (fresh output addresses would
    make it re-record the cuDNN call, host work included, on every call)."""

    def chain(q, cache, meta, zero, out):
        for _ in range(repeats):
            step_meta = dataclasses.replace(meta, kv_lens=meta.kv_lens + zero)
            out = jaxattn.paged_attention(q, cache, step_meta, backend=backend)
            zero = (out[0, 0, 0] * 0).astype(jnp.int32)
        return out

    chain = jax.jit(chain, donate_argnums=4)
    zero = jnp.zeros((), jnp.int32)
    out = jnp.zeros(x.q.shape, x.q.dtype)
    for _ in range(3):
        out = chain(x.q, x.cache, x.meta, zero, out)
    out.block_until_ready()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            out = chain(x.q, x.cache, x.meta, zero, out)
        out.block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / (repeats * calls), out


def time_torch(fn, repeats: int, trials: int = 7) -> tuple[float, str]:
    """Seconds per call of `fn` (already warmed up): CUDA graph of `repeats` calls, else eager."""
    import torch

    mode = "graph"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeats):
                fn()
        run = graph.replay
        run()
    except Exception as err:  # a peer that cannot be captured is timed eagerly
        print(f"    (CUDA graph capture failed: {str(err)[:160]}; timing eagerly)")
        mode = "eager"

        def run():
            for _ in range(repeats):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3)
    return statistics.median(times) / repeats, mode


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
    b = case.batch
    seq_q = torch.full((b, 1, 1, 1), case.q_len, dtype=torch.int32, device=dev)
    seq_kv = torch.full((b, 1, 1, 1), case.kv_len, dtype=torch.int32, device=dev)
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * case.q_len
    scale = 1 / math.sqrt(D)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    runners = {}

    def cudnn_call():
        return cudnn_batch_prefill_with_kv_cache(
            q, k, v, scale, workspace, max_token_per_sequence=case.q_len, max_sequence_kv=case.kv_len,
            actual_seq_lens_q=seq_q, actual_seq_lens_kv=seq_kv, block_tables=tables, causal=True,
            return_lse=False, batch_offsets_q=indptr, batch_offsets_o=indptr, batch_offsets_units="tokens",
            is_cuda_graph_compatible=True)[0]
    runners["flashinfer cudnn"] = lambda: cudnn_call

    def fa3():   # plans (and JIT-compiles the kernel on first use)
        pages_per_seq = tables.shape[1]
        kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * pages_per_seq
        last = torch.full((b,), (case.kv_len - 1) % PAGE + 1, dtype=torch.int32, device=dev)
        fa3_workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(fa3_workspace, "HND", backend="fa3")
        wrapper.plan(indptr, kv_indptr, tables.reshape(-1), last, HQ, HKV, D, PAGE, causal=True,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        return lambda: wrapper.run(q, (k, v))
    runners["flashinfer fa3"] = fa3
    return runners


def bench_case(case: Case, with_xla: bool, row: dict, save) -> None:
    """Fills `row` peer by peer, calling save() after each (a run cut off keeps what it measured)."""
    import torch

    x = make_inputs(case.batch, case.q_len, case.kv_len)
    repeats = repeats_for(case)
    seconds, out = time_jax(x, "cudnn", repeats)
    row["seconds"]["jaxattn cudnn"] = seconds
    save()
    out_torch = torch.from_dlpack(out)
    try:
        runners = flashinfer_runners(case, x)   # fa3 compiles on first use
    except Exception as err:
        runners = {}
        row["notes"].append(f"flashinfer setup failed: {err!r}"[:200])
    for name, factory in runners.items():
        try:
            fn = factory()
            peer_out = fn()
            torch.cuda.synchronize()
            err = (peer_out.float() - out_torch.float()).norm() / peer_out.float().norm()
            row["notes"].append(f"{name} vs jaxattn rel err {err.item():.1e}")
            row["seconds"][name], mode = time_torch(fn, repeats)
            if mode != "graph":
                row["notes"].append(f"{name} timed eagerly")
            save()
        except Exception as err:
            row["notes"].append(f"{name} failed: {err!r}"[:300])
            traceback.print_exc(limit=2)
    if with_xla:
        try:
            row["seconds"]["jaxattn xla"], ref = time_jax(x, "xla", 1, trials=3, calls=2)
            row["notes"].append(f"cudnn vs xla rel err {rel_error(out, ref):.1e}")
        except Exception as err:
            row["notes"].append(f"xla failed: {err!r}"[:200])


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


def write_results(rows: list[dict], command: str) -> str:
    lib = _ffi_cudnn
    text = "\n".join([
        f"- device: {device_name()}; cuDNN {lib.format_version(lib.cudnn_version() or 0)}, jax {jax.__version__}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; command: `{command}`",
        f"- bf16, causal (bottom-right), Hq={HQ}, Hkv={HKV}, D={D}, page {PAGE}, HND, randomly permuted pool.",
        "- time per prefill, median; ratios are speed ratios (peer time / jaxattn cudnn time; > 1: jaxattn faster).",
        "",
        table(rows),
        "",
        "Notes: " + "; ".join(f"{r['case']}: " + ", ".join(r["notes"]) for r in rows if r["notes"]),
    ])
    return write_section("cudnn-prefill", text, heading='cuDNN paged prefill (`backend="cudnn"`)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three cases only")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this")
    parser.add_argument("--xla-max-tokens", type=int, default=16384, help="skip the xla backend above this")
    args = parser.parse_args()
    reason = jaxattn.backends.unavailable_reason("cudnn")
    if reason:
        sys.exit(f"backend cudnn unavailable: {reason}")
    command = " ".join(["python -m benchmarks.bench_cudnn_prefill"] + sys.argv[1:])
    start, rows = time.time(), []
    for case in QUICK if args.quick else SWEEP:
        if time.time() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f}s spent; skipping {case}")
            continue
        row = {"case": str(case), "flops": case.flops, "seconds": {}, "notes": []}
        rows.append(row)
        bench_case(case, case.batch * case.q_len <= args.xla_max_tokens, row, lambda: write_results(rows, command))
        print(case, {k: f"{v * 1e6:.0f}us" for k, v in row["seconds"].items()}, row["notes"], flush=True)
    print(write_results(rows, command))


if __name__ == "__main__":
    main()
