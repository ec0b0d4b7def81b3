"""Paged decode, side by side on one GPU: jaxattn's trtllm (XQA) backend vs its peers on the same data.

    python -m benchmarks.bench_trtllm_decode [--quick | --frontier | --fp8] [--budget-s 240]

Rows (bf16, Hq=32, Hkv=8, D=128, page 64, HND pages in a randomly permuted pool that JAX and
torch share through dlpack; every sequence at kv_len, or uniform in [kv_len / 2, kv_len] for the
"U[..]" row: B=64 kv U[2048,4096] is the point the issue's targets quote):
  * jaxattn ``backend="trtllm"`` (jitted): R decodes chained through their outputs (q <- out) in
    one jit, which XLA captures into one command buffer. Time per decode = (t(2R) - t(R)) / R
    of wall-clock medians, so dispatch and sync cancel. Everything each call launches is
    counted; the token -> sequence / page-table preparation depends only on the metadata and is
    shared by the R calls, as by the layers of a model step. Where a decode reads < 300 MB it is
    timed again with ``JAXATTN_TRTLLM_PDL=0`` (XQA without programmatic dependent launch).
  * flashinfer ``trtllm_batch_decode_with_kv_cache(backend="xqa")`` (torch, the same XQA kernel,
    its default PDL setting) and ``BatchDecodeWithPagedKVCacheWrapper`` (fa2): R calls in a
    CUDA graph, timed with CUDA events, (t(2R) - t(R)) / R likewise.
  * jaxattn ``backend="xla"`` (gather + attention): median wall time of single jitted calls.
  * device copy bandwidth: a jitted elementwise pass over 4 GiB, (read + write bytes) / GPU time
    (``benchmarks.common.copy_bandwidth``).
``--frontier`` runs the low-batch long-context points instead (B in {1, 2, 4} x kv in {16k, 32k,
128k}) with jaxattn's ``triton`` and ``auto`` backends too (chained like trtllm), without the xla
backend, and writes the decode-frontier section. ``--fp8`` runs B=64 (kv U[2048,4096] and 4096),
B=256 kv 4096 and B=8 kv 32768 with the pages also in float8_e4m3fn: jaxattn trtllm and flashinfer
xqa on those (XQA's Hopper fp8 kernel), against bf16; it writes the fp8-decode section.
TB/s counts the K and V bytes each decode must read. Writes the trtllm section of
benchmarks/RESULTS.md (and a copy under $OUT when set).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import traceback

# JAX and torch share the GPU (and the cache, through dlpack): leave torch room for workspaces.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.7")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import (  # noqa: E402
    HKV, HQ, PAGE, READ_RATE, D, Budget, Case, Inputs, add_torch_peer, command_line, copy_bandwidth, device_name,
    fp8_inputs, make_inputs, notes_line, rel_error, repeats_for, require_backend, time_chained, time_single,
    torch_peers, utc_now, write_section)
from jaxattn.backends import _xqa_build, trtllm  # noqa: E402
from jaxattn.backends.base import AttentionParams  # noqa: E402

PEERS = ("jaxattn trtllm", "jaxattn triton", "jaxattn auto", "flashinfer xqa", "flashinfer fa2", "jaxattn xla",
         "jaxattn trtllm fp8", "flashinfer xqa fp8")
KEY_CASE = Case.decode(64, 4096)
TARGET_CASE = Case.decode(64, 4096, ragged=True)
SWEEP = [TARGET_CASE, KEY_CASE] + [Case.decode(b, n) for b in (1, 8, 64, 256) for n in (512, 4096, 32768)
                                   if (b, n) != (64, 4096)]
QUICK = [TARGET_CASE, KEY_CASE, Case.decode(1, 512), Case.decode(256, 32768)]
# Low batch, long context: too few (request, KV head) pairs to fill the GPU without splitting keys.
FRONTIER = [Case.decode(b, n) for b in (1, 2, 4) for n in (16384, 32768, 131072)]
FP8_CASES = [TARGET_CASE, KEY_CASE, Case.decode(256, 4096), Case.decode(8, 32768)]


def host_executions(x: Inputs) -> int:
    """How often the XQA handler's host code ran (only when XLA records a command buffer)."""
    params = AttentionParams(1 / math.sqrt(D), True, None, None, False)
    lib = _xqa_build.load(trtllm.variant(x.q, x.cache, params)).library
    lib.jaxattn_xqa_host_executions.restype = ctypes.c_int64
    return lib.jaxattn_xqa_host_executions()


