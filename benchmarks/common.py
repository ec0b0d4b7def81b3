"""Shared by the benchmarks (no benchmark imports another): the standard shapes and cases and their
inputs, timing (wall clock, chained jitted calls, CUDA graphs, the profiler), the device copy rate,
and the writer of the marked sections of benchmarks/RESULTS.md (comparisons against peers) and
benchmarks/TUNING.md (parameter sweeps)."""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn

# The peers' standard shape (Llama-3-8B attention): bf16, Hq=32, Hkv=8, D=128, pages of 64.
HQ, HKV, D, PAGE = 32, 8, 128, 64
DTYPE = jnp.bfloat16
# MLA at DeepSeek-V3 shapes: latent rank, RoPE dims, per-head no-RoPE q/k dims, per-head v dims.
MLA_RANK, MLA_ROPE, MLA_NOPE, MLA_DV = 512, 64, 128, 128
MLA_SCALE = 1 / math.sqrt(MLA_NOPE + MLA_ROPE)

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "RESULTS.md")   # comparisons against peers, with the headline table on top
TUNING = os.path.join(HERE, "TUNING.md")     # parameter sweeps behind the library's built-in choices


# --- cases and inputs -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """A paged batch at the standard shape: each sequence's new tokens (``q_lens``) and all of its
    tokens, the new ones included (``kv_lens``); ``name`` labels it in tables. An engine's compiled
    step pads: ``tokens`` query rows (default ``sum(q_lens)``; the rest padding), block tables
    ``capacity`` keys wide (default the longest sequence's pages) and a static ``max_q_len`` bound
    (default the longest ``q_lens``); its padding rows are sequences of no tokens."""
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    tokens: int | None = None
    capacity: int | None = None
    q_len_bound: int | None = None

    @classmethod
    def decode(cls, batch: int, kv_len: int, ragged: bool = False, q_len: int = 1) -> Case:
        """``batch`` sequences of ``q_len`` new tokens (1: a decode), each at ``kv_len``, or
        (``ragged``) at lengths uniform in [kv_len / 2, kv_len], the same in every benchmark."""
        if ragged:
            lens = np.random.default_rng(1).integers(kv_len // 2, kv_len + 1, batch)
            label = f"U[{kv_len // 2},{kv_len}]"
        else:
            lens, label = np.full(batch, kv_len), str(kv_len)
        return cls(f"B={batch} kv={label}", (q_len,) * batch, tuple(int(n) for n in lens))

    @classmethod
    def prefill(cls, batch: int, q_len: int, kv_len: int | None = None) -> Case:
        """``batch`` sequences of ``q_len`` new tokens after ``kv_len - q_len`` cached ones (default: none)."""
        kv_len = kv_len or q_len
        return cls(f"B={batch} x {q_len}" + ("" if kv_len == q_len else f" over {kv_len}"),
                   (q_len,) * batch, (kv_len,) * batch)

    @classmethod
    def engine_mixed(cls, decodes: int, chunks: int, chunk: int, context: int, rows: int, tokens: int,
                     capacity: int, prefill_chunk: int = 512) -> Case:
        """An engine's mixed step (``jaxattn.serve.step``): ``decodes`` decodes at ``context`` keys,
        then ``chunks`` prompt chunks of ``chunk`` tokens over ``context - 1`` cached ones, padded to
        ``rows`` rows and ``tokens`` tokens, block tables ``capacity`` keys wide and the engine's
        ``max_q_len``, ``min(tokens, prefill_chunk)``."""
        used = decodes + chunks * chunk
        if decodes + chunks > rows or used > tokens or context + chunk > capacity:
            raise ValueError(f"Case.engine_mixed: {decodes} + {chunks} x {chunk} does not fit {rows} rows, "
                             f"{tokens} tokens and {capacity} keys")
        pad = rows - decodes - chunks
        return cls(f"{decodes} decodes + {chunks} x {chunk} at {context}, {rows} rows x {tokens}",
                   (1,) * decodes + (chunk,) * chunks + (0,) * pad,
                   (context,) * decodes + (context - 1 + chunk,) * chunks + (0,) * pad,
                   tokens=tokens, capacity=capacity, q_len_bound=min(tokens, prefill_chunk))

    @classmethod
    def engine_decode(cls, decodes: int, context: int, rows: int, capacity: int) -> Case:
        """An engine's decode-only step: ``decodes`` decodes at ``context`` keys, padded to
        ``rows`` rows of one token (``max_q_len`` 1), block tables ``capacity`` keys wide."""
        case = cls.engine_mixed(decodes, 0, 0, context, rows, rows, capacity, prefill_chunk=1)
        return dataclasses.replace(case, name=f"{decodes} decodes at {context}, {rows} rows, {capacity} keys wide")

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return self.q_len_bound or max(self.q_lens)

    @property
    def num_tokens(self) -> int:
        """T, the query rows (padding included)."""
        return self.tokens or sum(self.q_lens)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens)

    @property
    def flops(self) -> float:
        """4 * D * Hq * the (query, key) pairs the bottom-right causal mask leaves visible."""
        pairs = sum(q * k - q * (q - 1) / 2 for q, k in zip(self.q_lens, self.kv_lens))
        return 4.0 * D * HQ * pairs

    @property
    def kv_bytes(self) -> int:
        """The K and V bytes of every sequence (bf16 pages)."""
        return 2 * sum(self.kv_lens) * HKV * D * jnp.dtype(DTYPE).itemsize

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass
class Inputs:
    q: jax.Array
    cache: jaxattn.KVCache
    meta: jaxattn.AttentionMetadata


def block_tables(kv_lens: Sequence[int], seed: int = 0, capacity: int | None = None) -> np.ndarray:
    """int32 [B, pages of the longest sequence (or of ``capacity`` keys)]: each sequence's pages,
    drawn without repeats from a randomly permuted pool of ``1 + sum(pages)`` pages whose page 0 (the
    null page) stays unused."""
    need = [-(-k // PAGE) for k in kv_lens]
    pool = np.random.default_rng(seed).permutation(np.arange(1, 1 + sum(need)))
    tables = np.zeros((len(need), max(max(need), -(-(capacity or 0) // PAGE))), np.int32)
    for b, (start, n) in enumerate(zip(np.cumsum([0] + need[:-1]), need)):
        tables[b, :n] = pool[start:start + n]
    return tables


def make_inputs(case: Case, seed: int = 0, *, num_q_heads: int = HQ, num_kv_heads: int = HKV) -> Inputs:
    """``case`` in a randomly permuted HND pool of random bf16 values (head_dim ``D``, pages of
    ``PAGE``): its queries are each sequence's last ``q_len`` tokens; the leading single-token
    sequences are the decodes."""
    tables = block_tables(case.kv_lens, seed, case.capacity)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    shape = (int(tables.max()) + 1, num_kv_heads, PAGE, D)
    cache = jaxattn.KVCache(jax.random.normal(k1, shape, DTYPE), jax.random.normal(k2, shape, DTYPE), layout="HND")
    q = jax.random.normal(k3, (case.num_tokens, num_q_heads, D), DTYPE)
    decodes = next((i for i, n in enumerate(case.q_lens) if n != 1), case.batch)
    meta = jaxattn.AttentionMetadata(
        cu_q_lens=jnp.asarray(np.cumsum([0, *case.q_lens]), jnp.int32),
        kv_lens=jnp.asarray(case.kv_lens, jnp.int32),
        block_tables=jnp.asarray(tables),
        num_decodes=jnp.int32(decodes),
        max_q_len=case.max_q_len,
    )
    return Inputs(q, cache, meta)


def fp8_inputs(x: Inputs) -> Inputs:
    """``x`` with its pages stored as float8_e4m3fn, each pool scaled so that its largest magnitude is 448."""
    def quantize(pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        scale = jnp.max(jnp.abs(pages.astype(jnp.float32))) / 448.0
        return (pages.astype(jnp.float32) / scale).astype(jnp.float8_e4m3fn), scale

    (k, k_scale), (v, v_scale) = quantize(x.cache.k_pages), quantize(x.cache.v_pages)
    return dataclasses.replace(x, cache=jaxattn.KVCache(k, v, layout="HND", k_scale=k_scale, v_scale=v_scale))


@dataclasses.dataclass(frozen=True)
class MLACase:
    """An MLA decode batch: ``batch`` sequences at ``kv_len``, ``heads`` query heads; latents in
    bf16, or (``fp8``) float8_e4m3fn with one scale."""
    batch: int
    kv_len: int
    heads: int
    fp8: bool = False

    @property
    def latent_dtype(self):
        return jnp.float8_e4m3fn if self.fp8 else DTYPE

    @property
    def latent_bytes(self) -> int:
        return self.batch * self.kv_len * (MLA_RANK + MLA_ROPE) * jnp.dtype(self.latent_dtype).itemsize

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.heads * self.kv_len * (MLA_RANK + MLA_ROPE + MLA_RANK)

    def __str__(self) -> str:
        return f"B={self.batch} kv={self.kv_len} Hq={self.heads}" + (" FP8 latents" if self.fp8 else "")


@dataclasses.dataclass
class MLAInputs:
    q_latent: jax.Array    # [B, Hq, R]
    q_rope: jax.Array      # [B, Hq, Dr]
    cache: jaxattn.MLACache
    meta: jaxattn.AttentionMetadata


def mla_inputs(case: MLACase, seed: int = 0) -> MLAInputs:
    """One decode token per sequence over a randomly permuted pool of random latents (page ``PAGE``),
    bf16, or FP8 stored as 4x the value with a scale of 1/4."""
    tables = block_tables((case.kv_len,) * case.batch, seed)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    pages = jax.random.normal(k1, (int(tables.max()) + 1, PAGE, MLA_RANK + MLA_ROPE), DTYPE)
    scale = jnp.float32(0.25) if case.fp8 else None
    pages = pages if scale is None else (pages / scale).astype(case.latent_dtype)
    meta = jaxattn.AttentionMetadata(
        cu_q_lens=jnp.arange(case.batch + 1, dtype=jnp.int32),
        kv_lens=jnp.full((case.batch,), case.kv_len, jnp.int32),
        block_tables=jnp.asarray(tables),
        num_decodes=jnp.int32(case.batch),
        max_q_len=1,
    )
    return MLAInputs(jax.random.normal(k2, (case.batch, case.heads, MLA_RANK), DTYPE),
                     jax.random.normal(k3, (case.batch, case.heads, MLA_ROPE), DTYPE),
                     jaxattn.MLACache(pages, kv_lora_rank=MLA_RANK, scale=scale), meta)


@dataclasses.dataclass
class MLAPrefillInputs:
    q: jax.Array           # [T, Hq, Dn + Dr], the whole query (no-RoPE part first), as a model holds it
    cache: jaxattn.MLACache
    meta: jaxattn.AttentionMetadata
    w_uk: jax.Array        # [R, Hq, Dn]
    w_uv: jax.Array        # [R, Hq, Dv]

    @property
    def args(self) -> tuple:
        """``mla_prefill``'s positional arguments (the query whole, ``q_rope`` None)."""
        return self.q, None, self.cache, self.meta, self.w_uk, self.w_uv


def mla_prefill_inputs(case: Case, heads: int, seed: int = 1) -> MLAPrefillInputs:
    """``mla_prefill`` at DeepSeek's dims for ``case`` (each sequence's last ``q_len`` of its
    ``kv_len`` tokens are new), ``heads`` query heads, bf16: sequence b's latents in pages
    ``1 + b * P ..`` of a pool of random latents (page ``PAGE``), weights scaled by 1/sqrt(R)."""
    key = jax.random.split(jax.random.key(seed), 5)
    pages_per_seq = -(-case.max_kv_len // PAGE)
    tokens = sum(case.q_lens)
    cache = jaxattn.MLACache(
        jax.random.normal(key[0], (1 + case.batch * pages_per_seq, PAGE, MLA_RANK + MLA_ROPE), DTYPE),
        kv_lora_rank=MLA_RANK)
    meta = jaxattn.AttentionMetadata(
        cu_q_lens=jnp.asarray(np.cumsum([0, *case.q_lens]), jnp.int32), kv_lens=jnp.asarray(case.kv_lens, jnp.int32),
        block_tables=1 + jnp.arange(case.batch * pages_per_seq, dtype=jnp.int32).reshape(case.batch, pages_per_seq),
        num_decodes=jnp.int32(0), max_q_len=case.max_q_len)
    weights = [(jax.random.normal(k, (MLA_RANK, heads, d), jnp.float32) / math.sqrt(MLA_RANK)).astype(DTYPE)
               for k, d in ((key[3], MLA_NOPE), (key[4], MLA_DV))]
    return MLAPrefillInputs(jax.random.normal(key[1], (tokens, heads, MLA_NOPE + MLA_ROPE), DTYPE), cache, meta,
                            *weights)


def rel_error(x, ref) -> float:
    x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref).astype(jnp.float32), np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


# --- timing ---------------------------------------------------------------------------------------

# Rough rates that size a timed run (``repeats_for``): a decode's K/V reads, a prefill's math.
READ_RATE, MATH_RATE = 3e12, 4e14   # bytes/s, FLOP/s


def repeats_for(seconds: float, target_s: float = 5e-3, least: int = 2, most: int = 64) -> int:
    """Calls per timed run: enough calls of about ``seconds`` each to fill ``target_s``, so that
    they dwarf a launch, within [least, most]."""
    return int(min(most, max(least, math.ceil(target_s / seconds))))


def wall_seconds(fn: Callable[[], object], trials: int) -> float:
    """Median wall time of ``fn()`` until its result is ready (warm ``fn`` first)."""
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _difference(run_r: Callable[[], float], run_2r: Callable[[], float], repeats: int, trials: int) -> float:
    """Seconds per call from interleaved medians of timed runs of R and 2R calls."""
    t_r, t_2r = [], []
    for _ in range(trials):
        t_r.append(run_r())
        t_2r.append(run_2r())
    per_call = (statistics.median(t_2r) - statistics.median(t_r)) / repeats
    return per_call if per_call > 0 else statistics.median(t_2r) / (2 * repeats)


def time_chained_calls(attend: Callable[..., jax.Array], q: jax.Array, operands: tuple, repeats: int,
                       trials: int = 9) -> tuple[float, jax.Array, int]:
    """Seconds per call of ``attend(q, *operands)``, whose output has ``q``'s shape: R and 2R calls
    chained through their outputs (q <- out) in one jit, (t(2R) - t(R)) / R of wall-clock
    medians. Also one call's output and the number of calls run."""

    def chain(r: int):
        @jax.jit
        def run(q, *operands):
            for _ in range(r):
                q = attend(q, *operands)
            return q
        return run

    one, short, long = chain(1), chain(repeats), chain(2 * repeats)
    out = one(q, *operands).block_until_ready()
    calls = [1]

    def timed(fn, r: int) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            fn(q, *operands).block_until_ready()
            calls[0] += r
            return time.perf_counter() - start
        for _ in range(3):
            run()
        return run

    seconds = _difference(timed(short, repeats), timed(long, 2 * repeats), repeats, trials)
    return seconds, out, calls[0]


def time_chained(x: Inputs, repeats: int, backend: str, trials: int = 9) -> tuple[float, jax.Array, int]:
    """Seconds per call of ``paged_attention(backend=...)`` on ``x`` (``time_chained_calls``), one
    call's output, and the number of calls run."""
    return time_chained_calls(lambda q, cache, meta: jaxattn.paged_attention(q, cache, meta, backend=backend),
                              x.q, (x.cache, x.meta), repeats, trials)


def time_single(x: Inputs, backend: str, trials: int = 5) -> tuple[float, jax.Array]:
    """Seconds per call of ``paged_attention(backend=...)`` on ``x`` as the median wall time of
    single jitted calls (for backends too slow to chain), and its output."""
    fn = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend=backend))
    out = fn(x.q, x.cache, x.meta).block_until_ready()
    return wall_seconds(lambda: fn(x.q, x.cache, x.meta), trials), out


