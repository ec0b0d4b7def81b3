"""Serving a request trace through the Engine, against a roofline measured in the same run.

    python -m benchmarks.bench_serving --trace {decode-heavy,chat,shared-prefix,poisson,throughput}
        [--preset llama3-8b] [--layers N] [--requests N] [--max-seqs N] [--num-pages N] [--max-step-tokens N]
        [--page-size 64] [--backend auto] [--rate R] [--tp N [--enable-expert-parallel]]
        [--quantization fp8 [--fp8-activations]]
        [--moe-gemm {auto,ragged_dot,dense,triton}] [--profile-at STEP,... [--profile-steps 8]] [--no-overlap]
        [--smoke]

One trace per call (random weights; every length drawn with seed 0, and written in the table):
  * decode-heavy: 512 requests of 1024 prompt and 1024 generated tokens, all at once (the shape of
    vLLM's ``benchmark_throughput --input-len 1024 --output-len 1024``);
  * chat: 1000 requests, prompt and output lengths lognormal (sigma 1, means 250 and 210 before
    clipping to [4, 1024], 220 and 202 after: the shape of ShareGPT, which cannot be downloaded
    here), all at once;
  * shared-prefix: 128 requests, a shared 1024-token system prompt + 32..256 own tokens, 128
    generated tokens each, all at once, served with prefix caching off and on;
  * poisson: the chat trace all at once (its requests/s is the saturation rate), then with Poisson
    arrivals at ``--rate`` (default: 0.9 x that saturation rate), for TTFT and TPOT under load;
  * throughput: 300 requests of 1000 prompt and 1000 generated tokens, all at once (vLLM's
    ``benchmark_throughput --input-len 1000 --output-len 1000 --num-prompts 300``, the workload of
    the DeepSeek-Coder-V2-Lite figures this project started from).
Presets: the Llama family's (``jaxattn.serve.models.llama.PRESETS``, mixtures of experts included:
qwen1.5-moe-a2.7b, qwen3-30b-a3b, mixtral-8x7b) and deepseek-v2-lite (MLA + 64 experts, 6 per
token). ``--tp N`` serves on N devices (tensor parallelism; with ``--enable-expert-parallel``
the experts whole per device); ``--quantization fp8`` serves FP8 linears and experts (with
``--fp8-activations`` the linears' inputs in FP8 too, W8A8); ``--moe-gemm`` fixes how
the experts are computed (``jaxattn.serve.models.experts``; default: per step shape). A preset, mesh,
quantization or expert GEMM other than the defaults writes a section of its own (``--section`` names
any run's). ``--profile-at`` adds the GPU kernels of a few steps from those steps of the trace, by
kind (``StepWindow``): where a mixed or a decode step's time goes inside the engine's own buckets.
``--requests`` scales a trace down (for quick runs); ``--smoke`` serves a tiny model on tiny traces
(seconds on a CPU) and writes only ``$OUT``. Each trace writes its section of benchmarks/RESULTS.md
("serving_<trace>"; shared-prefix: "serving").

Roofline. In the same run: the copy rate (read + write bytes/s of a 4 GiB elementwise pass) and
the matmul rate (FLOP/s of an 8192^3 bf16 GEMM), both GPU time from the profiler. Each step the
engine ran (``Engine(record_steps=True)``'s ``StepRecord``) must move
    bytes = weight bytes (every weight once; the embedding table only through the rows its
            tokens read, unless tied to the LM head)
          + context_tokens x KV bytes per token (K/V of every layer that attention reads)
          + tokens x KV bytes per token (the K/V writes)
and compute
    flops = 2 x matmul weights x tokens + 2 x LM-head weights x rows (one logit row per sequence)
          + 4 x layers x q_heads x head_dim x attention_pairs,
KV bytes per token from the model's caches (``jax.eval_shape`` of ``init_caches``). A mixture of
experts' routed experts count by the experts a step touches: with random weights the router's
choices are close to uniform, so a step of T tokens reads E (1 - (1 - k/E)^T) experts per MoE
layer (the expectation for k of E experts per token, chosen uniformly) and computes k experts per
token; the shared experts and the router count as dense weights. A step's bound
is max(bytes / copy rate, flops / matmul rate); the trace's roofline is the sum over its steps
(real tokens only, not the padding of the compiled buckets: it measures how well the engine runs
its own schedule). % of roofline = roofline s / wall s.

Reported per run: generated tokens/s (over the wall time from the first arrival to the last token)
and prompt + generated tokens/s; roofline s and %; the GPU busy share, an estimate from host
timestamps: step n+1 was not queued when step n's tokens reached the host for gap_n = max(0,
t_launched[n+1] - t_done[n]), the GPU idles for those gaps and before the first launch, and busy =
1 - idle / wall. It is an upper bound (t_done is when the host took the tokens, at or after the GPU
finished them; with overlap the host takes them after launching the next step), so host ms per step
(scheduling, packing and launch: t_launched - t_start, mean) against wall s / steps tells a
host-bound run. Also steps; TTFT (arrival to first token, queueing included) and TPOT (time from
the first token to the last / (tokens - 1), per request) p50 / p90 / p99; preemptions.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import gc
import itertools
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import (copy_bandwidth, device_name, gemm_rate, kernel_profile_options, show_engine_log,
                               trace_events, trace_span, write_section)
from benchmarks.profile_step import by_kind, kind_of
from jaxattn import choice_table
from jaxattn.serve.cli_args import tp_mesh
from jaxattn.serve.engine import Engine, default_compile_threads
from jaxattn.serve.models.base import page_bytes
from jaxattn.serve.models.deepseek import PRESETS as DEEPSEEK_PRESETS
from jaxattn.serve.models.deepseek import DeepSeek
from jaxattn.serve.models.experts import GEMMS
from jaxattn.serve.models.layers import EXPERT_AXES, MoE, set_expert_gemm
from jaxattn.serve.models.llama import PRESETS, Llama, shard_model
from jaxattn.serve.models.quantization import METHODS, quantize, set_fp8_activations

TRACES = ("decode-heavy", "chat", "shared-prefix", "poisson", "throughput")
SECTIONS = {"decode-heavy": "serving_decode-heavy", "chat": "serving_chat", "shared-prefix": "serving",
            "poisson": "serving_poisson", "throughput": "serving_throughput"}
HEADINGS = {"decode-heavy": "Serving: decode-heavy trace (benchmarks/bench_serving.py)",
            "chat": "Serving: chat-like trace (benchmarks/bench_serving.py)",
            "shared-prefix": "Serving (benchmarks/bench_serving.py)",
            "poisson": "Serving: Poisson arrivals (benchmarks/bench_serving.py)",
            "throughput": "Serving: 300 x (1000 in / 1000 out) (benchmarks/bench_serving.py)"}
# model shapes by preset name: (class, config)
MODELS = {**{name: (Llama, cfg) for name, cfg in PRESETS.items()},
          "deepseek-v2-lite": (DeepSeek, DEEPSEEK_PRESETS["v2-lite-moe"])}
TARGETS = {"decode-heavy": 85, "chat": 75, "shared-prefix": 75}   # % of the roofline
PROGRESS_S = 30.0                # seconds between progress lines on stderr while a trace runs
LOAD = 0.9                       # the Poisson trace's default rate, as a share of the saturation rate
KV_CACHE_DTYPES = {"auto": None, "fp8": jnp.float8_e4m3fn}     # --kv-cache-dtype: vLLM's names


@dataclasses.dataclass(frozen=True)
class Published:
    """A figure published elsewhere (not our run), a row of its trace's table."""
    engine: str
    shape: str
    requests: int
    tokens_per_s: float | None = None      # generated (output) tokens/s
    ttft_p50_ms: float | None = None
    tpot_p50_ms: float | None = None