def time_trtllm(x: Inputs, repeats: int, trials: int = 9) -> tuple[float, jax.Array, str]:
    """Seconds per decode of jaxattn trtllm, one call's output, and how often the handler's host
    code ran for how many calls."""
    recorded = host_executions(x)
    seconds, out, calls = time_chained(x, repeats, "trtllm", trials)
    return seconds, out, f"handler host runs {host_executions(x) - recorded} for {calls} calls"


def flashinfer_runners(case: Case, x: Inputs) -> dict:
    """name -> zero-argument callable returning the output tensor [B, Hq, D]."""
    import torch
    import flashinfer

    q = torch.from_dlpack(x.q)
    k = torch.from_dlpack(x.cache.k_pages)
    v = torch.from_dlpack(x.cache.v_pages)
    tables = torch.from_dlpack(x.meta.block_tables)
    lens = torch.from_dlpack(x.meta.kv_lens)
    dev = q.device
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    scale = 1 / math.sqrt(D)

    def xqa(enable_pdl=None):
        return lambda: flashinfer.decode.trtllm_batch_decode_with_kv_cache(
            q, (k, v), workspace, tables, lens, case.max_kv_len, bmm1_scale=scale, bmm2_scale=1.0,
            kv_layout="HND", backend="xqa", enable_pdl=enable_pdl)

    lens_host = np.asarray(case.kv_lens)
    pages = -(-lens_host // PAGE)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(pages)]), dtype=torch.int32, device=dev)
    indices = torch.cat([tables[b, :n] for b, n in enumerate(pages)])
    last = torch.tensor((lens_host - 1) % PAGE + 1, dtype=torch.int32, device=dev)
    fa2_workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(fa2_workspace, "HND")
    wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16)
    return {"flashinfer xqa": xqa(), "flashinfer xqa, PDL off": xqa(False),
            "flashinfer fa2": lambda: wrapper.run(q, (k, v))}


def flashinfer_fp8_runner(case: Case, x8: Inputs):
    """flashinfer's XQA on ``x8``'s float8_e4m3fn pages (q bf16): a zero-argument callable."""
    import torch
    import flashinfer

    def fp8_tensor(pages: jax.Array) -> torch.Tensor:     # DLPack has no float8: go through bytes
        return torch.from_dlpack(jax.lax.bitcast_convert_type(pages, jnp.uint8)).view(torch.float8_e4m3fn)

    q = torch.from_dlpack(x8.q)
    k, v = fp8_tensor(x8.cache.k_pages), fp8_tensor(x8.cache.v_pages)
    tables = torch.from_dlpack(x8.meta.block_tables)
    lens = torch.from_dlpack(x8.meta.kv_lens)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    k_scale, v_scale = float(x8.cache.k_scale), float(x8.cache.v_scale)
    return lambda: flashinfer.decode.trtllm_batch_decode_with_kv_cache(
        q, (k, v), workspace, tables, lens, case.max_kv_len, bmm1_scale=k_scale / math.sqrt(D), bmm2_scale=v_scale,
        kv_layout="HND", backend="xqa")


def bench_case(case: Case, with_xla: bool, backends: tuple[str, ...] = (), fp8: bool = False) -> dict:
    """One row: jaxattn trtllm, the other jaxattn ``backends`` (chained like trtllm), the torch
    peers, (``with_xla``) the xla backend and (``fp8``) jaxattn trtllm and flashinfer xqa on the
    same pages in float8_e4m3fn."""
    x = make_inputs(case)
    repeats = repeats_for(case.kv_bytes / READ_RATE)
    row = {"case": case, "seconds": {}, "notes": []}
    row["seconds"]["jaxattn trtllm"], out, host_note = time_trtllm(x, repeats)
    row["notes"].append(host_note)
    if case.kv_bytes < 300e6:  # where a launch's latency shows
        os.environ["JAXATTN_TRTLLM_PDL"] = "0"
        try:
            row["seconds"]["jaxattn trtllm, PDL off"] = time_trtllm(x, repeats)[0]
        finally:
            del os.environ["JAXATTN_TRTLLM_PDL"]
    for backend in backends:
        row["seconds"][f"jaxattn {backend}"], other, _ = time_chained(x, repeats, backend)
        row["notes"].append(f"{backend} vs trtllm rel err {rel_error(other, out):.1e}")
    for name, fn in torch_peers(row, lambda: flashinfer_runners(case, x)).items():
        add_torch_peer(row, name, lambda fn=fn: fn, repeats, reference=out if name == "flashinfer xqa" else None,
                       against="jaxattn trtllm")
    if fp8:
        x8 = fp8_inputs(x)
        row["seconds"]["jaxattn trtllm fp8"], out8, _ = time_chained(x8, repeats, "trtllm")
        row["notes"].append(f"fp8 vs bf16 pages rel err {rel_error(out8, out):.1e}")
        add_torch_peer(row, "flashinfer xqa fp8", lambda: flashinfer_fp8_runner(case, x8), repeats, reference=out8,
                       against="jaxattn trtllm fp8")
    if with_xla:
        try:
            row["seconds"]["jaxattn xla"], ref = time_single(x, "xla")
            row["notes"].append(f"trtllm vs xla rel err {rel_error(out, ref):.1e}")
        except Exception as err:
            row["notes"].append(f"xla failed: {err!r}"[:200])
    return row