def torch_replay(fn: Callable[[], object], calls: int) -> tuple[Callable[[], None], str]:
    """A zero-argument callable running ``fn`` (warmed up) ``calls`` times, and how: "graph" (a
    captured CUDA graph, replayed) or "eager" (when ``fn`` cannot be captured)."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return graph.replay, "graph"
    except Exception as err:  # a peer that cannot be captured is timed eagerly
        print(f"    (CUDA graph capture failed: {str(err)[:160]}; timing eagerly)")

        def eager() -> None:
            for _ in range(calls):
                fn()
        return eager, "eager"


def time_torch(fn: Callable[[], object], repeats: int, trials: int = 7) -> tuple[float, str]:
    """Seconds per call of ``fn`` (warmed up): ``torch_replay`` runs of R and 2R calls timed with
    CUDA events, (t(2R) - t(R)) / R of medians; and the replay's mode."""
    import torch

    (short, mode), (long, _) = torch_replay(fn, repeats), torch_replay(fn, 2 * repeats)

    def timed(run: Callable[[], None]) -> Callable[[], float]:
        def measure() -> float:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) * 1e-3
        measure()
        return measure

    return _difference(timed(short), timed(long), repeats, trials), mode


def add_torch_peer(row: dict, name: str, make: Callable[[], Callable[[], object]], repeats: int,
                   reference: jax.Array | None = None, against: str = "jaxattn", timer=time_torch,
                   into: dict | None = None) -> None:
    """Times a torch peer: ``make()`` gives its zero-argument call returning a tensor, and
    ``timer(call, repeats)`` its ``(time, mode)`` (default ``time_torch``: seconds per call), which
    goes to ``into[name]`` (default ``row["seconds"]``). Its relative error against ``reference``
    (``against``'s output), eager timing, or its failure (a peer failing is a result) go to
    ``row["notes"]``."""
    import torch

    try:
        fn = make()
        out = fn()
        torch.cuda.synchronize()
        if reference is not None:
            err = rel_error(jnp.asarray(out.float().cpu().numpy()), reference)
            row["notes"].append(f"{name} vs {against} rel err {err:.1e}")
        (row["seconds"] if into is None else into)[name], mode = timer(fn, repeats)
        if mode != "graph":
            row["notes"].append(f"{name} timed eagerly")
    except Exception as err:
        row["notes"].append(f"{name} failed: {err!r}"[:300])
        traceback.print_exc(limit=2)


