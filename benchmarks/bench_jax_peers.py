"""Paged attention in JAX, side by side on one GPU: jaxattn ``auto`` against the JAX libraries a
user would pick instead, on the same data, in the same run.

    python -m benchmarks.bench_jax_peers [--quick] [--budget-s 420] [--rounds 3]

Peers, installed on the device as wheels with ``--no-deps`` (``scripts/fetch_peer_wheels.sh`` fetches them):
  * flash-attn3-jax 0.2.3 ``flash_mha_with_kvcache`` (FlashAttention-3 through XLA FFI, SM90): NHD
    pages, one query length for the whole batch (decode, speculative decode, prefill; a mixed
    batch is not expressible); its ``num_splits`` is a static argument with no heuristic (default
    1), so each workload reports the best of 1, 4 and 16;
  * ejkernel 0.0.80.3 ``ragged_page_attention_v2`` (Triton; packed ragged queries, every
    workload): K and V interleaved per KV head in one pool ``[pages, page, 2 * Hkv, D]``; both its
    default and its ``optimized=True`` kernel;
  * ejkernel ``page_attention`` (Triton, decode only): HND pools ``[pages, Hkv, page, D]`` (its
    type hints say head-major; its kernel indexes pages first);
  * JAX's deprecated ``jax.experimental.pallas.ops.gpu.paged_attention`` (decode only):
    head-major pools; it applies no softmax scale, so q is pre-scaled by 1/sqrt(D);
  * fa4-jax 0.1.0 ``flash_attn_varlen`` (FlashAttention-4's CuTe DSL kernels through cutejax and
    TVM-FFI; needs Python >= 3.12 and nvidia-cutlass-dsl): it has no paged KV, so each sequence's
    keys and values are gathered from the pages into one packed ``[sum(kv_lens), Hkv, D]`` pair
    (``cu_seqlens_k`` over them) and the queries stay packed as they are (``cu_seqlens_q``):
    every workload, decodes as one query per sequence. Its SM90 kernel has no split-KV and no
    GQA packing (``pack_gqa=False``), which its decode rows show.
Each peer gets its layout converted (or its KV gathered) outside the timed region; a peer that
is not installed, cannot express a workload, or fails on it, is listed with the reason instead
of a time.

Workloads (bf16, Hq=32, Hkv=8, D=128, page 64, causal, HND pages in a randomly permuted pool):
decodes (the B=64 kv U[2048,4096] target point first, the low-batch long-context frontier points
against the copy rate), prefill B=8 x 4096 and B=1 x 512, chunked prefill (B=4, 300 new tokens
over 1200), a mixed batch of 63 decodes and an 8192-token prefill, and speculative decode (4
tokens per sequence). jaxattn's row names the backends its ``auto`` plan ran
(``jaxattn.attention.backend_for``: from the GPU's measured table, ``jaxattn/tuning/``). A second
jaxattn row, "jaxattn auto, run with a step's plan", times the same call given a plan made
beforehand (``jaxattn.plan``): what each layer of a model pays when its step plans once. "vs auto"
and the headline compare every peer with the first row, planning included.

Time: GPU busy time per call (the summed durations of the kernels each call launches, from the
profiler: ``benchmarks.common.device_busy_seconds``), median of ``--rounds`` rounds of 10 calls,
after a warm-up call; compilation excluded. Every jitted call includes what it needs per step
(jaxattn's metadata preparation, FA3's split combine). "vs auto" is peer time / jaxattn auto time
(above 1: jaxattn is faster). The error column is each peer's relative error against jaxattn
auto's output (jaxattn's own row: against the xla backend, where it fits). Writes the jax_peers
section of benchmarks/RESULTS.md (and a copy under $OUT when set).

ejkernel's ``ragged_page_attention_v2`` kernels do not compile under Triton 3.6 (one never
finishes, which ends the run through the watchdog; see RESULTS.md), so ``--skip-peers`` leaves
them out unless it is given (``--skip-peers ''``: every peer). The full grid with every other peer
(no new workload starts after 480 s, so that the run ends within 9 minutes):

    python -m benchmarks.bench_jax_peers --peer-timeout-s 120 --budget-s 480
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import math
import os
import re
import statistics
import sys
import time
import traceback
from typing import Callable

os.environ.setdefault("TF_GPU_ALLOCATOR", "bfc")  # ejkernel's import would switch XLA to cuda_malloc_async

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxattn  # noqa: E402
from benchmarks.common import (  # noqa: E402
    HKV, HQ, D, Budget, Case, command_line, copy_bandwidth, device_busy_seconds, device_name, make_inputs, rel_error,
    write_section)
from jaxattn.attention import backend_for  # noqa: E402

SCALE = 1 / math.sqrt(D)
FA3_SPLITS = (1, 4, 16)
SLOW_CALL_S = 0.2


def decode(batch: int, kv_len: int, ragged: bool = False) -> Case:
    case = Case.decode(batch, kv_len, ragged)
    return dataclasses.replace(case, name=f"decode {case.name}")


def prefill(batch: int, q_len: int, kv_len: int | None = None) -> Case:
    """A prefill, or (``kv_len`` given) a chunked prefill: ``q_len`` new tokens after ``kv_len - q_len``."""
    case = Case.prefill(batch, q_len, kv_len)
    return dataclasses.replace(case, name=f"{'chunked ' if kv_len else ''}prefill {case.name}")


WORKLOADS = [
    decode(64, 4096, ragged=True),
    decode(64, 4096),
    prefill(8, 4096), prefill(1, 512), prefill(4, 300, 1200),
    Case("mixed 63 decodes + 8192 prefill", (1,) * 63 + (8192,), (4096,) * 63 + (8192,)),
    Case("spec decode B=64 x 4 kv=4096", (4,) * 64, (4096,) * 64),
    decode(1, 32768), decode(4, 32768), decode(1, 131072), decode(4, 131072), decode(2, 16384),
    decode(1, 4096), decode(256, 4096),
]
QUICK = WORKLOADS[:3]

Call = Callable[[], jax.Array]
PLANNED = "jaxattn auto, run with a step's plan"


@dataclasses.dataclass
class Problem:
    """One workload's data in jaxattn's layout, and the views the peers take."""
    w: Case
    q: jax.Array                          # [T, Hq, D]
    cache: jaxattn.KVCache                # HND
    meta: jaxattn.AttentionMetadata

    @property
    def uniform_q_len(self) -> int | None:
        return self.w.q_lens[0] if len(set(self.w.q_lens)) == 1 else None

    def nhd(self) -> tuple[jax.Array, jax.Array]:
        return jnp.swapaxes(self.cache.k_pages, 1, 2), jnp.swapaxes(self.cache.v_pages, 1, 2)

    def head_major(self) -> tuple[jax.Array, jax.Array]:
        return (jnp.transpose(self.cache.k_pages, (1, 0, 2, 3)),
                jnp.transpose(self.cache.v_pages, (1, 0, 2, 3)))

    def packed(self) -> tuple[jax.Array, jax.Array]:
        """Each sequence's keys and values gathered from its pages, sequences one after another:
        ``[sum(kv_lens), Hkv, D]`` each."""
        tables, page = np.asarray(self.meta.block_tables), self.cache.page_size
        seq = np.repeat(np.arange(self.w.batch), self.w.kv_lens)
        pos = np.concatenate([np.arange(n) for n in self.w.kv_lens])
        gather = jax.jit(lambda pool, pages, slots: pool[pages, :, slots])     # HND: [N, Hkv, D]
        pages, slots = jnp.asarray(tables[seq, pos // page]), jnp.asarray(pos % page, jnp.int32)
        return gather(self.cache.k_pages, pages, slots), gather(self.cache.v_pages, pages, slots)


def jaxattn_auto(p: Problem) -> Call:
    fn = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="auto"))
    return lambda: fn(p.q, p.cache, p.meta)


def jaxattn_planned(p: Problem) -> Call:
    """``auto`` run with the step's plan made beforehand (``jaxattn.plan``): what each layer of a
    model pays, the metadata work being done once per step."""
    plan = jax.jit(lambda m, c, q: jaxattn.plan(m, c, q))(p.meta, p.cache, p.q)
    fn = jax.jit(lambda q, c, plan: jaxattn.paged_attention(q, c, plan))
    return lambda: fn(p.q, p.cache, plan)


def fa3(p: Problem, num_splits: int) -> Call:
    from flash_attn3_jax import flash_mha_with_kvcache
    q_len = p.uniform_q_len
    if q_len is None:
        raise NotImplementedError("one query length per batch only (no mixed batches)")
    k, v = p.nhd()
    q = p.q.reshape(len(p.w.q_lens), q_len, HQ, D)
    fn = jax.jit(lambda q, k, v, lens, tables: flash_mha_with_kvcache(
        q, k, v, cache_seqlens=lens, page_table=tables, softmax_scale=SCALE, is_causal=True,
        num_splits=num_splits).reshape(-1, HQ, D))
    return lambda: fn(q, k, v, p.meta.kv_lens, p.meta.block_tables)


def ejkernel_ragged_v2(p: Problem, optimized: bool) -> Call:
    from ejkernel.kernels._triton.ragged_page_attention_v2 import ragged_page_attention_v2
    k, v = p.nhd()
    pages = jnp.stack([k, v], axis=3).reshape(k.shape[0], k.shape[1], 2 * HKV, D)
    del k, v
    batch = len(p.w.q_lens)
    fn = jax.jit(lambda q, pages, lens, tables, cu: ragged_page_attention_v2(
        q, pages, lens, tables, cu, batch, softmax_scale=SCALE, optimized=optimized))
    return lambda: fn(p.q, pages, p.meta.kv_lens, p.meta.block_tables, p.meta.cu_q_lens)


def ejkernel_page_attention(p: Problem) -> Call:
    from ejkernel.kernels._triton.page_attention import page_attention
    if p.w.max_q_len > 1:
        raise NotImplementedError("decode only")
    k, v = p.cache.k_pages, p.cache.v_pages      # it reads [pages, Hkv, page, D] (HND), whatever its hints say
    fn = jax.jit(lambda q, k, v, lens, tables: page_attention(
        q, k, v, lens, tables, attn_scale=SCALE, max_context_len=max(p.w.kv_lens)))
    return lambda: fn(p.q, k, v, p.meta.kv_lens, p.meta.block_tables)


def pallas_gpu(p: Problem) -> Call:
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged
    if p.w.max_q_len > 1:
        raise NotImplementedError("decode only")
    k, v = p.head_major()
    q = p.q * jnp.asarray(SCALE, p.q.dtype)      # it applies no 1/sqrt(D)
    # Its default 8-page compute blocks (512 keys at page 64) ask for more shared memory than an
    # H100 has: blocks of 256 keys, and the most of its 16 default splits that divide the pages.
    pages = p.meta.block_tables.shape[1]
    block = min(max(1, 256 // p.cache.page_size), pages)
    splits = next(s for s in (16, 8, 4, 2, 1) if pages % (block * s) == 0)
    fn = jax.jit(lambda q, k, v, tables, lens: pallas_paged.paged_attention(
        q, k, v, tables, lens, k_splits=splits, pages_per_compute_block=block))
    return lambda: fn(q, k, v, p.meta.block_tables, p.meta.kv_lens)


def fa4_jax_varlen(p: Problem) -> Call:
    import fa4_jax
    k, v = p.packed()
    cu_k = jnp.asarray(np.cumsum([0, *p.w.kv_lens]), jnp.int32)
    fn = jax.jit(lambda q, k, v, cu_q, cu_k: fa4_jax.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True, scale=SCALE))
    return lambda: fn(p.q, k, v, p.meta.cu_q_lens, cu_k)


PEERS: dict[str, Callable[[Problem], Call]] = {
    "ejkernel ragged_page_attention_v2": lambda p: ejkernel_ragged_v2(p, optimized=False),
    "ejkernel ragged_page_attention_v2 optimized": lambda p: ejkernel_ragged_v2(p, optimized=True),
    "ejkernel page_attention": ejkernel_page_attention,
    "jax pallas gpu paged_attention": pallas_gpu,
    **{f"flash-attn3-jax splits={s}": (lambda p, s=s: fa3(p, s)) for s in FA3_SPLITS},
    "fa4-jax flash_attn_varlen": fa4_jax_varlen,
}


def busy_ms(call: Call, rounds: int, calls: int = 10) -> float:
    """Median GPU time per call; a call slower than ``SLOW_CALL_S`` (wall) is timed once, so that
    a slow peer gives a number instead of running into the watchdog."""
    jax.block_until_ready(call())
    start = time.perf_counter()
    jax.block_until_ready(call())
    if time.perf_counter() - start > SLOW_CALL_S:
        rounds, calls = 1, 1
    return 1e3 * statistics.median(device_busy_seconds(call, calls) for _ in range(rounds))


def short(err: BaseException) -> str:
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text[:160] + ("..." if len(text) > 160 else "")


def bench_workload(w: Case, rounds: int, copy_rate: float, peers: dict[str, Callable[[Problem], Call]],
                   peer_timeout_s: float) -> list[dict]:
    """The workload's rows, each printed (to stderr) as soon as it is measured. A row (jaxattn's
    included) that takes longer than ``peer_timeout_s`` ends the run with every thread's traceback (a hung kernel
    cannot be interrupted from Python); leave it out with ``--skip-peers``."""
    x = make_inputs(w)
    p = Problem(w, x.q, x.cache, x.meta)
    rows = []
    faulthandler.dump_traceback_later(peer_timeout_s, exit=True)
    ours = jaxattn_auto(p)
    ref = ours()
    base = busy_ms(ours, rounds)
    check = ""
    if w.kv_bytes < 8e9 and sum(w.q_lens) * max(w.kv_lens) <= 64 * 131072:
        xla = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="xla"))
        check = f"{rel_error(ref, xla(p.q, p.cache, p.meta)):.1e} (vs xla)"
    ours_name = f"jaxattn auto ({backend_for(p.q, p.cache, p.meta)})"
    rows.append(dict(workload=w.name, peer=ours_name, ms=base, err=check))
    print(f"{w.name} | {ours_name} | {base:.3f} ms | {check}", file=sys.stderr, flush=True)
    planned = jaxattn_planned(p)
    rows.append(dict(workload=w.name, peer=PLANNED, ms=busy_ms(planned, rounds),
                     err=f"{rel_error(planned(), ref):.1e}"))
    print(f"{w.name} | {PLANNED} | {rows[-1]['ms']:.3f} ms | {rows[-1]['err']}", file=sys.stderr, flush=True)
    faulthandler.cancel_dump_traceback_later()
    for name, make in peers.items():
        print(f"{w.name} | {name} ...", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(peer_timeout_s, exit=True)
        try:
            call = make(p)
            out = call()
            rows.append(dict(workload=w.name, peer=name, ms=busy_ms(call, rounds), err=f"{rel_error(out, ref):.1e}"))
            print(f"{w.name} | {name} | {rows[-1]['ms']:.3f} ms | {rows[-1]['err']}", file=sys.stderr, flush=True)
        except Exception as err:  # noqa: BLE001 - a peer's failure is a result of the comparison
            rows.append(dict(workload=w.name, peer=name, ms=None, err=short(err)))
            traceback.print_exc(file=sys.stderr)
        finally:
            faulthandler.cancel_dump_traceback_later()
            jax.clear_caches()
    for row in rows:
        row["tb_s"] = w.kv_bytes / (row["ms"] * 1e-3) / 1e12 if row["ms"] else None
        row["of_copy"] = row["tb_s"] * 1e12 / copy_rate if row["ms"] else None
        row["vs_auto"] = row["ms"] / base if row["ms"] else None
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| workload | implementation | GPU time / call | KV TB/s | of copy rate | vs auto | rel. err vs auto |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["ms"] is None:
            lines.append(f"| {r['workload']} | {r['peer']} | n/a | | | | {r['err']} |")
        else:
            # Four significant digits: 0.0165 ms keeps the headline's ratios of 10-20 us calls exact.
            lines.append(f"| {r['workload']} | {r['peer']} | {r['ms']:.4g} ms | {r['tb_s']:.2f} | "
                         f"{r['of_copy']:.0%} | {r['vs_auto']:.2f}x | {r['err']} |")
    return "\n".join(lines)


NEVER_COMPILE = "ragged_page_attention_v2"       # a peer whose compile hangs (module docstring)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_jax_peers", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first three workloads only")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new workload after this")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (10 calls each) per row")
    parser.add_argument("--peers", default="", help="comma-separated regular expressions: only the peers whose name matches one")
    parser.add_argument("--skip-peers", default=NEVER_COMPILE,
                        help="comma-separated regular expressions: leave out the peers whose name matches one "
                             f"(listed in the table as left out; default {NEVER_COMPILE!r}: under Triton 3.6 it "
                             "never finishes compiling)")
    parser.add_argument("--peer-timeout-s", type=float, default=150.0,
                        help="end the run (with tracebacks) when one peer's row takes longer")
    parser.add_argument("--workloads", default="",
                        help="comma-separated regular expressions: only the workloads whose name matches one")
    parser.add_argument("--section", default="jax_peers",
                        help="the RESULTS.md section to write (a run of other peers keeps the first run's table)")
    args = parser.parse_args()
    wanted, unwanted = ([x for x in text.split(",") if x] for text in (args.peers, args.skip_peers))
    peers = {name: make for name, make in PEERS.items()
             if (not wanted or any(re.search(x, name) for x in wanted)) and not any(re.search(x, name) for x in unwanted)}
    left_out = [name for name in PEERS if name not in peers]
    budget = Budget(args.budget_s)
    copy_rate = copy_bandwidth()
    print(f"device copy rate {copy_rate / 1e12:.2f} TB/s", flush=True)
    rows, skipped = [], []
    chosen = [x for x in args.workloads.split(",") if x]
    for w in QUICK if args.quick else WORKLOADS:
        if chosen and not any(re.search(x, w.name) for x in chosen):
            continue
        if budget.spent(w):
            skipped.append(w.name)
            continue
        rows += bench_workload(w, args.rounds, copy_rate, peers, args.peer_timeout_s)
        print(table([r for r in rows if r["workload"] == w.name]), flush=True)
    text = (f"Device: {device_name()}; jax {jax.__version__}; {datetime.date.today()}; `{command_line()}`; "
            f"device copy rate {copy_rate / 1e12:.2f} TB/s (read + write).\n\n" + table(rows))
    if left_out:
        text += "\n\nLeft out of this run (`--skip-peers`/`--peers`): " + ", ".join(left_out) + "."
    if skipped:
        text += "\n\nNot run (time budget): " + ", ".join(skipped) + "."
    print(write_section(args.section, text, heading=f"JAX peers (benchmarks/bench_jax_peers.py, {args.section})"))


if __name__ == "__main__":
    main()
