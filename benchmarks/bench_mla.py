"""Paged MLA (DeepSeek shapes) on one GPU: jaxattn against flashinfer's MLA wrapper in torch, on the same data.

    python -m benchmarks.bench_mla [--quick] [--heads 128,16] [--no-prefill] [--budget-s 300] [--smoke]

Decode (absorbed, ``mla_paged_attention``): B in {1, 16, 64, 128} x kv in {1k, 4k, 16k} x Hq in
{16, 128}, bf16, latent 512 + RoPE 64 per token in one page pool (page 64, randomly permuted).
  * jaxattn ``backend="auto"`` (the flashinfer backend: FlashInfer's SM90 MLA kernel through XLA
    FFI), ``backend="triton"`` and, where the gathered pool fits, ``backend="xla"``: R calls
    chained through their outputs (q_latent <- out, both ``[B, Hq, 512]``) in one jit; time per call = (t(2R) - t(R)) / R of wall-clock medians, as in
    ``bench_trtllm_decode``;
  * flashinfer ``BatchMLAPagedAttentionWrapper`` (its ``auto`` backend, planned once outside the
    timing), R calls in a CUDA graph, (t(2R) - t(R)) / R likewise. Its ckv / kpe pools are the
    latent pool's two column ranges, made contiguous outside the timing.
  TB/s: latent bytes read ((512 + 64) x 2 per key and sequence) / time, against the device copy rate;
  TFLOP/s: 2 x B x Hq x kv x (576 + 512) / time, against the bf16 dense peak given by ``--peak-tflops``.
Prefill (``mla_prefill``, B=8 x 4096 new tokens, no cached context, Hq 16 and 128, d_qk 192, d_v 128):
jaxattn's ``cudnn``, ``fa4`` (where installed), ``triton`` and ``xla`` backends (GPU time per call from the
profiler, ``device_seconds``: a single call's wall time also counts its dispatch and host sync,
which at 16 heads was half of it under a busy host), and the fa4 kernel alone on K/V expanded
outside the timing (``jaxattn fa4 kernel``, as the peers run), against
flashinfer's ragged prefill on the same expanded K/V: ``BatchPrefillWithRaggedKVCacheWrapper``
(its fa3 backend) and ``cudnn_batch_prefill_with_kv_cache`` (cuDNN, d_qk 192 and d_vo 128, the
issue's peer); every row takes the query whole ([T, Hq, 192], as the model holds it); jaxattn's
times include expanding the latents to per-head K/V, the peers' do not;
the notes list each jaxattn GPU backend's kernels from the profiler (``kernel_breakdown``).
``--smoke`` runs the jaxattn rows of two small cases on any device (CPU included) and writes only $OUT.
Writes one section of benchmarks/RESULTS.md per head count (mla-hq128, mla-hq16; with --no-decode,
mla-prefill-hq128 and mla-prefill-hq16).
"""

from __future__ import annotations

import argparse
import sys
import traceback

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import backends
from jaxattn.backends.base import AttentionParams
from benchmarks.common import (DTYPE, MLA_DV, MLA_NOPE, MLA_RANK, MLA_ROPE, MLA_SCALE, PAGE, READ_RATE, Budget, Case,
                               MLACase, MLAInputs, MLAPrefillInputs, add_torch_peer, command_line, copy_bandwidth,
                               device_events, device_name, device_seconds, mla_inputs, mla_prefill_inputs, notes_line,
                               rel_error, repeats_for, time_chained_calls, utc_now, write_section)


SWEEP = [MLACase(b, n, h) for h in (128, 16) for b in (1, 16, 64, 128) for n in (1024, 4096, 16384)]
KEY_CASE = MLACase(64, 4096, 128)   # the target point
QUICK = [KEY_CASE, MLACase(1, 16384, 128), MLACase(128, 4096, 16)]
SMOKE = [MLACase(2, 256, 16), MLACase(1, 512, 128)]