def torch_peers(row: dict, setup: Callable[[], dict]) -> dict:
    """``setup()``: the torch peers of a case by name; none, with a note in ``row``, when it fails."""
    try:
        return setup()
    except Exception as err:
        row["notes"].append(f"flashinfer setup failed: {err!r}"[:200])
        return {}


def device_events(fn: Callable[[], object], calls: int) -> dict[str, tuple[float, float]]:
    """GPU time and launches per call of ``fn`` by event (kernel or copy) name: ``{name: (seconds,
    launches)}``, the summed durations and the count of the events of that name on every GPU's
    streams (from ``jax.profiler``), over ``calls`` calls, divided by ``calls``. XLA traces the
    kernels of a command buffer one by one while profiling."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, profiler_options=kernel_profile_options()):
            for _ in range(calls):
                out = fn()
            jax.block_until_ready(out)
        return trace_events(trace_dir, calls)


def kernel_profile_options() -> jax.profiler.ProfileOptions:
    """``jax.profiler`` options for a profile read only for its GPU kernels: no Python tracer
    (which records every Python call of a serving loop's host work) and no HLO protos (every
    compiled executable's, a 27-layer model's step buckets included, written out at the end)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = False
    return options


def _stream_events(trace_dir: str) -> list:
    """The events on the GPU streams of the profile ``jax.profiler`` wrote to ``trace_dir``."""
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    profile = jax.profiler.ProfileData.from_file(path)
    return [event for plane in profile.planes if plane.name.startswith("/device:GPU")
            for line in plane.lines if "Stream" in line.name for event in line.events]