# The published figures nearest to each trace that we could attribute, and where they are from.
AIMULTIPLE = "ShareGPT (real), Llama 3.1 8B Instruct, bf16, one H100 80GB, offline"
SGLANG_060 = "ShareGPT (real) at 4 requests/s, Llama 3.1 8B Instruct, one A100 80GB"
PUBLISHED = {
    "chat": [Published("SGLang", AIMULTIPLE, 1000, 16215), Published("LMDeploy", AIMULTIPLE, 1000, 16132),
             Published("vLLM", AIMULTIPLE, 1000, 12553)],
    "poisson": [Published("SGLang v0.3.0", SGLANG_060, 1200, ttft_p50_ms=31.98, tpot_p50_ms=13.17),
                Published("vLLM v0.6.0", SGLANG_060, 1200, ttft_p50_ms=100.48, tpot_p50_ms=14.14)],
}
SOURCES = {
    "decode-heavy": "Published elsewhere: no figure for bf16 Llama-3-8B on one H100 at 1024 in / 1024 out that we "
                    "could attribute.",
    "chat": "Published rows: a third-party benchmark (AIMultiple, https://research.aimultiple.com/inference-engines: "
            "1,000 real ShareGPT prompts x 10 runs, output tokens/s), not our run; this trace only imitates "
            "ShareGPT's lengths.",
    "shared-prefix": "Published elsewhere: no figure for this trace that we could attribute.",
    "poisson": "Published rows: SGLang's benchmark/benchmark_vllm_060/README.md (sgl-project/sglang; medians), not "
               "our run, and on an A100, not an H100: the nearest we found.",
    "throughput": "Published elsewhere, for scale and not comparable (another GPU, FP8 weights, real weights): the "
                  "cuDNN paged-prefill work this project grew from reported vLLM at 2,308 -> 4,733 output tokens/s on "
                  "DeepSeek-Coder-V2-Lite-Instruct with --quantization=fp8 on this trace, on Blackwell.",
}


def smoke_model(preset: str) -> tuple[type, object]:
    """The tiny model of ``preset``'s class (with a few experts when it has experts): ``--smoke``."""
    model_class, cfg = MODELS[preset]
    tiny = (DEEPSEEK_PRESETS if model_class is DeepSeek else PRESETS)["tiny"]
    if cfg.num_experts:
        tiny = tiny.replace(num_experts=4, num_experts_per_tok=2, moe_hidden_dim=64,
                            shared_expert_dim=64 if cfg.shared_expert_dim else 0)
    return model_class, tiny


def published_row(first_column: str | None, p: Published) -> str:
    """A published figure as a row of a trace's table (the columns it has no figure for: "-")."""
    label = f"published, not our run: {p.engine}"
    cells = [label, p.shape] if first_column else [f"{label}; {p.shape}"]
    figures = {"requests": f"{p.requests:,}", "generated tokens/s": f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-",
               "TTFT ms p50 / p90 / p99": f"{p.ttft_p50_ms:.1f} / - / -" if p.ttft_p50_ms else "-",
               "TPOT ms p50 / p90 / p99": f"{p.tpot_p50_ms:.2f} / - / -" if p.tpot_p50_ms else "-"}
    cells += [figures.get(column, "-") for column in COLUMNS.split(" | ")[1:]]
    return "| " + " | ".join(cells) + " |"