def bytes_read(case: Case, implementation: str) -> int:
    """K and V bytes one decode reads: half of bf16's from float8 pages."""
    return case.kv_bytes // 2 if implementation.endswith("fp8") else case.kv_bytes


def table(rows: list[dict], copy_rate: float, ours: str = "jaxattn trtllm") -> str:
    """One column per implementation that has a time in some row; ratios against ``ours``."""
    peers = [p for p in PEERS if any(p in r["seconds"] for r in rows)]
    others = [p for p in peers if p != ours]

    def label(p: str) -> str:
        return p.removeprefix("jaxattn ").replace("flashinfer xqa", "fi-xqa").removeprefix("flashinfer ")

    head = ("| case | " + " | ".join(f"{p} us (TB/s)" for p in peers) + " | "
            + " | ".join(f"{label(ours)} / {label(p)}" for p in others) + f" | {label(ours)} / copy |")
    lines = [head, "|" + "---|" * (len(peers) + len(others) + 2)]
    for row in rows:
        sec, case = row["seconds"], row["case"]
        cells = [f"{sec[p] * 1e6:.1f} ({bytes_read(case, p) / sec[p] / 1e12:.2f})" if p in sec else "-" for p in peers]
        t = sec.get(ours)
        ratios = [f"{sec[p] / t:.3f}" if t and p in sec else "-" for p in others]
        ratios.append(f"{bytes_read(case, ours) / t / copy_rate:.2f}" if t else "-")
        lines.append(f"| {case} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def summary(rows: list[dict], copy_rate: float) -> list[str]:
    """The numbers the issue's targets are stated in."""
    lines = []
    for peer in ("flashinfer xqa", "flashinfer xqa, PDL off"):
        ratios = [(r["seconds"][peer] / r["seconds"]["jaxattn trtllm"], str(r["case"])) for r in rows
                  if peer in r["seconds"] and "jaxattn trtllm" in r["seconds"]]
        if ratios:
            worst = min(ratios)
            lines.append(f"- jaxattn trtllm / {peer}: min {worst[0]:.3f} ({worst[1]}) over {len(ratios)} cases; "
                         f"{sum(v >= 0.98 for v, _ in ratios)} of them >= 0.98.")
    for r in rows:
        sec = r["seconds"]
        if r["case"] == TARGET_CASE and "jaxattn trtllm" in sec:
            vs_xla = f"{sec['jaxattn xla'] / sec['jaxattn trtllm']:.2f}x the xla backend" if "jaxattn xla" in sec else "xla not run"
            lines.append(f"- target point {TARGET_CASE}: {vs_xla}; KV read "
                         f"{TARGET_CASE.kv_bytes / sec['jaxattn trtllm'] / copy_rate:.2f} of the copy rate.")
    return lines


def write_results(rows: list[dict], copy_rate: float, command: str, update: bool = True) -> str:
    pdl = {name: [f"{r['case']}: {r['seconds'][name] * 1e6:.1f}" for r in rows if name in r["seconds"]]
           for name in ("flashinfer xqa, PDL off", "jaxattn trtllm, PDL off")}
    text = "\n".join([
        f"- device: {device_name()}; jax {jax.__version__}; flashinfer-python XQA sources, SM90 generic kernel (mha.cu)",
        f"- date: {utc_now()}; command: `{command}`",
        f"- bf16, Hq={HQ}, Hkv={HKV}, D={D}, page {PAGE}, HND, randomly permuted pool, every sequence at kv_len",
        f"  (U[a,b]: lengths uniform in [a, b], the issue's target point {TARGET_CASE}).",
        f"- device copy bandwidth (read + write, a jitted pass over 4 GiB): {copy_rate / 1e12:.2f} TB/s.",
        "- time per decode (median; see the benchmark's docstring); TB/s = K+V bytes read / time;",
        "  ratios are speed ratios (peer time / jaxattn trtllm time: > 1 means jaxattn is faster);",
        "  trtllm / copy = jaxattn's KV read rate over the copy rate.",
        "",
        table(rows, copy_rate),
        "",
        "flashinfer xqa with PDL off, us: " + ", ".join(pdl["flashinfer xqa, PDL off"]) + ".",
        "",
        "jaxattn trtllm with PDL off (`JAXATTN_TRTLLM_PDL=0`), us: " + ", ".join(pdl["jaxattn trtllm, PDL off"]) + ".",
        "",
        *summary(rows, copy_rate),
        "",
        notes_line(rows),
    ])
    return write_section("trtllm-decode", text, heading='TRTLLM / XQA paged decode (`backend="trtllm"`)',
                         update=update)


def write_comparison(rows: list[dict], copy_rate: float, command: str, *, section: str, heading: str, ours: str,
                     peer: str, setup: str) -> str:
    """A section of every implementation's time per case, with ratios against ``ours`` and, per
    case, ``ours`` against the copy rate and ``peer``, and the fastest jaxattn row."""
    lines = []
    for r in rows:
        sec = r["seconds"]
        if ours not in sec:
            continue
        vs_peer = f", {sec[peer] / sec[ours]:.2f}x {peer}" if peer in sec else ""
        fastest = min((p for p in sec if p.startswith("jaxattn")), key=sec.get)
        lines.append(f"- {r['case']}: {ours} {bytes_read(r['case'], ours) / sec[ours] / copy_rate:.2f} of the copy "
                     f"rate{vs_peer}; fastest jaxattn row: {fastest}")
    text = "\n".join([
        f"- device: {device_name()}; jax {jax.__version__}; "
        f"date: {utc_now()}; command: `{command}`",
        f"- {setup}; device copy bandwidth {copy_rate / 1e12:.2f} TB/s; time per decode as in the trtllm section",
        f"  (jaxattn backends chained in one jit, flashinfer in a CUDA graph); ratios: peer time / {ours} time.",
        "",
        table(rows, copy_rate, ours=ours),
        "",
        *lines,
        "",
        notes_line(rows),
    ])
    return write_section(section, text, heading=heading)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three cases only")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this")
    parser.add_argument("--xla-max-tokens", type=int, default=64 * 4096, help="skip the xla backend above B * kv_len")
    parser.add_argument("--cases", default="", help="only these sweep cases, e.g. '1x512,8x512' (B x kv_len); "
                        "the table then goes to stdout and $OUT, not RESULTS.md")
    parser.add_argument("--fp8", action="store_true",
                        help="float8_e4m3fn pages: jaxattn trtllm vs flashinfer xqa on them, and vs bf16 pages "
                             "(the fp8-decode section)")
    parser.add_argument("--frontier", action="store_true",
                        help="the low-batch long-context points instead, with jaxattn's triton and auto backends too "
                             "(the decode-frontier section)")
    args = parser.parse_args()
    require_backend("trtllm")
    copy_rate = copy_bandwidth()
    print(f"device copy bandwidth: {copy_rate / 1e12:.2f} TB/s", flush=True)
    budget, rows = Budget(args.budget_s), []
    cases = FRONTIER if args.frontier else FP8_CASES if args.fp8 else QUICK if args.quick else SWEEP
    if args.cases:
        wanted = {str(Case.decode(*(int(n) for n in c.split("x")))) for c in args.cases.split(",")}
        cases = [c for c in SWEEP if str(c) in wanted]
    for case in cases:
        if budget.spent(case):
            continue
        try:
            with_xla = not (args.frontier or args.fp8) and sum(case.kv_lens) <= args.xla_max_tokens
            row = bench_case(case, with_xla=with_xla, backends=("triton", "auto") if args.frontier else (), fp8=args.fp8)
        except Exception:  # e.g. out of memory: report the others
            traceback.print_exc(limit=3)
            continue
        rows.append(row)
        print(case, {k: f"{v * 1e6:.1f}us" for k, v in row["seconds"].items()}, row["notes"], flush=True)
    command = command_line()
    setup = f"bf16 q, Hq={HQ}, Hkv={HKV}, D={D}, page {PAGE}, HND, randomly permuted pool"
    if args.frontier:
        print(write_comparison(rows, copy_rate, command, section="decode-frontier",
                               heading="Decode frontier (low batch, long context)", ours="jaxattn auto",
                               peer="flashinfer xqa", setup=f"{setup}, bf16 pages"))
    elif args.fp8:
        print(write_comparison(rows, copy_rate, command, section="fp8-decode",
                               heading="FP8 KV decode (`backend=\"trtllm\"`, float8_e4m3fn pages)",
                               ours="jaxattn trtllm fp8", peer="flashinfer xqa fp8",
                               setup=f"{setup}; fp8 rows: the bf16 pages scaled per pool to a largest "
                                     "magnitude of 448 and stored as float8_e4m3fn (half the bytes; TB/s "
                                     "counts the bytes read)"))
    else:
        print(write_results(rows, copy_rate, command, update=not args.cases))


if __name__ == "__main__":
    main()