def trace_events(trace_dir: str, calls: float) -> dict[str, tuple[float, float]]:
    """``device_events``' result for the profile ``jax.profiler`` wrote to ``trace_dir`` over
    ``calls`` calls (or steps)."""
    events: dict[str, tuple[float, float]] = {}
    for event in _stream_events(trace_dir):
        seconds, launches = events.get(event.name, (0.0, 0.0))
        events[event.name] = (seconds + event.duration_ns * 1e-9 / calls, launches + 1 / calls)
    if not events:
        raise RuntimeError("device_events: the profile holds no GPU stream events")
    return events


def trace_span(trace_dir: str, calls: float) -> float:
    """Seconds per call (or step) from the first GPU stream event's start to the last's end in the
    profile at ``trace_dir``: against ``trace_events``' summed durations, the GPU's idle share
    between kernels (launch gaps, host waits)."""
    events = _stream_events(trace_dir)
    if not events:
        raise RuntimeError("trace_span: the profile holds no GPU stream events")
    return (max(e.end_ns for e in events) - min(e.start_ns for e in events)) * 1e-9 / calls


def device_event_seconds(fn: Callable[[], object], calls: int) -> dict[str, float]:
    """GPU time per call of ``fn`` by event name (``device_events``)."""
    return {name: seconds for name, (seconds, _) in device_events(fn, calls).items()}