@dataclasses.dataclass(frozen=True)
class TraceSpec:
    """A trace's shape: ``prompt_len`` and ``output_len`` are each request's (decode-heavy), the
    lognormal means before clipping to [4, ``max_len``] (chat, poisson), or the shared system
    prompt's length and each request's output (shared-prefix, whose own parts are ``user_len``)."""
    requests: int
    prompt_len: int
    output_len: int
    max_len: int = 0
    user_len: tuple[int, int] = (0, 0)


SPECS = {"decode-heavy": TraceSpec(512, 1024, 1024), "chat": TraceSpec(1000, 250, 210, max_len=1024),
         "shared-prefix": TraceSpec(128, 1024, 128, user_len=(32, 256)),
         "poisson": TraceSpec(1000, 250, 210, max_len=1024), "throughput": TraceSpec(300, 1000, 1000)}
SMOKE = {"decode-heavy": TraceSpec(6, 24, 16), "chat": TraceSpec(10, 12, 10, max_len=40),
         "shared-prefix": TraceSpec(8, 40, 8, user_len=(2, 12)), "poisson": TraceSpec(10, 12, 10, max_len=40),
         "throughput": TraceSpec(5, 20, 12)}
SIGMA = 1.0                      # the lognormal lengths' sigma


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival: float               # seconds after the trace starts
    prompt: np.ndarray           # int32[L]
    new_tokens: int
    draft_oracle: np.ndarray | None = None      # an "oracle" drafter's tokens (benchmarks/bench_speculative.py)


def lognormal_lengths(rng: np.random.Generator, mean: float, size: int, max_len: int) -> np.ndarray:
    """``size`` lengths, lognormal with sigma ``SIGMA`` and mean ``mean``, rounded, clipped to [4, max_len]."""
    mu = np.log(mean) - SIGMA ** 2 / 2
    return np.clip(np.rint(rng.lognormal(mu, SIGMA, size)), 4, max_len).astype(int)


def make_trace(kind: str, spec: TraceSpec, vocab: int, rate: float = 0.0, seed: int = 0) -> list[TraceRequest]:
    """The requests of trace ``kind`` in order of arrival, random prompt tokens: all at once, or
    with ``rate`` > 0 as a Poisson process of ``rate`` requests/s (the same requests)."""
    rng = np.random.default_rng(seed)
    n = spec.requests
    if kind in ("decode-heavy", "throughput"):
        prompts = [rng.integers(0, vocab, size=spec.prompt_len, dtype=np.int32) for _ in range(n)]
        output_lens = np.full(n, spec.output_len)
    elif kind in ("chat", "poisson"):
        prompt_lens = lognormal_lengths(rng, spec.prompt_len, n, spec.max_len)
        output_lens = lognormal_lengths(rng, spec.output_len, n, spec.max_len)
        prompts = [rng.integers(0, vocab, size=length, dtype=np.int32) for length in prompt_lens]
    elif kind == "shared-prefix":
        system = rng.integers(0, vocab, size=spec.prompt_len, dtype=np.int32)
        own_lens = rng.integers(*spec.user_len, size=n, endpoint=True)
        prompts = [np.concatenate([system, rng.integers(0, vocab, size=length, dtype=np.int32)])
                   for length in own_lens]
        output_lens = np.full(n, spec.output_len)
    else:
        raise ValueError(f"make_trace: kind must be one of {TRACES}, got {kind!r}")
    arrivals = np.cumsum(np.random.default_rng(seed + 1).exponential(1 / rate, size=n)) if rate > 0 else np.zeros(n)
    return [TraceRequest(float(t), prompt, int(length)) for t, prompt, length in zip(arrivals, prompts, output_lens)]


def describe(kind: str, trace: Sequence[TraceRequest], spec: TraceSpec) -> str:
    """The trace's lengths, as drawn."""
    prompts = np.array([r.prompt.size for r in trace])
    outputs = np.array([r.new_tokens for r in trace])
    if kind in ("decode-heavy", "throughput"):
        return f"{spec.prompt_len} in / {spec.output_len} out"
    if kind == "shared-prefix":
        return f"{spec.prompt_len} shared + U[{spec.user_len[0]},{spec.user_len[1]}] in / {spec.output_len} out"

    def stats(x: np.ndarray) -> str:
        return f"mean {x.mean():.0f}, p50 {np.median(x):.0f}, max {x.max()}"
    return f"lognormal in ({stats(prompts)}) / out ({stats(outputs)})"


# --- the roofline ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Costs:
    """What a step of the model moves and computes, per step, token, row and attention pair."""
    weight_bytes: float          # read once per step (the embedding table excluded unless tied)
    embed_row_bytes: float       # per token: its embedding row (0 when tied: counted in weight_bytes)
    kv_bytes_per_token: float    # K/V of every layer
    matmul_params: float         # weights each token multiplies (the blocks' kernels, routed experts excluded)
    head_params: float           # LM-head weights, per row
    flops_per_pair: float        # attention FLOPs per (query, key) pair, all layers
    num_experts: int = 0         # routed experts per MoE layer (0: a dense model)
    experts_per_token: int = 0
    expert_bytes: float = 0.0    # one routed expert's weights, summed over the MoE layers
    expert_params: float = 0.0