def time_jaxattn(x: MLAInputs, repeats: int, backend: str, trials: int = 9) -> tuple[float, jax.Array]:
    """Seconds per call of ``mla_paged_attention(backend=...)`` (R and 2R calls chained through
    their outputs, q_latent <- out, in one jit), and one call's output."""
    def attend(q_latent, q_rope, cache, meta):
        return jaxattn.mla_paged_attention(q_latent, q_rope, cache, meta, scale=MLA_SCALE, backend=backend)

    seconds, out, _ = time_chained_calls(attend, x.q_latent, (x.q_rope, x.cache, x.meta), repeats, trials)
    return seconds, out


def flashinfer_decode(case: MLACase, x: MLAInputs):
    """flashinfer's MLA wrapper on the same latents: (zero-argument callable -> [B, Hq, R], backend name)."""
    import torch
    import flashinfer

    pages = torch.from_dlpack(x.cache.pages)
    ckv, kpe = pages[..., :MLA_RANK].contiguous(), pages[..., MLA_RANK:].contiguous()
    q_nope, q_pe = torch.from_dlpack(x.q_latent), torch.from_dlpack(x.q_rope)
    tables = torch.from_dlpack(x.meta.block_tables)
    dev = q_nope.device
    pages_per_seq = tables.shape[1]
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev))
    wrapper.plan(
        qo_indptr=torch.arange(case.batch + 1, dtype=torch.int32, device=dev),
        kv_indptr=torch.arange(case.batch + 1, dtype=torch.int32, device=dev) * pages_per_seq,
        kv_indices=tables.reshape(-1).contiguous(),
        kv_len_arr=torch.full((case.batch,), case.kv_len, dtype=torch.int32, device=dev),
        num_heads=case.heads, head_dim_ckv=MLA_RANK, head_dim_kpe=MLA_ROPE, page_size=PAGE, causal=False,
        sm_scale=MLA_SCALE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    backend = getattr(wrapper, "_planned_backend_name", None) or "auto"
    return (lambda: wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv, kpe))), backend


def bench_decode(case: MLACase, with_torch: bool, with_xla: bool, with_triton: bool) -> dict:
    x = mla_inputs(case)
    repeats = repeats_for(case.latent_bytes / READ_RATE)
    row = {"case": case, "seconds": {}, "notes": []}
    row["seconds"]["jaxattn auto"], out = time_jaxattn(x, repeats, "auto")
    if with_triton and backends.unavailable_reason("triton") is None:
        row["seconds"]["jaxattn triton"], other = time_jaxattn(x, repeats, "triton")
        row["notes"].append(f"triton vs auto rel err {rel_error(other, out):.1e}")
    if with_xla:
        try:
            row["seconds"]["jaxattn xla"], ref = time_jaxattn(x, repeats, "xla")
            row["notes"].append(f"auto vs xla rel err {rel_error(out, ref):.1e}")
        except Exception as err:  # e.g. out of memory: the others still count
            row["notes"].append(f"xla failed: {err!r}"[:200])
    if with_torch:
        def make():
            fn, backend = flashinfer_decode(case, x)
            row["notes"].append(f"flashinfer planned {backend}")
            return fn
        add_torch_peer(row, "flashinfer mla", make, repeats, reference=out, against="auto")
    return row