def device_busy_seconds(fn: Callable[[], object], calls: int) -> float:
    """GPU time per call of ``fn`` (summed over the GPUs it runs on): the durations of the kernels
    and copies it runs on the device's streams (``device_event_seconds``).

    Unlike wall time, this does not include the host's launch time or idle gaps, so it measures
    small steps whose host dispatch would otherwise dominate."""
    return sum(device_event_seconds(fn, calls).values())


def device_seconds(fn: Callable[[], object], trials: int) -> float:
    """Seconds per call of ``fn`` (warmed up): its GPU time from the profiler
    (``device_busy_seconds``) on a GPU, elsewhere the median wall time (the CPU smoke modes)."""
    if jax.devices()[0].platform == "gpu":
        return device_busy_seconds(fn, trials)
    return wall_seconds(fn, trials)


def copy_bandwidth(nbytes: int = 4 << 30, trials: int = 10) -> float:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written, of a jitted
    elementwise pass over ``nbytes``; GPU time from the profiler, so the ~0.3 ms from dispatch to
    completion of an isolated call is not counted (``device_seconds``)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0000001)
    copy(x).block_until_ready()
    return 2 * nbytes / device_seconds(lambda: copy(x), trials)


def gemm_rate(n: int = 8192, dtype=jnp.bfloat16, trials: int = 10) -> float:
    """Matmul FLOP/s of a jitted ``n x n x n`` GEMM of random ``dtype`` operands: 2 n^3 over its
    time per call after a warm-up (``device_seconds``: GPU time from the profiler)."""
    a, b = (jax.random.normal(k, (n, n), dtype) for k in jax.random.split(jax.random.key(0)))
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    return 2.0 * n ** 3 / device_seconds(lambda: matmul(a, b), trials)