def model_costs(model: Llama | DeepSeek, page_size: int, kv_dtype=None) -> Costs:
    """``Costs`` of ``model`` (an ``embed``, blocks of 2-D kernels and maybe stacked ``[E, in,
    out]`` experts, maybe an ``lm_head``) with its caches in pages of ``page_size`` of
    ``kv_dtype`` (default: the model's). Attention FLOPs per pair: 2 x (q.k width + v width) per
    query head, MLA's absorbed form (latent + RoPE, latent) for DeepSeek."""
    cfg = model.cfg
    weight_bytes = embed_bytes = matmul = head = expert_bytes = expert_params = 0.0
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        x = variable.get_value()
        name, nbytes = ".".join(map(str, path)), x.size * x.dtype.itemsize
        scale = path[-1] == "scale"          # a norm's, or an FP8 kernel's scales: bytes, no FLOPs
        if "embed" in name:
            embed_bytes = nbytes
            head += x.size if cfg.tie_embeddings else 0
            continue
        if path[:1] == ("layers",) and isinstance(model.layers[path[1]].mlp, MoE) and path[3] in EXPERT_AXES:
            expert_bytes += nbytes / x.shape[0]  # a mixture's stacked experts: counted per step as touched
            expert_params += 0 if scale else x.size / x.shape[0]
            # but a shared expert fused into the stack (fusion) is read and computed every step
            shared = model.layers[path[1]].mlp.fused_shared_experts
            weight_bytes += shared * nbytes / x.shape[0]
            matmul += 0 if scale else shared * x.size / x.shape[0]
            continue
        weight_bytes += nbytes
        if "lm_head" in name:
            head += x.size
        elif x.ndim >= 2 and not scale:
            matmul += x.size
    if isinstance(model, DeepSeek):
        pair = 2 * (cfg.kv_lora_rank + cfg.qk_rope_dim) + 2 * cfg.kv_lora_rank
    else:
        pair = 4 * cfg.head_dim
    return Costs(weight_bytes=weight_bytes + (embed_bytes if cfg.tie_embeddings else 0),
                 embed_row_bytes=0.0 if cfg.tie_embeddings else embed_bytes / cfg.vocab_size,
                 kv_bytes_per_token=page_bytes(model, page_size, dtype=kv_dtype) / page_size,
                 matmul_params=matmul, head_params=head,
                 flops_per_pair=float(cfg.num_layers * cfg.num_q_heads * pair),
                 num_experts=cfg.num_experts if expert_bytes else 0,
                 experts_per_token=cfg.num_experts_per_tok if expert_bytes else 0,
                 expert_bytes=expert_bytes, expert_params=expert_params)


def step_bound(record, costs: Costs, copy_rate: float, matmul_rate: float) -> float:
    """Seconds a step (a ``StepRecord``) takes at least: its bytes over the copy rate or its FLOPs
    over the matmul rate, whichever is longer (routed experts: those the step is expected to touch,
    module docstring)."""
    touched = 0.0
    if costs.num_experts:
        touched = costs.num_experts * (1 - (1 - costs.experts_per_token / costs.num_experts) ** record.tokens)
    nbytes = (costs.weight_bytes + touched * costs.expert_bytes + record.tokens * costs.embed_row_bytes
              + (record.context_tokens + record.tokens) * costs.kv_bytes_per_token)
    flops = (2 * (costs.matmul_params + costs.experts_per_token * costs.expert_params) * record.tokens
             + 2 * costs.head_params * record.rows + costs.flops_per_pair * record.attention_pairs)
    return max(nbytes / copy_rate, flops / matmul_rate)


def busy_share(records: Sequence, start: float, wall: float) -> float:
    """The GPU's busy share of ``wall`` seconds from ``start``, estimated from host timestamps: it
    idles before the first launch and for max(0, t_launched[n+1] - t_done[n]) between steps."""
    idle = records[0].t_launched - start if records else wall
    for done, launched in itertools.pairwise(records):
        if done.t_done:                  # 0 or None: its tokens were never waited for
            idle += max(0.0, launched.t_launched - done.t_done)
    return 1.0 - idle / wall


# --- serving --------------------------------------------------------------------------------------

def serve(engine: Engine, trace: Sequence[TraceRequest], profile_at: Sequence[int] = (),
          profile_steps: int = 8) -> dict:
    """Serves ``trace`` in real time on a warmed-up ``engine`` (made with ``record_steps=True``):
    per-request token times, the steps it ran and its counters; with ``profile_at``, the GPU's
    kernels of ``profile_steps`` steps from each of those step numbers (``StepWindow``)."""
    pending = collections.deque(trace)
    arrival, first, last, requests = {}, {}, {}, []
    stats_before = collections.Counter(engine.stats)
    steps_before = len(engine.step_records)
    windows = [StepWindow(at, profile_steps) for at in sorted(profile_at)]
    start = report_at = time.perf_counter()
    generated = 0
    while pending or engine.has_work:
        now = time.perf_counter()
        while pending and start + pending[0].arrival <= now:
            item = pending.popleft()
            request = engine.add_request(item.prompt, item.new_tokens)
            request.draft_oracle = item.draft_oracle
            arrival[request.id] = start + item.arrival
            requests.append(request)
        if not engine.has_work:
            time.sleep(max(0.0, start + pending[0].arrival - time.perf_counter()))
            continue
        events = engine.step_events()
        now = time.perf_counter()
        for request, tokens in events:
            if tokens:
                first.setdefault(request.id, now)
                last[request.id] = now
                generated += len(tokens)
        if now >= report_at + PROGRESS_S:      # a run cut by a time limit still says how far it got
            report_at = now
            print(f"[{now - start:.0f} s] {len(engine.step_records) - steps_before} steps, {len(requests)} of "
                  f"{len(trace)} requests added, {generated:,} tokens generated", file=sys.stderr, flush=True)
        for window in windows:
            window.advance(len(engine.step_records) - steps_before)
    wall = max(last.values()) - start
    records = engine.step_records[steps_before:]
    for window in windows:
        window.advance(len(records), finished=True)
    stats = collections.Counter(engine.stats)
    stats.subtract(stats_before)
    ids = [r.id for r in requests]
    tpot = [(last[r.id] - first[r.id]) / (len(r.output) - 1) for r in requests if len(r.output) > 1]
    return {"wall_s": wall, "start": start, "records": records, "requests": len(requests),
            "ttft_ms": np.array([first[i] - arrival[i] for i in ids]) * 1e3, "tpot_ms": np.array(tpot) * 1e3,
            "prompt_tokens": sum(r.prompt.size for r in requests),
            "generated": sum(len(r.output) for r in requests),
            "computed_tokens": sum(r.tokens for r in records), "preemptions": stats["preemptions"],
            "outputs": [list(r.output) for r in requests],
            "profiles": [(w, collections.Counter(step_kind(r) for r in records[w.first:w.last]))
                         for w in windows if w.events is not None]}


