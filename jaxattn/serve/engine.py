"""A continuous-batching generation engine over a paged KV cache: the loop.

The host loop admits requests, schedules chunked prefill and decodes within a token budget per
step, and releases finished sequences (``jaxattn.serve.scheduler``); each step packs the schedule and
runs one jitted function of (model weights, donated KV caches, donated page table) that frees
finished sequences, allocates pages, writes K/V, runs attention in every layer and samples the
next tokens (``jaxattn.serve.step``). The model is any ``jaxattn.serve.models.base.PagedModel``.

The loop overlaps the host with the device: it schedules, packs and launches step n+1 while step
n runs, and only then waits for step n's tokens (a decode of step n+1 takes step n's token on
the device). Tokens reach the host one step late; a request that stops in step n computes one
more row, whose token is dropped. A step with rows under a grammar (structured output) has its
tokens picked once step n's tokens have advanced the grammars: after the wait, while the GPU
runs it. The host never reads the page table: it mirrors the pool, and learns the ids of the
prompt pages to cache from the step's small ``pages`` output.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
import weakref
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxattn.backends import OPS, check_serves
from jaxattn.checks import is_int, is_positive_int
from jaxattn.kv_cache import CACHE_DTYPES, LAYOUTS, is_cache_dtype
from jaxattn.serve.models import fusion
from jaxattn.serve.models.base import ModelConfig, PagedModel, page_bytes
from jaxattn.serve.models.layers import Decoder
from jaxattn.serve.models.parallel import place_experts
from jaxattn.serve.sampling import MAX_LOGPROBS, SamplingParams
from jaxattn.serve.scheduler import PageUsage, Request, Schedule, Scheduler
from jaxattn.serve.speculative import SpeculativeConfig
from jaxattn.serve.step import StepBuckets, StepLaunch, StepRecord, StepRunner
from jaxattn.serve.structured_output import GrammarCompiler
from jaxattn.sharding import num_head_shards, tensor_parallel_mesh

__all__ = ["Engine", "Request"]

# Without max_seqs, the sequences in flight are what the pool holds at max_seq_len, at most this
# (vLLM's default max_num_seqs); on a device that does not report its memory, the pool holds 8.
MAX_SEQS_FROM_POOL = 256
MAX_SEQS_WITHOUT_MEMORY_STATS = 8
DEFAULT_MAX_STEP_TOKENS = 2048
DEFAULT_PREFILL_CHUNK = 512
# Prompt chunks of a mixed step of a model that serves them with mla_prefill, at most: its K/V are
# expanded per head for this many sequences (past the step's decodes, which run absorbed), not for
# all max_seqs; 2,048 tokens of 512-token chunks make four.
DEFAULT_MLA_PREFILL_SEQS = 8
# add_choices queues n requests at once: a bound far above use (RL rollouts sample tens to hundreds
# per prompt; the HTTP layer takes OpenAI's 128) that a mistyped n (2**31 - 1) cannot pass.
MAX_CHOICES = 1 << 16
# XLA compiles the warm-up's steps this many at a time by default, at most half the host's CPUs
# (XLA's GPU compiler runs threads of its own): DeepSeek-V2-Lite's 8 steps at 27 layers compiled in
# 86 s with 8 on a 16-core H100 host, where one at a time each had taken 28-50 s.
MAX_COMPILE_THREADS = 8


def _shared_entropy() -> int:
    """Fresh entropy for the engine's request seeds, the same in every process of a
    ``jax.distributed`` job (process 0's), so every process samples the same tokens."""
    entropy = np.random.SeedSequence().entropy % 2**31      # int32: what JAX carries without x64
    if jax.process_count() > 1:
        entropy = int(multihost_utils.broadcast_one_to_all(np.int32(entropy)))
    return entropy


@dataclasses.dataclass
class _Launched:
    """A step on the device: its schedule, its launch (outputs not yet on the host; a deferred
    step's tokens not yet picked) and its record (with ``record_steps``)."""

    schedule: Schedule
    step: StepLaunch
    record: StepRecord | None


class Engine:
    """Generation for many requests over a fixed number of sequence slots (greedy unless a
    request's ``SamplingParams`` say otherwise).

    Args:
      model: the decoder, a ``jaxattn.serve.models.base.PagedModel``: a ``Llama`` (KV pools) or a
        ``jaxattn.serve.models.deepseek.DeepSeek`` (MLA latent pools).
      max_seqs: sequences in flight (rows of a step). None: as many sequences of ``max_seq_len``
        as the pool holds, at most ``MAX_SEQS_FROM_POOL``.
      max_seq_len: longest prompt + generation a request may have.
      page_size, layout, kv_dtype: KV cache shape.
      num_pages: pages in the pool (page 0 is the null page). None: with ``max_seqs``, enough for
        ``max_seqs`` sequences of ``max_seq_len``; without, ``kv_memory_fraction`` of the
        device's free memory (a device that does not report it: ``MAX_SEQS_WITHOUT_MEMORY_STATS``
        sequences). It must hold at least one sequence of ``max_seq_len``.
      max_step_tokens: tokens one step computes at most, decodes included (>= max_seqs); prompt
        chunks take what decodes leave. None: ``max(DEFAULT_MAX_STEP_TOKENS, max_seqs)``. Either is
        capped at what ``max_seqs`` sequences hold (the attribute holds the value used).
      prefill_chunk: prompt tokens one request computes in a step, at most (the static
        ``max_q_len`` of mixed steps; ``step.StepBuckets``). None: ``max_step_tokens``.
      max_prefill_seqs: prompt chunks of more than one token one step computes, at most (the
        static ``AttentionMetadata.max_prefill_seqs`` of mixed steps: a mixed step's prefill part
        runs over that many sequences, not ``max_seqs``); requests past them wait a step. None:
        ``DEFAULT_MLA_PREFILL_SEQS`` for a model served with ``mla_prefill`` (its K/V expanded
        per sequence), else any number. Not with ``speculative`` (its verify rows ride in mixed
        steps beside the chunks).
      backend: "auto" or one backend that runs every op of ``model.attention_ops`` (checked here).
      enable_prefix_caching: a request starts on the cached pages of its longest cached prompt
        prefix and prefills only the rest (see ``jaxattn.serve.scheduler``).
      mesh: tensor parallelism over all the mesh's devices (``jaxattn.serve.models.llama``'s docstring):
        the weights split by heads, MLP columns and vocabulary, the KV pools by KV heads, the page
        table replicated; the same jitted step then runs on every device, with XLA's all-reduces
        inside. A mixture of experts' routed experts run on each device's part in a ``shard_map``
        (``jaxattn.serve.models.parallel.place_experts``, set on the model in place). Under
        ``jax.distributed`` (one process per GPU) every process runs the same engine with the same
        requests.
      overlap: schedule and launch step n+1 before waiting for step n's tokens (module
        docstring); False waits after every step (the same tokens).
      kv_memory_fraction: the share of free device memory a pool sized from memory takes.
      record_steps: keep a ``StepRecord`` per step in ``step_records``.
      max_logprobs: the most alternatives a request's ``SamplingParams.logprobs`` may ask for (0
        to ``MAX_LOGPROBS``; 0 refuses logprobs). Steps with a row that asks for logprobs run
        the step's logprobs variants (greedy and sampling ones: ``warmup`` compiles them unless
        this is 0); the others pay nothing for them.
      grammar_compiler: structured output (``jaxattn.serve.structured_output``) over the model's
        tokenizer; None refuses requests with ``SamplingParams.structured_outputs``. Steps with a
        row under a grammar are launched in two parts (``jaxattn.serve.step``; ``warmup``
        compiles them when there is a compiler).
      speculative: None, or speculative decoding (``jaxattn.serve.speculative``): a ``SpeculativeConfig``,
        or its dict or JSON text in vLLM's spelling, e.g. ``{"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``. A decode
        then verifies K drafts in its step and gains the drafts it keeps plus one token: greedy
        outputs stay those of an engine without it, sampled ones follow the same distribution.
        Decodes with logprobs, a grammar or stop tokens held back by ``min_tokens`` carry no
        drafts. The step shapes grow (decode buckets hold K + 1 tokens per row) and sequences may
        hold up to 2K tokens past ``max_seq_len`` on the device (3K with a draft model; counted
        in ``num_pages``).
      draft_model: the draft model of ``speculative`` method "draft_model", a ``PagedModel`` of
        the model's ``vocab_size`` (None: loaded from ``speculative.model``, a checkpoint
        directory or a ``jaxattn.serve.models.llama`` preset, in the model's dtype). Its caches share
        the page table (same pages, own pools: ``num_pages`` counts both); not with ``mesh``.
      fuse_projections: fuse the model's (and draft model's) q/k/v and gate/up projections in place,
        for ``mesh``'s shard count (``jaxattn.serve.models.fusion``; models of
        ``jaxattn.serve.models``: others are served as they are): one GEMM each, the same tokens.

    Raises ValueError naming the argument that does not fit. ``stats`` counts prompt tokens,
    cached tokens, computed tokens, evicted pages and preemptions (``jaxattn.serve.scheduler.Scheduler``).
    """

    def __init__(self, model: PagedModel, *, max_seqs: int | None = None, max_seq_len: int, page_size: int = 16,
                 num_pages: int | None = None, max_step_tokens: int | None = None, backend: str = "auto",
                 layout: str = "HND", kv_dtype=None, enable_prefix_caching: bool = True, mesh: Mesh | None = None,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, overlap: bool = True,
                 kv_memory_fraction: float = 0.9, record_steps: bool = False, max_logprobs: int = MAX_LOGPROBS,
                 grammar_compiler: GrammarCompiler | None = None,
                 speculative: SpeculativeConfig | dict | str | None = None, draft_model: PagedModel | None = None,
                 fuse_projections: bool = True, max_prefill_seqs: int | None = None):
        _check_model(model)
        check_serves(backend, model.attention_ops, where="Engine")
        for name, value in (("max_seq_len", max_seq_len), ("page_size", page_size)):
            if not is_positive_int(value):
                raise ValueError(f"Engine: {name} must be an int >= 1, got {value!r}")
        for name, value in (("max_seqs", max_seqs), ("num_pages", num_pages), ("max_step_tokens", max_step_tokens),
                            ("prefill_chunk", prefill_chunk), ("max_prefill_seqs", max_prefill_seqs)):
            if value is not None and not is_positive_int(value):
                raise ValueError(f"Engine: {name} must be None or an int >= 1, got {value!r}")
        # NumPy sizes (uint64, int8) as Python ints: arithmetic on them below would wrap
        max_seq_len, page_size = int(max_seq_len), int(page_size)
        max_seqs, num_pages, max_step_tokens, prefill_chunk, max_prefill_seqs = (
            None if value is None else int(value)
            for value in (max_seqs, num_pages, max_step_tokens, prefill_chunk, max_prefill_seqs))
        if layout not in LAYOUTS:
            raise ValueError(f"Engine: layout must be one of {LAYOUTS}, got {layout!r}")
        if kv_dtype is not None and not _is_dtype(kv_dtype):
            raise ValueError(f"Engine: kv_dtype must be None (the model's dtype) or a dtype, got {kv_dtype!r}")
        if kv_dtype is not None and not is_cache_dtype(kv_dtype):
            raise ValueError(f"Engine: kv_dtype must be None (the model's dtype) or a dtype the caches hold, one of "
                             f"{[jnp.dtype(d).name for d in CACHE_DTYPES]}, got {kv_dtype!r}")
        for name, value in (("enable_prefix_caching", enable_prefix_caching), ("overlap", overlap),
                            ("record_steps", record_steps), ("fuse_projections", fuse_projections)):
            if not isinstance(value, bool):
                raise ValueError(f"Engine: {name} must be a bool, got {value!r}")
        if not (is_int(max_logprobs) and 0 <= max_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"Engine: max_logprobs must be an int in [0, {MAX_LOGPROBS}], got {max_logprobs!r}")
        if not (isinstance(kv_memory_fraction, float | int) and 0 < kv_memory_fraction <= 1):
            raise ValueError(f"Engine: kv_memory_fraction must be a number in (0, 1], got {kv_memory_fraction!r}")
        if grammar_compiler is not None and not isinstance(grammar_compiler, GrammarCompiler):
            raise ValueError(f"Engine: grammar_compiler must be None or a "
                             f"jaxattn.serve.structured_output.GrammarCompiler, got {type(grammar_compiler).__name__}")
        if grammar_compiler is not None and grammar_compiler.vocab_size != model.cfg.vocab_size:
            raise ValueError(f"Engine: grammar_compiler.vocab_size must be the model's vocab_size="
                             f"{model.cfg.vocab_size}, got {grammar_compiler.vocab_size}")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise ValueError(f"Engine: mesh must be None or a jax.sharding.Mesh, got {type(mesh).__name__}")
        if speculative is not None:
            try:
                speculative = SpeculativeConfig.parse(speculative)
            except ValueError as err:
                raise ValueError(f"Engine: speculative: {err}") from None
        draft_tokens = speculative.num_drafts if speculative else 0
        if prefill_chunk is not None and prefill_chunk < draft_tokens + 1:
            raise ValueError(f"Engine: prefill_chunk must be >= num_speculative_tokens + 1 = {draft_tokens + 1} "
                             f"(a mixed step's rows hold a token and its drafts), got {prefill_chunk}")
        if speculative is not None and max_prefill_seqs is not None:
            raise ValueError("Engine: max_prefill_seqs is not taken with speculative (a mixed step's verify rows "
                             "ride beside its prompt chunks); give one or the other")
        if max_prefill_seqs is None and speculative is None and "mla_prefill" in model.attention_ops:
            max_prefill_seqs = DEFAULT_MLA_PREFILL_SEQS
        draft_model = _draft_model(model, speculative, draft_model, backend, mesh)
        draft_scratch = draft_tokens if draft_model is not None else 0
        if fuse_projections:
            shards = num_head_shards(*tensor_parallel_mesh(mesh)) if mesh is not None else 1
            for fusable in (model, draft_model):
                if isinstance(fusable, Decoder):
                    fusion.fuse_projections(fusable, shards)
        if mesh is not None and isinstance(model, Decoder):
            place_experts(model, mesh)
        # a speculating row may start up to K tokens past the host's count, and writes K + 1 tokens
        # (and a draft model K more, past the kept ones)
        pages_per_seq = -(-(max_seq_len + 2 * draft_tokens + draft_scratch) // page_size)
        # what set the pool's size, for the error when it does not fit
        pool_sized_by = "num_pages" if num_pages is not None else "max_seqs" if max_seqs is not None else "max_seq_len"
        device = _first_local_device(mesh)
        free_bytes = _free_bytes(device)
        # a page: the K/V of the model and of its draft model, on one device
        per_page = sum(page_bytes(m, page_size, layout, kv_dtype, mesh) for m in (model, draft_model) if m is not None)
        if num_pages is None:
            num_pages = _default_num_pages(max_seqs, pages_per_seq, per_page, free_bytes, kv_memory_fraction)
        if num_pages < 1 + pages_per_seq:
            drafts = f" and 2 x {draft_tokens} draft tokens" if draft_tokens else ""
            raise ValueError(f"Engine: num_pages must be >= {1 + pages_per_seq} (the null page and one sequence "
                             f"of max_seq_len={max_seq_len}{drafts}), got {num_pages}")
        if max_seqs is None:
            max_seqs = min(MAX_SEQS_FROM_POOL, (num_pages - 1) // pages_per_seq)
        # no step holds more tokens than its sequences: a larger budget would only size step
        # shapes (and their buffers) that no step fills
        step_capacity = max_seqs * pages_per_seq * page_size
        if max_step_tokens is None:
            max_step_tokens = max(DEFAULT_MAX_STEP_TOKENS, max_seqs)
        max_step_tokens = min(max_step_tokens, step_capacity)
        if max_step_tokens < max_seqs:
            raise ValueError(f"Engine: max_step_tokens must be >= max_seqs={max_seqs} (every decode fits in a "
                             f"step), got {max_step_tokens}")
        _check_pool_fits(num_pages, per_page, pool_sized_by, device, free_bytes)
        self.model = model
        self.max_seqs, self.max_seq_len, self.max_step_tokens = max_seqs, max_seq_len, max_step_tokens
        self.page_size, self.num_pages, self.backend, self.overlap = page_size, num_pages, backend, overlap
        self.max_logprobs, self.grammar_compiler, self.speculative = max_logprobs, grammar_compiler, speculative
        self.max_prefill_seqs = max_prefill_seqs
        self.runner = StepRunner(model, max_seqs=max_seqs, num_pages=num_pages, page_size=page_size,
                                 pages_per_seq=pages_per_seq, max_step_tokens=max_step_tokens,
                                 prefill_chunk=prefill_chunk, layout=layout, kv_dtype=kv_dtype, mesh=mesh,
                                 backend=backend, enable_prefix_caching=enable_prefix_caching, drafter=speculative,
                                 draft=draft_model, max_prefill_seqs=max_prefill_seqs)
        self._new_scheduler = functools.partial(
            Scheduler, max_seqs=max_seqs, num_pages=num_pages, page_size=page_size, max_step_tokens=max_step_tokens,
            enable_prefix_caching=enable_prefix_caching, prefill_chunk=prefill_chunk, draft_tokens=draft_tokens,
            seq_capacity=pages_per_seq * page_size, draft_scratch=draft_scratch, max_prefill_seqs=max_prefill_seqs)
        self.scheduler = self._new_scheduler()
        self._launched: collections.deque[_Launched] = collections.deque()
        self._previous_rows: dict[Request, int] = {}
        self.step_records: list[StepRecord] | None = [] if record_steps else None
        self._next_id = 0
        self._requests: weakref.WeakSet[Request] = weakref.WeakSet()    # add_request's, for abort's check
        self._seeds = np.random.default_rng(_shared_entropy())

    @property
    def buckets(self) -> StepBuckets:
        """The step shapes the runner compiles (``StepBuckets``)."""
        return self.runner.buckets

    @property
    def stats(self) -> collections.Counter[str]:
        """prompt_tokens, cached_tokens, computed_tokens, evicted_pages, preemptions."""
        return self.scheduler.stats

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._launched)

    @property
    def page_usage(self) -> PageUsage:
        """The pool's pages held by live requests, free, and cached (host view, no device sync)."""
        return self.scheduler.page_usage

    def add_request(self, prompt, max_new_tokens: int, *, sampling: SamplingParams | None = None) -> Request:
        """Queues a request for up to ``max_new_tokens`` (an int >= 1) tokens after ``prompt`` (a
        non-empty 1-D sequence or array of int token ids in ``[0, vocab_size)``), picked as
        ``sampling`` says (default: greedy; its ``stop_token_ids`` end the request early, as its
        grammar does when complete). ValueError naming the argument that does not fit (with
        llguidance's message for a ``sampling.structured_outputs`` that does not compile)."""
        if not is_positive_int(max_new_tokens):
            raise ValueError(f"Engine.add_request: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        prompt = self._prompt_ids(prompt)
        if prompt.size + max_new_tokens > self.max_seq_len:
            raise ValueError(f"Engine.add_request: len(prompt) + max_new_tokens must be <= "
                             f"max_seq_len={self.max_seq_len}, got {prompt.size} + {max_new_tokens}")
        if sampling is None:
            sampling = SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"Engine.add_request: sampling must be a SamplingParams, got {type(sampling).__name__}")
        if sampling.logprobs is not None and (self.max_logprobs == 0 or sampling.logprobs > self.max_logprobs):
            raise ValueError(f"Engine.add_request: sampling.logprobs must be <= this engine's max_logprobs="
                             f"{self.max_logprobs}, got {sampling.logprobs}")
        grammar = None
        if sampling.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise ValueError("Engine.add_request: sampling.structured_outputs needs an Engine made with a "
                                 "grammar_compiler")
            try:
                grammar = self.grammar_compiler.grammar(sampling.structured_outputs)
            except ValueError as err:
                raise ValueError(f"Engine.add_request: sampling.structured_outputs does not compile: {err}") from None
        seed = int(self._seeds.integers(2**32)) if sampling.seed is None else sampling.seed
        request = Request(self._next_id, prompt, max_new_tokens, sampling, seed, grammar=grammar)
        self._next_id += 1
        self._requests.add(request)
        self.scheduler.add(request)
        return request

    def add_choices(self, prompt, max_new_tokens: int, n: int, *,
                    sampling: SamplingParams | None = None) -> list[Request]:
        """Queues ``n`` requests (an int in ``[1, MAX_CHOICES]``) for ``prompt``, as ``add_request`` each, whose
        prompt is computed once: with prefix caching the others are admitted when the first's full
        prompt pages are cached and start on them (each still computes the rest of its last page);
        without, each computes it. Each has its own random stream: ``sampling.seed + i`` (mod
        2**32) when the seed is set, else one the engine draws. Returns them in order."""
        if not is_positive_int(n) or n > MAX_CHOICES:
            raise ValueError(f"Engine.add_choices: n must be an int in [1, {MAX_CHOICES}], got {n!r}")
        if sampling is None:
            sampling = SamplingParams()
        first = self.add_request(prompt, max_new_tokens, sampling=sampling)
        choices = [first]
        for i in range(1, n):
            seed = None if sampling.seed is None else (sampling.seed + i) % 2**32
            choice = self.add_request(first.prompt, max_new_tokens, sampling=dataclasses.replace(sampling, seed=seed))
            choice.prefill_after = first
            choices.append(choice)
        return choices

    def abort(self, request: Request) -> None:
        """Ends ``request`` (``finish_reason`` "abort"): it leaves the queue, or its slot and pages
        are freed in the next step; no more of its tokens come. A request that already finished
        stays as it is (a no-op: an abort may race the request's last step). ValueError, changing
        nothing, unless ``request`` is a ``Request`` this engine's ``add_request`` made (not one of
        another engine, whose slot and pages are that engine's)."""
        if not isinstance(request, Request) or request not in self._requests:
            raise ValueError(f"Engine.abort: request must be a Request from this engine's add_request, got "
                             f"{request!r:.80}")
        self.scheduler.abort(request)

    def _prompt_ids(self, prompt) -> np.ndarray:
        """``prompt`` as int32[L]; ValueError unless it is a non-empty 1-D sequence of ints in
        ``[0, vocab_size)`` (floats are not truncated, nested lists not flattened)."""
        try:
            ids = np.asarray(prompt)
        except ValueError:                           # ragged nesting
            ids = None
        if ids is not None and ids.dtype != bool and isinstance(prompt, (list, tuple)) \
                and any(isinstance(t, (bool, np.bool_)) for t in prompt):
            ids = None                               # NumPy would take True as token 1
        if ids is None or ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            got = type(prompt).__name__ if ids is None else f"{ids.dtype}{list(ids.shape)}"
            raise ValueError(f"Engine.add_request: prompt must be a non-empty 1-D sequence of int token ids, "
                             f"got {got}")
        vocab_size = self.model.cfg.vocab_size
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"Engine.add_request: prompt token ids must be in [0, {vocab_size}) (the model's "
                             f"vocab_size), got ids from {ids.min()} to {ids.max()}")
        return ids.astype(np.int32)

    def step(self) -> list[Request]:
        """Runs one engine step; returns the requests that finished in it."""
        return [r for r, _ in self.step_events() if r.done]

    def stream(self) -> Iterator[tuple[Request, list[int]]]:
        """Steps until every request is done (including requests added meanwhile), yielding
        ``(request, new_tokens)`` for each request that got tokens, step by step; the last yield of
        a request has ``request.done`` set."""
        while self.has_work:
            yield from self.step_events()

    def run(self, on_step: Callable[[int, int], None] | None = None) -> list[Request]:
        """Steps until every request is done; ``on_step(done, total)`` after each step."""
        total = len(self.scheduler.waiting) + len(self.scheduler.running)
        done: list[Request] = []
        while self.has_work:
            done += self.step()
            if on_step:
                on_step(len(done), total)
        return sorted(done, key=lambda r: r.id)

    def step_events(self) -> list[tuple[Request, list[int]]]:
        """One engine step: launches the next step, if there is work for one, then waits for the
        tokens of the step before it (with ``overlap``; else of this one). Returns
        ``(request, new_tokens)`` for each request that got tokens.

        When a step fails (its launch or its tokens raise), the engine ends every request it
        holds (``finish_reason`` "abort"), starts over with an empty page table and scheduler (the
        compiled steps kept; the KV pool too unless the failure consumed it), and re-raises: the
        requests added after it are served as by a new engine."""
        try:
            return self._step_events()
        except Exception:
            self._reset()
            raise

    def _reset(self) -> None:
        """Ends every request and clears the host and device state (``step_events``)."""
        for request in [*self.scheduler.waiting, *self.scheduler.running,
                        *(row.request for launched in self._launched for row in launched.schedule.rows)]:
            if not request.done:
                request.finish_reason = "abort"
        stats = self.scheduler.stats
        self.scheduler = self._new_scheduler()
        self.scheduler.stats = stats
        self._launched.clear()
        self._previous_rows = {}
        self.runner.reset()

    def _step_events(self) -> list[tuple[Request, list[int]]]:
        start = time.perf_counter()
        schedule = self.scheduler.schedule()
        if schedule is not None:
            self._launched.append(self._launch(schedule, start))
        elif not self._launched and self.scheduler.has_work:
            raise RuntimeError("Engine: requests are waiting but none can be scheduled (scheduler bug)")
        keep = 1 if self.overlap and schedule is not None else 0
        events = []
        while len(self._launched) > keep:
            events += self._complete(self._launched.popleft())
        for launched in self._launched:             # every step before it completed: its grammars are current
            self._pick(launched)
        return events

    def _launch(self, schedule: Schedule, start: float) -> _Launched:
        step = self.runner.launch(schedule, self._previous_rows)
        self._previous_rows = {row.request: i for i, row in enumerate(schedule.rows) if row.samples}
        record = None
        if self.step_records is not None:
            record = StepRecord.of(schedule, step.shape, start)
            record.t_launched = time.perf_counter()
            self.step_records.append(record)
        return _Launched(schedule, step, record)

    def _pick(self, launched: _Launched) -> None:
        """Picks a deferred step's tokens (rows under a grammar), unless picked."""
        if launched.step.next_tokens is None:
            self.runner.pick(launched.step)

    def _complete(self, launched: _Launched) -> list[tuple[Request, list[int]]]:
        self._pick(launched)
        step = launched.step
        next_tokens, ok = np.asarray(step.next_tokens), np.asarray(step.ok)
        if launched.record is not None:
            launched.record.t_done = time.perf_counter()
        if not ok[:len(launched.schedule.rows)].all():
            raise RuntimeError("Engine: page allocation failed for a scheduled request (allocator bug)")
        logprobs = None if step.logprobs is None else functools.partial(jax.device_get, step.logprobs)
        drafts = None if step.drafts is None else functools.partial(jax.device_get, step.drafts)
        return self.scheduler.complete(launched.schedule, next_tokens, lambda: np.asarray(step.pages), logprobs,
                                       drafts)

    def warmup(self, *, sampled: bool = True, compile_threads: int | None = None) -> float:
        """Compiles the step for every shape in ``buckets`` (greedy; with ``sampled`` the sampling
        variant too, and with a ``grammar_compiler`` the deferred step and its token picks, as
        structured output runs them; each also with logprobs unless ``max_logprobs`` is 0) by
        running it on padding rows, before serving, XLA compiling ``compile_threads`` steps at a
        time (default: half the host's CPUs, at most ``MAX_COMPILE_THREADS``); returns the seconds
        it took. Call it before adding requests."""
        if compile_threads is None:
            compile_threads = default_compile_threads()
        if not is_positive_int(compile_threads):
            raise ValueError(f"Engine.warmup: compile_threads must be an int >= 1, got {compile_threads!r}")
        if self.has_work:
            raise RuntimeError("Engine.warmup: call it before adding requests")
        start = time.perf_counter()
        try:
            self.runner.warmup(sampled=sampled, logprobs=self.max_logprobs > 0,
                               masked=self.grammar_compiler is not None, compile_threads=int(compile_threads))
        except jax.errors.JaxRuntimeError as error:
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            # the pool is sized before any step is compiled, so a step's temporaries may not fit beside it
            raise RuntimeError(
                f"Engine.warmup: a step ran out of device memory beside the KV pool of {self.num_pages:,} pages "
                f"(the step's temporaries grow with max_step_tokens={self.max_step_tokens}); give the Engine fewer "
                f"pages (num_pages, max_seqs, or a kv_memory_fraction below its default) or fewer tokens per "
                f"step. XLA said: {str(error).splitlines()[0]}") from error
        return time.perf_counter() - start


def default_compile_threads() -> int:
    """``Engine.warmup``'s compile threads: half the host's CPUs, 1 to ``MAX_COMPILE_THREADS``."""
    return max(1, min(MAX_COMPILE_THREADS, (os.cpu_count() or 1) // 2))


def _draft_model(model: PagedModel, speculative: SpeculativeConfig | None, draft: PagedModel | None, backend: str,
                 mesh: Mesh | None) -> PagedModel | None:
    """The draft model of ``speculative`` (method "draft_model"): ``draft``, or the model its
    ``model`` names; ValueError naming what does not fit."""
    if speculative is None or speculative.method != "draft_model":
        if draft is not None:
            raise ValueError("Engine: draft_model is only for speculative method \"draft_model\"")
        return None
    if mesh is not None:
        raise ValueError("Engine: speculative method \"draft_model\" does not run on a mesh yet")
    if draft is None:
        from jaxattn.serve.models import from_pretrained
        from jaxattn.serve.models.llama import PRESETS, Llama

        dtype = getattr(model.cfg, "dtype", None)
        if speculative.model in PRESETS:
            cfg = PRESETS[speculative.model]
            _check_draft_vocab(cfg.vocab_size, model)            # before building its weights
            draft = Llama(cfg.replace(dtype=dtype) if dtype is not None else cfg, nnx.Rngs(0))
        else:
            _check_draft_vocab(_checkpoint_vocab_size(speculative.model), model)   # before reading them
            try:
                draft = from_pretrained(speculative.model, dtype=dtype)
            except (ValueError, OSError) as err:
                raise ValueError(f"Engine: speculative.model {speculative.model!r} is neither a preset of "
                                 f"jaxattn.serve.models.llama nor a checkpoint it loads: {err}") from None
    try:
        _check_model(draft)
    except ValueError as err:
        raise ValueError(f"Engine: draft_model: {err}") from None
    _check_draft_vocab(draft.cfg.vocab_size, model)
    check_serves(backend, draft.attention_ops, where="Engine (draft model)")
    return draft


def _check_draft_vocab(vocab_size: int | None, model) -> None:
    """ValueError unless the draft model's ``vocab_size`` (None: not known yet) is ``model``'s."""
    if vocab_size is not None and vocab_size != model.cfg.vocab_size:
        raise ValueError(f"Engine: the draft model's vocab_size must be the model's ({model.cfg.vocab_size}), got "
                         f"{vocab_size}")


def _checkpoint_vocab_size(path: str) -> int | None:
    """The ``vocab_size`` of the checkpoint directory ``path``'s ``config.json``, or None where it
    cannot tell (``from_pretrained`` then names what is wrong)."""
    from jaxattn.serve.models.hf import read_config

    try:
        return read_config(path).get("vocab_size")
    except (OSError, ValueError):
        return None


def _default_num_pages(max_seqs: int | None, pages_per_seq: int, per_page: int, free_bytes: int | None,
                       fraction: float) -> int:
    """Pages for ``max_seqs`` sequences of ``pages_per_seq`` pages, or, without ``max_seqs``,
    what ``fraction`` of the device's ``free_bytes`` holds in pages of ``per_page`` bytes (a device
    that does not report it: ``MAX_SEQS_WITHOUT_MEMORY_STATS`` sequences)."""
    if max_seqs is not None:
        return 1 + max_seqs * pages_per_seq
    if free_bytes is None:
        return 1 + MAX_SEQS_WITHOUT_MEMORY_STATS * pages_per_seq
    return max(1 + pages_per_seq, int(fraction * free_bytes) // per_page)


def _check_pool_fits(num_pages: int, per_page: int, param: str, device: jax.Device, free_bytes: int | None) -> None:
    """ValueError naming ``param`` (what set ``num_pages``) when a pool of ``num_pages`` pages of
    ``per_page`` bytes would not fit in ``device``'s ``free_bytes``, or on a CPU that reports none
    the host's physical memory (a pool that large is refused here, not by the allocator)."""
    if free_bytes is None and device.platform == "cpu":
        free_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if free_bytes is not None and num_pages * per_page > free_bytes:
        raise ValueError(f"Engine: a pool of {num_pages:,} pages ({param}) takes {num_pages * per_page:,} bytes per "
                         f"device, more than the {free_bytes:,} free on {device.platform}:{device.id}; give fewer "
                         f"pages")


def _free_bytes(device: jax.Device) -> int | None:
    """The memory ``device`` reports free (its memory stats' limit less what is in use), or None."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def _first_local_device(mesh: Mesh | None) -> jax.Device:
    """This process's first device of ``mesh`` (or of all devices): the one whose memory it can
    ask about (under ``jax.distributed`` the mesh's first device may be another process's)."""
    if mesh is None:
        return jax.local_devices()[0]
    return next(d for d in mesh.devices.flat if d.process_index == jax.process_index())


def _check_model(model) -> None:
    """ValueError unless ``model`` is an ``nnx.Module`` implementing ``PagedModel`` whose
    ``attention_ops`` are ops of ``jaxattn.backends.OPS``."""
    implements = isinstance(model, PagedModel) and isinstance(model.cfg, ModelConfig)
    if not isinstance(model, nnx.Module) or not implements:
        raise ValueError(f"Engine: model must be an nnx.Module implementing jaxattn.serve.models.base.PagedModel "
                         f"(cfg.vocab_size, attention_ops, init_caches, forward_paged, logits, param_shardings), "
                         f"got {type(model).__name__}")
    ops = model.attention_ops
    if not isinstance(ops, tuple) or not ops or not set(ops) <= set(OPS):
        raise ValueError(f"Engine: model.attention_ops must be a non-empty tuple of ops from {OPS}, got {ops!r}")


def _is_dtype(value) -> bool:
    try:
        jnp.dtype(value)
    except TypeError:
        return False
    return True