def time_steps(fn: Callable, state, steps: int, runs: int = 3) -> tuple[float, float, object]:
    """(seconds per step, median host seconds per call, final state) for ``steps`` calls of
    ``state = fn(state)`` issued back to back, each run synchronized once at its end; the median
    over ``runs``."""
    per_step, host_times = [], []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            state = fn(state)
            host_times.append(time.perf_counter() - t0)
        jax.block_until_ready(state)
        per_step.append((time.perf_counter() - start) / steps)
    return statistics.median(per_step), statistics.median(host_times), state


def profiled(fn: Callable, state, steps: int, measure=device_busy_seconds):
    """(final state, ``measure(call, steps)``: by default GPU seconds per step) over ``steps``
    chained calls of ``state = fn(state)``."""
    box = [state]

    def call():
        box[0] = fn(box[0])
        return box[0]

    measured = measure(call, steps)
    return box[0], measured


class Budget:
    """A run's time budget: no new case starts once ``seconds`` have passed since it was made."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.time()

    def spent(self, case: object) -> bool:
        """Whether the budget is spent (then says that ``case`` is skipped)."""
        if time.time() - self.start <= self.seconds:
            return False
        print(f"budget of {self.seconds:.0f}s spent; skipping {case}", flush=True)
        return True


# --- the run's context and its report -------------------------------------------------------------

def device_free_bytes(device: jax.Device) -> float:
    """Device memory not yet in use (80 GB when the device does not say)."""
    stats = device.memory_stats() or {}
    return stats.get("bytes_limit", 80e9) - stats.get("bytes_in_use", 0)


def require_backend(backend: str) -> None:
    """Ends the run when jaxattn's ``backend`` cannot run here."""
    reason = jaxattn.backends.unavailable_reason(backend)
    if reason:
        sys.exit(f"backend {backend} unavailable: {reason}")