class StepWindow:
    """A profile of the GPU's kernels over ``steps`` engine steps from step ``at`` of a trace
    (``jax.profiler``, started and stopped between steps: with the overlap, the window's kernels
    are those that ran while its steps were being launched, one step's worth shifted). The
    profiler's own cost slows those steps; the trace's other figures include them."""

    def __init__(self, at: int, steps: int):
        self.at, self.steps = at, steps
        self.first = self.last = None
        self.events: dict[str, tuple[float, float]] | None = None
        self.span_s: float | None = None       # per step, first kernel's start to last's end
        self._dir: tempfile.TemporaryDirectory | None = None

    def advance(self, done: int, finished: bool = False) -> None:
        """Starts or stops the profile once ``done`` steps of the trace have run."""
        if self._dir is None and self.events is None and done >= self.at and not finished:
            self._dir, self.first = tempfile.TemporaryDirectory(), done
            jax.profiler.start_trace(self._dir.name, profiler_options=kernel_profile_options())
        elif self._dir is not None and (done >= self.first + self.steps or finished):
            jax.profiler.stop_trace()
            self.last = done
            try:
                self.events = trace_events(self._dir.name, max(1, done - self.first))
                self.span_s = trace_span(self._dir.name, max(1, done - self.first))
            except RuntimeError:           # no GPU stream events (the CPU smoke runs)
                self.events = {}
            self._dir.cleanup()
            self._dir = None


def kernel_rows(window: StepWindow, kinds: collections.Counter, top: int | None = 10) -> list[str]:
    """A window's profile as table rows: GPU time and launches per step by kind of kernel
    (``benchmarks.profile_step.by_kind``) and the GPU's span per step, then its ``top`` kernels
    (None: all)."""
    steps = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    lines = ["", f"GPU kernels of steps {window.first}-{window.last - 1} of the trace ({steps}), per step:", ""]
    if not window.events:
        return lines + ["No GPU kernels were profiled (not a GPU)."]
    total = sum(seconds for seconds, _ in window.events.values())
    grouped = by_kind(window.events)
    lines += ["| kernel kind | ms per step | share | launches per step |", "|---|---|---|---|"]
    lines += [f"| {kind} | {1e3 * s:.2f} | {100 * s / total:.0f}% | {n:.0f} |" for kind, (s, n, _) in grouped.items()]
    lines += [f"| total | {1e3 * total:.2f} | 100% | {sum(n for _, n, _ in grouped.values()):.0f} |", "",
              f"GPU span per step (first kernel's start to last kernel's end, over the window): "
              f"{1e3 * window.span_s:.2f} ms, {total / window.span_s:.0%} of it in kernels.", "",
              "| kernel | kind | ms per step | launches per step |", "|---|---|---|---|"]
    heaviest = sorted(window.events.items(), key=lambda item: -item[1][0])[:top]
    return lines + [f"| `{name[:80]}` | {kind_of(name)} | {1e3 * s:.3f} | {n:.0f} |" for name, (s, n) in heaviest]


def summarize(result: dict, costs: Costs, copy_rate: float, matmul_rate: float) -> dict:
    """``result`` with its roofline, GPU busy share and host time per step."""
    records = result["records"]
    roofline = sum(step_bound(r, costs, copy_rate, matmul_rate) for r in records)
    host = [r.t_launched - r.t_start for r in records]
    return dict(result, roofline_s=roofline, roofline_share=roofline / result["wall_s"],
                busy=busy_share(records, result["start"], result["wall_s"]), steps=len(records),
                host_ms=1e3 * float(np.mean(host)) if host else 0.0)


STEP_KINDS = ("decode only", "mixed", "prefill only")


def step_kind(record) -> str:
    """A step's kind: decodes only (a row's token and its drafts), prompt chunks only, or both."""
    if not record.prefill_tokens:
        return "decode only"
    return "mixed" if record.decode_rows else "prefill only"


def breakdown(result: dict, costs: Costs, copy_rate: float, matmul_rate: float) -> list[str]:
    """Where a run's time goes by step kind, as table rows: steps; time, estimated per step as the
    interval between its tokens reaching the host and the previous step's (the GPU's step time
    when the GPU is busy throughout; the first step's from the trace's start, and time spent
    waiting for arrivals goes to the step after it); that time's share
    of the wall time; the roofline's share of that time; tokens computed; and the padding the
    compiled shapes added (tokens and rows run that the step did not need, as a share of the
    shapes' tokens and rows)."""
    records = result["records"]
    done = [result["start"]] + [r.t_done for r in records]
    stats = {kind: collections.Counter() for kind in STEP_KINDS}
    for before, record, after in zip(done, records, done[1:]):
        kind = stats[step_kind(record)]
        kind.update(steps=1, seconds=max(0.0, after - before), tokens=record.tokens, rows=record.rows,
                    roofline=step_bound(record, costs, copy_rate, matmul_rate), padded_tokens=record.padded_tokens,
                    padded_rows=record.padded_rows)
    rows = []
    for kind, k in stats.items():
        if not k["steps"]:
            continue
        padding = (1 - k["tokens"] / k["padded_tokens"], 1 - k["rows"] / k["padded_rows"])
        rows.append(f"| {kind} | {k['steps']:,} | {k['seconds']:.2f} | {100 * k['seconds'] / result['wall_s']:.0f}% | "
                    f"{100 * k['roofline'] / max(k['seconds'], 1e-12):.0f}% | {k['tokens']:,} | "
                    f"{100 * padding[0]:.0f}% | {100 * padding[1]:.0f}% |")
    return rows


