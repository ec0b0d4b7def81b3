"""Speculative decode (draft verification) side by side on one GPU: jaxattn's trtllm backend (XQA's
SPEC_DEC kernel) vs flashinfer's XQA with ``q_len_per_req``, and jaxattn's cudnn, triton and xla
backends on the same data.

    python -m benchmarks.bench_spec_decode [--budget-s 200]

Each of B sequences (kv_len uniform in [2048, 4096]; bf16, Hq=32, Hkv=8, D=128, page 64, HND
pages in a randomly permuted pool) verifies q_len draft tokens under the bottom-right causal mask
(``meta.max_q_len = q_len``); q_len = 1 is the plain decode, for reference. Timing as in
``bench_trtllm_decode``: jaxattn backends chain R and 2R calls through their outputs in one jit,
flashinfer replays CUDA graphs of R and 2R calls, per call = (t(2R) - t(R)) / R of medians; the
xla backend is the median wall time of single jitted calls. TB/s counts the K and V bytes a call
must read. ``backend="auto"`` sends these steps to trtllm whole (its plan is printed per case).
Writes the spec-decode section of benchmarks/RESULTS.md (and a copy under $OUT when set).
"""

from __future__ import annotations

import argparse
import math
import traceback

import jax
import jax.numpy as jnp

from benchmarks.common import (HKV, HQ, PAGE, READ_RATE, D, Budget, Case, Inputs, add_torch_peer, command_line,
                               device_name, make_inputs, notes_line, rel_error, repeats_for, require_backend,
                               time_chained, time_single, utc_now, write_section)
from jaxattn.attention import backend_for
from jaxattn.backends import trtllm

KV_LEN = 4096                      # lengths uniform in [KV_LEN / 2, KV_LEN]
CASES = [(b, q) for b in (8, 64) for q in (1, 2, 4, 8, 16)]
PEERS = ("jaxattn trtllm", "flashinfer xqa", "jaxattn cudnn", "jaxattn triton", "jaxattn xla")


def flashinfer_xqa(x: Inputs, case: Case):
    """flashinfer's ``trtllm_batch_decode_with_kv_cache(backend="xqa")`` on the same buffers: a
    zero-argument callable returning its output [B * q_len, Hq, D]; the causal draft mask is the
    one jaxattn builds (``trtllm.spec_inputs``), as flashinfer's uint16 [B, q_len, words]."""
    import torch
    import flashinfer

    batch, q_len = case.batch, case.max_q_len
    as_torch = torch.from_dlpack
    q, k, v = as_torch(x.q), as_torch(x.cache.k_pages), as_torch(x.cache.v_pages)
    tables, lens = as_torch(x.meta.block_tables), as_torch(x.meta.kv_lens)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=q.device)
    spec = {}
    if q_len > 1:
        _, _, mask, _ = trtllm.spec_inputs(x.meta, batch * q_len, q_len, 1 << 30)
        mask16 = jax.lax.bitcast_convert_type(mask, jnp.uint16).reshape(batch, q_len, -1)
        mask16 = as_torch(jax.lax.bitcast_convert_type(mask16, jnp.int16)).view(torch.uint16)
        spec = dict(q_len_per_req=q_len, mask=mask16)
    return lambda: flashinfer.decode.trtllm_batch_decode_with_kv_cache(
        q, (k, v), workspace, tables, lens, case.max_kv_len, bmm1_scale=1 / math.sqrt(D), bmm2_scale=1.0,
        kv_layout="HND", backend="xqa", **spec)


def bench_case(batch: int, q_len: int) -> dict:
    case = Case.decode(batch, KV_LEN, ragged=True, q_len=q_len)
    x = make_inputs(case)
    repeats = repeats_for(case.kv_bytes / READ_RATE)
    row = {"batch": batch, "q_len": q_len, "kv_bytes": case.kv_bytes, "seconds": {}, "notes": [],
           "auto": str(backend_for(x.q, x.cache, x.meta))}
    outs = {}
    for backend in ("trtllm", "cudnn", "triton"):
        try:
            row["seconds"][f"jaxattn {backend}"], outs[backend], _ = time_chained(x, repeats, backend)
        except Exception as err:
            row["notes"].append(f"{backend} failed: {err!r}"[:300])
            traceback.print_exc(limit=2)
    add_torch_peer(row, "flashinfer xqa", lambda: flashinfer_xqa(x, case), repeats, reference=outs.get("trtllm"),
                   against="trtllm")
    try:
        row["seconds"]["jaxattn xla"], ref = time_single(x, "xla")
        row["notes"] += [f"{b} vs xla rel err {rel_error(out, ref):.1e}" for b, out in outs.items()]
    except Exception as err:
        row["notes"].append(f"xla failed: {err!r}"[:200])
    return row


def table(rows: list[dict]) -> str:
    others = PEERS[1:]
    head = ("| B | q_len | " + " | ".join(f"{p} us" for p in PEERS) + " | trtllm TB/s | "
            + " | ".join(f"{p.removeprefix('jaxattn ')} / trtllm" for p in others) + " | auto runs |")
    lines = [head, "|" + "---|" * (4 + len(PEERS) + len(others))]
    for row in rows:
        sec = row["seconds"]
        ours = sec.get("jaxattn trtllm")
        cells = [f"{sec[p] * 1e6:.1f}" if p in sec else "-" for p in PEERS]
        cells.append(f"{row['kv_bytes'] / ours / 1e12:.2f}" if ours else "-")
        cells += [f"{sec[p] / ours:.3f}" if ours and p in sec else "-" for p in others]
        lines.append(f"| {row['batch']} | {row['q_len']} | " + " | ".join(cells) + f" | {row['auto']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop starting new cases after this")
    args = parser.parse_args()
    require_backend("trtllm")
    budget, rows = Budget(args.budget_s), []
    for batch, q_len in CASES:
        if budget.spent(f"B={batch} q_len={q_len}"):
            continue
        rows.append(bench_case(batch, q_len))
        print(f"B={batch} q_len={q_len}", {k: f"{v * 1e6:.1f}us" for k, v in rows[-1]["seconds"].items()},
              rows[-1]["notes"], flush=True)
    text = "\n".join([
        f"- device: {device_name()}; jax {jax.__version__}; flashinfer-python XQA sources (mha.cu, SPEC_DEC)",
        f"- date: {utc_now()}; command: `{command_line()}`",
        f"- bf16, Hq={HQ}, Hkv={HKV}, D={D}, page {PAGE}, HND, kv_len uniform in [{KV_LEN // 2}, {KV_LEN}], "
        "bottom-right causal; q_len draft tokens per sequence (1: plain decode).",
        "- time per call (see the benchmark's docstring); ratios are peer time / jaxattn trtllm time "
        "(> 1: trtllm is faster); TB/s = K+V bytes read / trtllm's time.",
        "",
        table(rows),
        "",
        notes_line(rows, lambda r: f"B={r['batch']} q={r['q_len']}"),
    ])
    print(write_section("spec-decode", text, heading='Speculative decode (`backend="trtllm"`, `max_q_len` 2..16)'))


if __name__ == "__main__":
    main()