def prefill_seconds(heads: int, batch: int, q_len: int, with_torch: bool, peers: tuple[str, ...] = ("fa3", "cudnn"),
                    trials: int = 7) -> dict:
    """mla_prefill on ``batch`` sequences of ``q_len`` new tokens (no cached context), and
    flashinfer's ragged fa3 prefill on the expanded K/V: {name: seconds per call}, with notes."""
    x = mla_prefill_inputs(Case.prefill(batch, q_len), heads)
    q, _, cache, meta, w_uk, w_uv = args = x.args
    tokens, pages_per_seq = batch * q_len, meta.max_pages_per_seq
    result, outs = {"seconds": {}, "notes": []}, {}
    for backend in ("cudnn", "fa4", "triton", "xla") if with_torch else ("xla",):
        reason = backends.unavailable_reason(backend)
        if reason is not None:
            result["notes"].append(f"jaxattn {backend} not run: {reason}"[:300])
            continue
        try:
            fn = jax.jit(lambda *a, backend=backend: jaxattn.mla_prefill(*a, scale=MLA_SCALE, backend=backend))
            outs[backend] = fn(*args).block_until_ready()
            result["seconds"][f"jaxattn {backend}"] = device_seconds(lambda: fn(*args), trials)
        except Exception as err:  # e.g. out of memory: the others still count
            result["notes"].append(f"{backend} failed: {err!r}"[:300])
            traceback.print_exc(limit=2)
            continue
        if with_torch and backend != "xla":
            result["notes"].append(f"jaxattn {backend} kernels: {kernel_breakdown(lambda: fn(*args))}")
    if with_torch and "fa4" in outs:       # the kernel alone, on K/V expanded outside the timing as the peers run
        try:
            result["seconds"]["jaxattn fa4 kernel"] = fa4_kernel_seconds(x, trials)
        except Exception as err:
            result["notes"].append(f"fa4 kernel failed: {err!r}"[:300])
            traceback.print_exc(limit=2)
    out = outs.get("cudnn", outs.get("xla"))
    for backend in ("cudnn", "fa4", "triton"):
        if with_torch and "xla" in outs and backend in outs:
            result["notes"].append(f"{backend} vs xla rel err {rel_error(outs[backend], outs['xla']):.1e}")
    print(f"prefill Hq={heads}, jaxattn:", result, flush=True)
    if not with_torch or out is None:
        return result
    try:
        import torch
        import flashinfer

        # The expanded keys and values of each sequence (its own tokens' latents), outside the timing.
        latents = cache.pages[meta.block_tables].reshape(batch, pages_per_seq * PAGE, MLA_RANK + MLA_ROPE)[:, :q_len]
        latents = latents.reshape(tokens, MLA_RANK + MLA_ROPE)
        k_nope = jnp.einsum("tr,rhd->thd", latents[:, :MLA_RANK], w_uk)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(latents[:, None, MLA_RANK:], (tokens, heads, MLA_ROPE))], axis=-1)
        v = jnp.einsum("tr,rhd->thd", latents[:, :MLA_RANK], w_uv)
        tq, tk, tv = (torch.from_dlpack(a.astype(DTYPE)) for a in (q, k, v))
        indptr = torch.arange(batch + 1, dtype=torch.int32, device=tq.device) * q_len
    except Exception as err:
        result["notes"].append(f"expanding K/V for the peers failed: {err!r}"[:300])
        traceback.print_exc(limit=2)
        return result
    if "fa3" in peers:
        def fa3():
            wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                torch.empty(256 << 20, dtype=torch.uint8, device=tq.device), "NHD", backend="fa3")
            wrapper.plan(indptr, indptr, heads, heads, MLA_NOPE + MLA_ROPE, head_dim_vo=MLA_DV, causal=True,
                         sm_scale=MLA_SCALE, q_data_type=torch.bfloat16)
            return lambda: wrapper.run(tq, tk, tv)
        add_torch_peer(result, "flashinfer fa3", fa3, 2, reference=out)
    if "cudnn" in peers:   # the peer: flashinfer's cuDNN prefill with MLA dims (d_qk 192, d_vo 128), ragged
        def cudnn():
            from flashinfer.cudnn import cudnn_batch_prefill_with_kv_cache

            lens = torch.full((batch, 1, 1, 1), q_len, dtype=torch.int32, device=tq.device)
            workspace = torch.empty(256 << 20, dtype=torch.uint8, device=tq.device)
            return lambda: cudnn_batch_prefill_with_kv_cache(
                tq, tk, tv, MLA_SCALE, workspace, max_token_per_sequence=q_len, max_sequence_kv=q_len,
                actual_seq_lens_q=lens, actual_seq_lens_kv=lens, causal=True, return_lse=False,
                batch_offsets_q=indptr, batch_offsets_k=indptr, batch_offsets_units="tokens")[0]
        add_torch_peer(result, "flashinfer cudnn", cudnn, 2, reference=out)
    return result