COLUMNS = ("trace shape | requests | generated tokens | wall s | generated tokens/s | total tokens/s | roofline s | "
           "% of roofline | GPU busy % | host ms/step | steps | TTFT ms p50 / p90 / p99 | TPOT ms p50 / p90 / p99 "
           "| preemptions")


def percentiles(x: Sequence[float], digits: int) -> str:
    """p50 / p90 / p99 of ``x`` ("-" when empty)."""
    x = np.asarray(x)
    return " / ".join(f"{v:.{digits}f}" for v in np.percentile(x, [50, 90, 99])) if x.size else "-"


def row(label: str | None, shape: str, r: dict) -> str:
    """A table row (``label``: the first column's, when the table has one)."""
    cells = [] if label is None else [label]
    cells += [shape, f"{r['requests']:,}", f"{r['generated']:,}", f"{r['wall_s']:.2f}",
              f"{r['generated'] / r['wall_s']:,.0f}", f"{(r['prompt_tokens'] + r['generated']) / r['wall_s']:,.0f}",
              f"{r['roofline_s']:.2f}", f"{100 * r['roofline_share']:.0f}%", f"{100 * r['busy']:.0f}%",
              f"{r['host_ms']:.2f}", f"{r['steps']:,}", percentiles(r["ttft_ms"], 1), percentiles(r["tpot_ms"], 2),
              str(r["preemptions"])]
    return "| " + " | ".join(cells) + " |"


def table(first_column: str | None, rows: list[str]) -> list[str]:
    header = ([first_column] if first_column else []) + COLUMNS.split(" | ")
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows]