def show_engine_log() -> None:
    """Prints the engine's INFO log on stderr (``jaxattn.serve.engine``: each step the warm-up
    compiles, its shape and seconds): a large model's warm-up runs for minutes and would
    otherwise print nothing until it ends."""
    from jaxattn.serve.step import logger

    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return jax.devices()[0].device_kind


def utc_now() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"


def command_line() -> str:
    """This run's command, as ``python -m benchmarks.<module> <arguments>``."""
    module = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    return " ".join([f"python -m benchmarks.{module}", *sys.argv[1:]])


def notes_line(rows: list[dict], label: Callable[[dict], str] = lambda r: str(r["case"])) -> str:
    """"Notes: " and each row's ``notes``, labelled."""
    return "Notes: " + "; ".join(f"{label(r)}: " + ", ".join(r["notes"]) for r in rows if r["notes"])


def replace_section(document: str, name: str, text: str) -> str | None:
    """``document`` with the text between its ``<!-- name:begin -->`` and ``<!-- name:end -->``
    markers replaced by ``text``; None when it has no such markers."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin not in document or end not in document:
        return None
    return document[:document.index(begin)] + f"{begin}\n{text}\n{end}" + document[document.index(end) + len(end):]


def write_section(name: str, text: str, *, heading: str, path: str = RESULTS, update: bool = True) -> str:
    """Puts ``text`` between ``<!-- name:begin/end -->`` markers in the results file ``path``
    (RESULTS.md, or TUNING.md for a parameter sweep), replacing the section or appending it under
    ``## heading``, unless not ``update``; and a copy in ``$OUT/<name>_results.md``. Returns the
    section. RESULTS.md's headline table is then stale: ``python -m benchmarks.headline``."""
    section = f"<!-- {name}:begin -->\n{text}\n<!-- {name}:end -->"
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}_results.md"), "w") as f:
            f.write(section + "\n")
    if update:
        old = open(path).read() if os.path.exists(path) else f"# {os.path.basename(path)}\n"
        new = replace_section(old, name, text)
        if new is None:
            new = old.rstrip("\n") + f"\n\n## {heading}\n\n" + section + "\n"
        with open(path, "w") as f:
            f.write(new)
        if path == RESULTS:
            print("benchmarks/RESULTS.md changed: refresh its headline table with python -m benchmarks.headline")
    return section


def write_json(name: str, data: dict) -> str:
    """Writes ``data`` to ``name`` in $OUT (else benchmarks/out/); returns the path."""
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path