def kernel_breakdown(fn, calls: int = 3, top: int = 6) -> str:
    """The GPU kernels of one call of ``fn`` from the profiler (``device_events``), costliest
    first: "name us (launches)", then the total: where a backend's prefill time goes (the
    expansion of the latents, the attention kernel, XLA's own work)."""
    events = sorted(((s, n, name) for name, (s, n) in device_events(fn, calls).items()), reverse=True)
    parts = [f"{name.split('(')[0][:60]} {s * 1e6:.0f} us ({n:.0f})" for s, n, name in events[:top]]
    if len(events) > top:
        parts.append(f"{len(events) - top} more {sum(s for s, _, _ in events[top:]) * 1e6:.0f} us")
    parts.append(f"total {sum(s for s, _, _ in events) * 1e6:.0f} us")
    return "; ".join(parts)


def fa4_kernel_seconds(x: MLAPrefillInputs, trials: int) -> float:
    """Seconds per call of the fa4 backend's kernel alone (``fa4.attend_pages``) on the K and V
    pages it expands ``x``'s latents to (``fa4.mla_pages``), expanded outside the timing, as the
    flashinfer peers take them."""
    from jaxattn.backends import fa4

    meta, _ = x.meta.sanitize(x.q.shape[0], x.cache.num_pages, x.cache.page_size)
    k_pages, v_pages, meta = fa4.mla_pages(x.cache, meta, x.w_uk, x.w_uv, x.q.dtype, causal=True)
    params = AttentionParams(scale=MLA_SCALE, causal=True, sliding_window=None, softcap=None, has_sinks=False)
    fn = jax.jit(lambda q, k, v, m: fa4.attend_pages(q, k, v, "NHD", m, params, None))
    jax.block_until_ready(fn(x.q, k_pages, v_pages, meta))
    return device_seconds(lambda: fn(x.q, k_pages, v_pages, meta), trials)


DECODE_PEERS = ("jaxattn auto", "jaxattn triton", "flashinfer mla", "jaxattn xla")