def command(args: argparse.Namespace, layers: int) -> str:
    """The command that reproduces this run."""
    parts = ["python -m benchmarks.bench_serving", f"--trace {args.trace}", f"--preset {args.preset}",
             f"--layers {layers}", f"--requests {args.requests}", f"--page-size {args.page_size}",
             f"--backend {args.backend}"]
    parts += [f"--tp {args.tp}"] if args.tp > 1 else []
    parts += ["--enable-expert-parallel"] if args.enable_expert_parallel else []
    parts += [f"--quantization {args.quantization}"] if args.quantization else []
    parts += ["--fp8-activations"] if args.fp8_activations else []
    parts += [f"--kv-cache-dtype {args.kv_cache_dtype}"] if args.kv_cache_dtype != "auto" else []
    parts += [f"--moe-gemm {args.moe_gemm}"] if args.moe_gemm != "auto" else []
    parts += [f"--{name.replace('_', '-')} {getattr(args, name)}"
              for name in ("max_seqs", "num_pages", "max_step_tokens") if getattr(args, name) is not None]
    parts += [f"--rate {args.rate:.4g}"] if args.rate is not None else []
    parts += [f"--profile-at {args.profile_at} --profile-steps {args.profile_steps}"] if args.profile_at else []
    parts += ["--no-overlap"] if args.no_overlap else []
    parts += ["--unfused"] if args.unfused else []
    parts += [f"--compile-threads {args.compile_threads}"] if args.compile_threads is not None else []
    return " ".join(parts + (["--smoke"] if args.smoke else []))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, choices=TRACES)
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(MODELS), help="model shapes (random weights)")
    parser.add_argument("--layers", type=int, default=None, help="number of layers (default: the preset's)")
    parser.add_argument("--tp", type=int, default=1, help="devices to split the model over (tensor parallelism)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="with --tp: each device holds whole experts (a mixture-of-experts preset)")
    parser.add_argument("--quantization", choices=METHODS, default=None,
                        help="FP8 weights (jaxattn.serve.models.quantization.quantize: the blocks' linears)")
    parser.add_argument("--fp8-activations", action="store_true",
                        help="with --quantization fp8: the linears' inputs quantized to FP8 per row, FP8 x FP8 GEMMs "
                             "(quantization.set_fp8_activations)")
    parser.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default="auto",
                        help="the KV cache's dtype, as vLLM spells it: auto (the model's) or fp8 (float8_e4m3fn; "
                             "MLA's latent cache too)")
    parser.add_argument("--moe-gemm", choices=["auto", *GEMMS], default="auto",
                        help="how a mixture of experts computes its experts (jaxattn.serve.models.experts)")
    parser.add_argument("--requests", type=int, default=None, help="requests in the trace (default: the trace's)")
    parser.add_argument("--max-seqs", type=int, default=None, help="sequences in flight (default: the Engine's)")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="KV pages (default: the Engine's: from device memory, or for --max-seqs sequences of the "
                             "longest request)")
    parser.add_argument("--max-step-tokens", type=int, default=None, help="tokens per step (default: the Engine's)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--backend", default="auto", help="paged_attention backend")
    parser.add_argument("--rate", type=float, default=None,
                        help=f"poisson: requests/s (default: {LOAD} x the saturation rate measured first)")
    parser.add_argument("--no-overlap", action="store_true", help="Engine(overlap=False)")
    parser.add_argument("--unfused", action="store_true", help="Engine(fuse_projections=False)")
    parser.add_argument("--profile-at", default="", metavar="STEP,...",
                        help="profile the GPU's kernels of --profile-steps steps from each of these steps of the "
                             "trace (e.g. 40,1500: a mixed and a decode-only window of the throughput trace)")
    parser.add_argument("--profile-steps", type=int, default=8, help="steps per profiled window")
    parser.add_argument("--compile-threads", type=int, default=None,
                        help="steps XLA compiles at a time in the warm-up (default: Engine.warmup's)")
    parser.add_argument("--section", default=None,
                        help="the RESULTS.md section to write (default: the trace's, with a suffix for a preset, "
                             "mesh, quantization or expert GEMM other than the defaults)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and trace (CPU, seconds); RESULTS.md "
                                                              "is left alone")
    args = parser.parse_args(argv)
    show_engine_log()
    if args.compile_threads is not None and args.compile_threads < 1:
        parser.error("--compile-threads must be >= 1")
    if args.enable_expert_parallel and args.tp < 2:
        parser.error("--enable-expert-parallel needs --tp N with N >= 2")
    if args.fp8_activations and not args.quantization:
        parser.error("--fp8-activations needs --quantization fp8")
    starts = sorted(int(step) for step in args.profile_at.split(",") if step)
    if any(b - a < args.profile_steps for a, b in zip(starts, starts[1:])) or args.profile_steps < 1:
        parser.error("--profile-at: windows of --profile-steps steps must not overlap (and --profile-steps >= 1)")
    spec = (SMOKE if args.smoke else SPECS)[args.trace]
    model_class, cfg = MODELS[args.preset]
    if args.smoke:
        model_class, cfg = smoke_model(args.preset)
        args.page_size = 8
        args.max_seqs = args.max_seqs or 4
        args.max_step_tokens = args.max_step_tokens or 4       # two step shapes to compile
    args.requests = args.requests or spec.requests
    spec = dataclasses.replace(spec, requests=args.requests)
    if args.layers is not None:
        cfg = cfg.replace(num_layers=args.layers)

    if args.smoke:
        copy_rate, matmul_rate = copy_bandwidth(1 << 24, trials=3), gemm_rate(256, jnp.float32, trials=3)
    else:
        copy_rate, matmul_rate = copy_bandwidth(), gemm_rate()
    rates = f"copy rate {copy_rate / 1e9:,.0f} GB/s (read + write), matmul rate {matmul_rate / 1e12:.3g} TFLOP/s"
    print(rates, flush=True)
    model = model_class(cfg, nnx.Rngs(0))
    if args.quantization:
        quantize(model, args.quantization)
        if args.fp8_activations:
            set_fp8_activations(model)
    if args.moe_gemm != "auto":
        set_expert_gemm(model, args.moe_gemm)
    mesh = tp_mesh(jax.devices()[:args.tp])
    if mesh is not None:
        model = shard_model(model, mesh, expert_parallel=args.enable_expert_parallel)
    kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
    costs = model_costs(model, args.page_size, kv_dtype)
    trace = make_trace(args.trace, spec, cfg.vocab_size)
    max_seq_len = max(r.prompt.size + r.new_tokens for r in trace)
    setup = {}

    def run(trace: Sequence[TraceRequest], prefix_caching: bool = True) -> dict:
        engine = Engine(model, max_seqs=args.max_seqs, max_seq_len=max_seq_len, page_size=args.page_size,
                        num_pages=args.num_pages, max_step_tokens=args.max_step_tokens, backend=args.backend,
                        enable_prefix_caching=prefix_caching, overlap=not args.no_overlap, record_steps=True,
                        mesh=mesh, fuse_projections=not args.unfused, kv_dtype=kv_dtype,
                        max_logprobs=0)                                                   # no request asks
        print(f"warm-up: compiling {len(engine.buckets.shapes)} step shapes", file=sys.stderr, flush=True)
        threads = args.compile_threads or default_compile_threads()
        warmup_s = engine.warmup(sampled=False, compile_threads=threads)
        setup.update(compile_threads=threads, max_seqs=engine.max_seqs, num_pages=engine.num_pages,
                     max_step_tokens=engine.max_step_tokens, warmup_s=max(setup.get("warmup_s", 0.0), warmup_s))
        print(f"warm-up done in {setup['warmup_s']:.0f} s; serving {len(trace)} requests", file=sys.stderr, flush=True)
        profile_at = [int(step) for step in args.profile_at.split(",") if step]
        result = summarize(serve(engine, trace, profile_at, args.profile_steps), costs, copy_rate, matmul_rate)
        del engine                               # its KV pool, before the next engine takes the memory
        gc.collect()
        return result

    shape = describe(args.trace, trace, spec)
    if args.trace == "shared-prefix":
        first_column = "prefix caching"
        results = {label: run(trace, on) for label, on in (("off", False), ("on", True))}
    elif args.trace == "poisson":
        first_column = "arrivals"
        offline = run(trace)
        args.rate = args.rate or LOAD * offline["requests"] / offline["wall_s"]
        timed = make_trace(args.trace, spec, cfg.vocab_size, rate=args.rate)
        results = {"all at once": offline, f"Poisson, {args.rate:.1f} requests/s": run(timed)}
    else:
        first_column = None
        results = {None: run(trace)}
    rows = [row(label, shape, r) for label, r in results.items()]
    for line in rows:
        print(line, flush=True)
    rows += [published_row(first_column, p) for p in PUBLISHED.get(args.trace, [])]

    engine_text = (f"{setup['max_seqs']} sequences in flight, {setup['max_step_tokens']} tokens per step, "
                   f"{setup['num_pages']:,} pages of {args.page_size}, overlap {'off' if args.no_overlap else 'on'}, "
                   f"q/k/v and gate/up projections {'apart' if args.unfused else 'fused'}")
    gemm = "float32 256^3" if args.smoke else "bf16 8192^3"
    trace_text = {
        "chat": "lognormal lengths in the shape of ShareGPT (which cannot be downloaded here), not ShareGPT",
        "poisson": f"lognormal lengths in the shape of ShareGPT (which cannot be downloaded here), served all at "
                   f"once, then with Poisson arrivals at {LOAD:g} x the requests/s of that run unless --rate is given",
        "shared-prefix": "all at once, prefix caching off, then on",
    }.get(args.trace, "all at once")
    parallel = ""
    if args.tp > 1:
        parallel = (f"split over {args.tp} devices (tensor parallelism"
                    + (", experts whole per device); " if args.enable_expert_parallel else "); "))
    auto_table = f" (its table: {choice_table.describe_current_table()})" if args.backend == "auto" else ""
    weights = "" if not args.quantization else " (FP8 weights and activations)" if args.fp8_activations \
        else " (FP8 weights)"
    weights += "" if kv_dtype is None else f", KV cache {jnp.dtype(kv_dtype).name}"
    header = (f"Device: {device_name()}; date {datetime.date.today()}; jax {jax.__version__}; model {args.preset} "
              f"shapes with {cfg.num_layers} layers, {cfg.dtype}{weights}, "
              f"random weights; {parallel}backend {args.backend}{auto_table}; "
              f"{engine_text}; warm-up (compiling every step shape, {setup['compile_threads']} at a time) "
              f"{setup['warmup_s']:.0f} s, not timed. The {rates} ({gemm} GEMM), measured in the same run.")
    trace_line = (f"Trace ({args.trace}, seed 0): {args.requests} requests, {shape}; random prompt tokens, greedy, "
                  f"every request runs to its output length; {trace_text}.")
    lines = [
        header,
        trace_line,
        f"Command: `{command(args, cfg.num_layers)}`",
        "",
        *table(first_column, rows),
        "",
        ("Roofline: per step, max(bytes / copy rate, FLOPs / matmul rate), summed over the steps the engine ran; "
        "bytes = the weights once + the K/V attention reads + the K/V writes, FLOPs = 2 x weights x tokens + "
        "attention (module docstring of benchmarks/bench_serving.py). GPU busy % is an estimate from host "
        "timestamps, an upper bound (a step not yet launched when the previous step's tokens reached the host counts "
         "as idle); compare host ms/step with wall s / steps."),
    ]
    if args.trace == "shared-prefix":
        off, on = results["off"], results["on"]
        prefill = {k: r["computed_tokens"] - (r["generated"] - r["requests"]) for k, r in results.items()}
        same = sum(a == b for a, b in zip(off["outputs"], on["outputs"]))
        lines += ["", (f"Prompt tokens computed (a preempted request's recomputed tokens included): "
                       f"{prefill['off']:,} with prefix caching off, {prefill['on']:,} on "
                       f"({100 * (1 - prefill['on'] / prefill['off']):.0f}% fewer), of {off['prompt_tokens']:,} prompt "
                       f"tokens. Requests whose tokens are the same with prefix caching on and off: "
                       f"{same}/{args.requests} (bf16 on the GPU: a prefill that starts after cached pages rounds "
                       f"differently, and greedy tokens may part after a near tie).")]
    for label, r in results.items():
        lines += ["", f"Where the time goes by step kind{f' ({label})' if label else ''}:", "",
                  "| step kind | steps | s | share of wall | % of roofline | tokens | padded tokens | padded rows |",
                  "|---|---|---|---|---|---|---|---|", *breakdown(r, costs, copy_rate, matmul_rate)]
    for label, r in results.items():
        for window, kinds in r["profiles"]:
            lines += kernel_rows(window, kinds)
            print("\n".join(kernel_rows(window, kinds, top=None)), file=sys.stderr)     # the log has every kernel
    lines += ["", "A step's time: from the step before's tokens reaching the host to its own (the GPU's step time "
                  "while the GPU is busy; GPU busy % above says how far that holds). Padded tokens / rows: the share "
                  "of the compiled shape's tokens / rows the step did not need."]
    if args.trace in TARGETS:
        shares = ", ".join(f"{100 * r['roofline_share']:.0f}%" for r in results.values())
        lines += ["", f"Target: >= {TARGETS[args.trace]}% of the roofline; this run: {shares}."]
    lines += ["", SOURCES[args.trace]]
    section, heading = SECTIONS[args.trace], HEADINGS[args.trace]
    if args.preset != "llama3-8b" or args.tp > 1 or args.trace == "throughput" or args.quantization or kv_dtype:
        suffix = "".join([args.preset, f"_tp{args.tp}" if args.tp > 1 else "",
                          "_ep" if args.enable_expert_parallel else "",
                          f"_{args.quantization}" if args.quantization else "",
                          "_w8a8" if args.fp8_activations else "",
                          f"_kv{args.kv_cache_dtype}" if kv_dtype is not None else "",
                          f"_{args.moe_gemm}" if args.moe_gemm != "auto" else ""])
        section, heading = f"{section}_{suffix}", f"{heading}: {suffix}"
    if args.section:
        section, heading = args.section, f"{heading}: {args.section}"
    print(write_section(section, "\n".join(lines), heading=heading, update=not args.smoke))


if __name__ == "__main__":
    main()
