"""jaxattn's Triton kernels vs the other backends on one GPU (one command, one device run).

    python -m benchmarks.bench_triton [--sweep] [--quick] [--skip ROWS] [--only ROWS]

Workloads (bf16, Hq=32, Hkv=8, D=128, page 64, HND pages in a randomly permuted pool, causal):
  decode   B=64 sequences x 1 token at kv_len 4096 (meta.max_q_len = 1)
  prefill  B=8 x 4096 new tokens
  mixed    63 decodes at kv_len 4096 + one 8192-token prefill
  16k      batch 1, a 16384-token prompt
Rows: triton split (decode kernels for the leading decodes + the 2D kernel for the rest), triton
single (the 2D kernel alone, our prefill tiles), triton single with vLLM's decode-sized tiles
(BLOCK_M 16, tile 32: what one launch serving every batch mix uses there), trtllm (XQA) and cudnn
where ``backends.unavailable_reason`` is None and they take the workload, auto (trtllm decodes +
cudnn rest) for the mixed batch, and xla where it fits in time.

Timing: one jitted call runs R independent calls of the backend on R different query sets
(XLA captures them into one command buffer); time per call = wall time / R after
``block_until_ready``, median of repeats after a warm-up (compile and graph recording excluded).
TFLOP/s count 4 * D * Hq * visible (query, key) pairs. ``--sweep`` also times the candidate
block sizes of each phase (how the defaults in ``jaxattn/backends/triton.py`` were chosen).
Writes the table into the triton section of benchmarks/RESULTS.md (and $OUT when set).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn  # noqa: E402
from benchmarks.common import write_section  # noqa: E402
from jaxattn import backends
from jaxattn.backends import triton as tb
from jaxattn.backends.base import AttentionParams

HQ, HKV, D, PAGE = 32, 8, 128, 64
DTYPE = jnp.bfloat16
VLLM_TILES = tb.PrefillConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    decode_only: bool = False
    repeats: int = 5

    @property
    def flops(self) -> float:
        pairs = sum(q * k - q * (q - 1) / 2 for q, k in zip(self.q_lens, self.kv_lens))
        return 4.0 * D * HQ * pairs

    @property
    def kv_bytes(self) -> float:
        return 2.0 * sum(self.kv_lens) * HKV * D * jnp.dtype(DTYPE).itemsize


WORKLOADS = [
    Workload("decode B=64 x kv 4096", (1,) * 64, (4096,) * 64, decode_only=True, repeats=20),
    Workload("prefill B=8 x 4096", (4096,) * 8, (4096,) * 8, repeats=3),
    Workload("mixed 63 decodes + 8192 prefill", (1,) * 63 + (8192,), (4096,) * 63 + (8192,), repeats=4),
    Workload("batch-1 16k prompt", (16384,), (16384,), repeats=3),
]


def make_inputs(w: Workload, repeats: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    need = [-(-k // PAGE) for k in w.kv_lens]
    width = max(need)
    num_pages = 1 + sum(need)
    perm = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(need), width), np.int32)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[start:start + n]
        start += n
    keys = jax.random.split(jax.random.key(seed), repeats + 2)
    shape = (num_pages, HKV, PAGE, D)
    cache = jaxattn.KVCache(jax.random.normal(keys[0], shape, DTYPE), jax.random.normal(keys[1], shape, DTYPE))
    tokens = sum(w.q_lens)
    qs = tuple(jax.random.normal(k, (tokens, HQ, D), DTYPE) for k in keys[2:])
    meta = jaxattn.AttentionMetadata(
        cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(w.q_lens)]), jnp.int32),
        kv_lens=jnp.asarray(w.kv_lens, jnp.int32), block_tables=jnp.asarray(tables),
        num_decodes=jnp.int32(sum(1 for q in w.q_lens if q == 1) if w.q_lens[0] == 1 else 0),
        max_q_len=1 if w.decode_only else max(w.q_lens))
    return qs, cache, meta


def runner(kind: str, **kw):
    """A function ``(q, cache, meta) -> out`` for one row of the table."""
    if kind.startswith("triton"):
        params = AttentionParams(scale=1 / np.sqrt(D), causal=True, sliding_window=None, softcap=None,
                                 has_sinks=False)
        return lambda q, c, m: tb.attention(q, c, m, params, None, **kw)
    return lambda q, c, m: jaxattn.paged_attention(q, c, m, backend=kind)


def time_per_call(fn, qs, cache, meta, repeats: int) -> float:
    """Seconds per call: median over timed rounds of one jitted call running ``len(qs)`` calls."""
    step = jax.jit(lambda qs, c, m: tuple(fn(q, c, m) for q in qs))
    jax.block_until_ready(step(qs, cache, meta))
    jax.block_until_ready(step(qs, cache, meta))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(qs, cache, meta))
        times.append((time.perf_counter() - t0) / len(qs))
    return statistics.median(times)


def rows_for(w: Workload) -> list[tuple[str, str, dict]]:
    rows = [("triton split", "triton", dict(launch="split")), ("triton single", "triton", dict(launch="single")),
            ("triton single, vLLM tiles", "triton", dict(launch="single", prefill=VLLM_TILES))]
    # cuDNN is the prefill peer (its decode-only run crashed the process on the H200, 2026-11-22).
    rows.append(("trtllm", "trtllm", {}) if w.decode_only else ("cudnn", "cudnn", {}))
    if w.q_lens[0] == 1 and not w.decode_only:
        rows.append(("auto (trtllm decodes + cudnn rest)", "auto", {}))
    if w.decode_only or len(w.q_lens) == 8:
        rows.append(("xla", "xla", {}))
    return rows


def check(fn, qs, cache, meta) -> float:
    """Relative error of a row's output against triton split on the first query set."""
    ref = jax.jit(runner("triton", launch="split"))(qs[0], cache, meta).astype(jnp.float32)
    out = jax.jit(fn)(qs[0], cache, meta).astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def sweep(lines: list[str]) -> None:
    decode_w, prefill_w = WORKLOADS[0], WORKLOADS[1]
    qs, cache, meta = make_inputs(decode_w, 10)
    lines.append("\nDecode block sizes (decode B=64 x kv 4096):\n\n| block_n | segments | warps | stages | us |\n"
                 "|---|---|---|---|---|")
    for block_n in (32, 64):
        for segments in (1, 2, 4):
            for stages in (2, 3):
                cfg = tb.DecodeConfig(block_n=block_n, num_segments=segments, num_warps=4, num_stages=stages)
                _timed_row(lines, f"| {block_n} | {segments} | 4 | {stages} |",
                           runner("triton", launch="split", decode=cfg), qs, cache, meta, 3)
    del qs, cache, meta
    qs, cache, meta = make_inputs(prefill_w, 2)
    lines.append("\nPrefill block sizes (prefill B=8 x 4096):\n\n| block_m | block_n | warps | stages | ms | TFLOP/s |\n"
                 "|---|---|---|---|---|---|")
    for block_m, block_n, warps, stages in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 2), (128, 128, 8, 2),
                                            (128, 32, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2),
                                            (256, 64, 8, 2)]:
        cfg = tb.PrefillConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        _timed_row(lines, f"| {block_m} | {block_n} | {warps} | {stages} |",
                   runner("triton", launch="single", prefill=cfg), qs, cache, meta, 3, flops=prefill_w.flops)