def decode_table(rows: list[dict], copy_rate: float | None, peak_flops: float) -> str:
    lines = ["| case | " + " | ".join(f"{p} us" for p in DECODE_PEERS)
             + " | auto TB/s (of copy) | auto TFLOP/s (of peak) | flashinfer / auto | xla / auto |",
             "|" + "---|" * (len(DECODE_PEERS) + 5)]
    for r in rows:
        sec, case = r["seconds"], r["case"]
        t = sec["jaxattn auto"]
        cells = [f"{sec[p] * 1e6:.1f}" if p in sec else "-" for p in DECODE_PEERS]
        cells.append(f"{case.latent_bytes / t / 1e12:.2f}"
                     + (f" ({case.latent_bytes / t / copy_rate:.0%})" if copy_rate else ""))
        cells.append(f"{case.flops / t / 1e12:.0f} ({case.flops / t / peak_flops:.0%})")
        cells += [f"{sec[p] / t:.2f}x" if p in sec else "-" for p in ("flashinfer mla", "jaxattn xla")]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def section_text(heads: int, rows: list[dict], prefill: dict | None, copy_rate: float | None,
                 peak_tflops: float) -> str:
    """One head count's decode table (when it ran decode cases) and prefill line."""
    text = [f"- device: {device_name()}; jax {jax.__version__}; date: {utc_now()}; command: `{command_line()}`",
            f"- Hq={heads}, bf16; latent {MLA_RANK} + RoPE {MLA_ROPE} per token, page {PAGE}, randomly permuted pool; "
            "device copy rate " + (f"{copy_rate / 1e12:.2f} TB/s" if copy_rate else "not measured")
            + f"; bf16 peak taken as {peak_tflops:.0f} TFLOP/s."]
    if rows:
        text += ["- decode: time per call (see the benchmark's docstring); ratios: peer time / jaxattn auto time.",
                 "", decode_table(rows, copy_rate, peak_tflops * 1e12)]
    if prefill is not None:
        flops = 2 * 8 * heads * 4096 * 4096 / 2 * (MLA_NOPE + MLA_ROPE + MLA_DV)   # causal: half the pairs
        sec = prefill["seconds"]
        text.append(f"\n- prefill B=8 x 4096, Hq={heads}: " + ", ".join(
            f"{name} {t * 1e3:.3f} ms ({flops / t / 1e12:.0f} TFLOP/s)" for name, t in sec.items())
            + "".join(f"; {peer} / {name} {sec[peer] / sec[name]:.2f}x"
                      for peer in ("flashinfer cudnn", "flashinfer fa3")
                      for name in ("jaxattn cudnn", "jaxattn fa4", "jaxattn fa4 kernel", "jaxattn triton",
                                   "jaxattn xla")
                      if peer in sec and name in sec)
            + ("; " + ", ".join(prefill["notes"]) if prefill["notes"] else ""))
    if rows:
        text.append("\n" + notes_line(rows))
    return "\n".join(text)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_mla", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three decode cases and the Hq=128 prefill")
    parser.add_argument("--smoke", action="store_true", help="two small jaxattn-only decode cases (any device); $OUT only")
    parser.add_argument("--heads", default="128,16", help="query head counts to run, in this order")
    parser.add_argument("--batches", default="1,16,64,128", help="decode batch sizes to run")
    parser.add_argument("--no-prefill", action="store_true", help="decode cases only")
    parser.add_argument("--no-decode", action="store_true", help="prefill only")
    parser.add_argument("--no-triton", action="store_true", help="skip the triton backend's decode column")
    parser.add_argument("--prefill-peers", default="fa3,cudnn", help="flashinfer prefill peers to run")
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no new decode case after this")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak of the GPU (H100 SXM: 989)")
    parser.add_argument("--xla-max-bytes", type=float, default=2e9, help="skip the xla backend above this pool size")
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.smoke:
        sys.exit("bench_mla needs a GPU (or --smoke)")
    copy_rate = copy_bandwidth() if on_gpu else None
    budget = Budget(args.budget_s)
    batches = {int(b) for b in args.batches.split(",")}
    for heads in (int(h) for h in args.heads.split(",")):
        # A prefill-only run has sections of its own, so it leaves a decode run's tables in place.
        name, heading = ((f"mla-prefill-hq{heads}", f"MLA prefill, {heads} query heads (benchmarks/bench_mla.py)")
                         if args.no_decode else (f"mla-hq{heads}", f"MLA, {heads} query heads (benchmarks/bench_mla.py)"))
        rows, prefill = [], None
        cases = [] if args.no_decode else (SMOKE if args.smoke else QUICK if args.quick else SWEEP)
        for case in (c for c in cases if c.heads == heads and c.batch in batches):
            if budget.spent(case):
                continue
            try:
                rows.append(bench_decode(case, with_torch=on_gpu, with_xla=case.latent_bytes <= args.xla_max_bytes,
                                         with_triton=not args.no_triton))
            except Exception:  # e.g. out of memory: report the others
                traceback.print_exc(limit=3)
                continue
            print(case, {k: f"{v * 1e6:.1f}us" for k, v in rows[-1]["seconds"].items()}, rows[-1]["notes"],
                  flush=True)
            # Written after every case, so that a run cut short still leaves its table in $OUT.
            write_section(name, section_text(heads, rows, None, copy_rate, args.peak_tflops), heading=heading,
                          update=False)
        if not (args.smoke or args.no_prefill or (args.quick and heads != 128)):
            prefill = prefill_seconds(heads, 8, 4096, with_torch=on_gpu, peers=tuple(args.prefill_peers.split(",")))
            print(f"prefill Hq={heads}", prefill, flush=True)
        if rows or prefill:
            print(write_section(name, section_text(heads, rows, prefill, copy_rate, args.peak_tflops),
                                heading=heading, update=not args.smoke))


if __name__ == "__main__":
    main()