def _timed_row(lines, prefix, fn, qs, cache, meta, repeats, flops=None):
    try:
        t = time_per_call(fn, qs, cache, meta, repeats)
        lines.append(f"{prefix} {t * 1e6:.1f} |" if flops is None else f"{prefix} {t * 1e3:.3f} | {flops / t / 1e12:.0f} |")
    except Exception as err:  # noqa: BLE001 (a config that does not compile or fit is a row, not a crash)
        lines.append(f"{prefix} failed: {type(err).__name__}: {str(err).splitlines()[0][:100]} |")
    print(lines[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time candidate block sizes")
    parser.add_argument("--quick", action="store_true", help="decode and mixed workloads only")
    parser.add_argument("--skip", default="", help="comma-separated row labels to leave out (e.g. cudnn)")
    parser.add_argument("--only", default="", help="comma-separated row labels to run alone (no RESULTS.md update)")
    args = parser.parse_args()
    skip, only = set(filter(None, args.skip.split(","))), set(filter(None, args.only.split(",")))
    device = jax.devices()[0]
    lines = [f"Device: {device.device_kind}; jax {jax.__version__}; "
             f"{datetime.date.today().isoformat()}; command: `python -m benchmarks.bench_triton"
             f"{' --sweep' if args.sweep else ''}{' --quick' if args.quick else ''}`\n",
             "| workload | row | time | TFLOP/s | KV TB/s | vs triton split | rel. err vs split |",
             "|---|---|---|---|---|---|---|"]
    summary = {}
    for w in WORKLOADS if not args.quick else [WORKLOADS[0], WORKLOADS[2]]:
        qs, cache, meta = make_inputs(w, w.repeats)
        split_time = None
        for label, kind, kw in rows_for(w):
            if label in skip or (only and label not in only):
                continue
            reason = None if kind in ("triton", "auto") else backends.unavailable_reason(kind)
            if reason is not None:
                lines.append(f"| {w.name} | {label} | n/a: {reason[:80]} | | | | |")
                print(lines[-1], flush=True)
                continue
            fn = runner(kind, **kw)
            try:
                t = time_per_call(fn, qs if kind != "xla" else qs[:1], cache, meta, 3 if kind != "xla" else 1)
                err = check(fn, qs, cache, meta)
            except Exception as e:  # noqa: BLE001 (an unsupported peer is a row, not a crash)
                lines.append(f"| {w.name} | {label} | n/a: {type(e).__name__}: {str(e).splitlines()[0][:90]} "
                             f"| | | | |")
                print(lines[-1], flush=True)
                traceback.print_exc()
                continue
            split_time = split_time or summary.get((w.name, "triton split")) or t
            summary[(w.name, label)] = t
            lines.append(f"| {w.name} | {label} | {t * 1e3:.3f} ms | {w.flops / t / 1e12:.0f} | "
                         f"{w.kv_bytes / t / 1e12:.2f} | {t / split_time:.2f}x | {err:.1e} |")
            print(lines[-1], flush=True)
        del qs, cache, meta
    lines.append("\nTargets:")
    lines += _targets(summary)
    if args.sweep:
        sweep(lines)
    text = "\n".join(lines)
    print(text)
    write_section("triton", text, heading="triton (jaxattn's Triton kernels)", update_results=not only)


def _targets(s: dict) -> list[str]:
    out = []

    def ratio(a, b):
        return s[a] / s[b] if a in s and b in s else None

    decode, prefill, mixed = (w.name for w in WORKLOADS[:3])
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
