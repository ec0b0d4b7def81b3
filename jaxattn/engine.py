"""A small continuous-batching generation engine over a paged KV cache.

The host loop admits requests, schedules chunked prefill and decodes, and releases finished
sequences. Each step is one jitted function of (model state, donated KV caches, donated page
table) that frees finished sequences, allocates pages, writes K/V and runs attention in every
layer. Only two step shapes exist (decode-only, and mixed decode + prefill chunk), so a serving
loop compiles twice and then replays.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxattn
from jaxattn.models.llama import Llama, forward_paged
from jaxattn.sampling import SamplingBatch, SamplingParams, sample


@dataclasses.dataclass
class Request:
    id: int
    prompt: np.ndarray                      # int32[L]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0                           # sampling.seed, or the one the engine drew
    output: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None        # "stop": output ends with a stop token; "length": max_new_tokens
    slot: int = -1                          # sequence id in the page table while running
    prefilled: int = 0                      # prompt tokens already in the cache

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def _append(self, token: int) -> None:
        self.output.append(token)
        if token in self.sampling.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.max_new_tokens:
            self.finish_reason = "length"


StepFn = Callable[..., tuple[jax.Array, jax.Array, list[jaxattn.KVCache], jaxattn.PageTable]]


def make_engine_step(model: Llama) -> tuple[StepFn, list[jax.Array]]:
    """The jitted engine step for ``model``, and the model's weights as the flat list it takes.

    ``step(weights, caches, table, release_ids, tokens, seq_ids, q_lens, sampling=None, *,
    max_q_len, backend)`` frees ``release_ids``, appends ``q_lens`` tokens to sequences ``seq_ids``
    (int32[B], decodes first, -1 padding; ``tokens`` int32[T] packed) and returns (next token per
    row int32[B], ok bool[B], caches, table); caches and table are donated. Rows sample with
    ``sampling`` (a ``SamplingBatch``; None: greedy). The model's structure is
    closed over rather than passed, so a call neither hashes it nor flattens its state: that cut
    the host time of an 8-layer step from 2.4 to 0.6 ms (measured on CPU).
    """
    graphdef, state = nnx.split(model)
    weights, treedef = jax.tree.flatten(state)
    return _jitted_step(graphdef, treedef), weights


@functools.cache
def _jitted_step(graphdef: nnx.GraphDef, treedef) -> StepFn:
    """One jitted step per model structure, shared by engines (and their compile caches)."""

    @functools.partial(jax.jit, static_argnames=("max_q_len", "backend"), donate_argnames=("caches", "table"))
    def step(weights, caches, table, release_ids, tokens, seq_ids, q_lens, sampling=None, *, max_q_len: int,
             backend: str):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
        table = table.release(release_ids)
        table, ok = table.extend(seq_ids, table.seq_lens[jnp.maximum(seq_ids, 0)] + q_lens)
        seq_ids = jnp.where(ok, seq_ids, -1)        # refused: its tokens stay in place as padding
        meta = table.metadata(seq_ids, q_lens, max_q_len=max_q_len)
        slots = table.slot_mapping(seq_ids, q_lens, tokens.shape[0])
        hidden, caches = forward_paged(model, tokens, caches, meta, slots, backend)
        last = jnp.maximum(meta.cu_q_lens[1:] - 1, 0)
        logits = model.logits(hidden[last])
        if sampling is None:
            next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:   # the sampled token's position seeds its random numbers
            next_tokens = sample(logits, sampling, meta.kv_lens)
        return next_tokens, ok, caches, table

    return step


class Engine:
    """Generation for many requests with a fixed number of sequence slots (greedy unless a
    request's ``SamplingParams`` say otherwise).

    Args:
      model: the decoder.
      max_seqs: sequences in flight (the static batch B).
      max_seq_len: longest prompt + generation a request may have.
      page_size, layout, kv_dtype: KV cache shape; ``num_pages`` defaults to enough for
        ``max_seqs`` sequences of ``max_seq_len``.
      chunk_size: prompt tokens per step (the mixed step has ``max_seqs + chunk_size`` tokens).
      backend: ``paged_attention`` backend.
    """

    def __init__(self, model: Llama, *, max_seqs: int, max_seq_len: int, page_size: int = 16,
                 num_pages: int | None = None, chunk_size: int = 256, backend: str = "auto",
                 layout: str = "HND", kv_dtype=None):
        if chunk_size < 1 or max_seqs < 1 or max_seq_len < 1:
            raise ValueError("Engine: chunk_size, max_seqs and max_seq_len must be >= 1")
        self.model = model
        self._step, self._weights = make_engine_step(model)
        self.max_seqs, self.max_seq_len, self.chunk_size, self.backend = max_seqs, max_seq_len, chunk_size, backend
        self.page_size = page_size
        pages_per_seq = -(-max_seq_len // page_size)
        num_pages = num_pages or 1 + max_seqs * pages_per_seq
        self.caches = model.init_caches(num_pages, page_size, layout, kv_dtype)
        self.table = jaxattn.PageTable.create(num_pages, max_seqs, pages_per_seq, page_size)
        self._unreserved_pages = num_pages - 1     # host view: pages not promised to a running request
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._to_release: list[int] = []
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._next_id = 0
        self._seeds = np.random.default_rng()

    def add_request(self, prompt, max_new_tokens: int, *, sampling: SamplingParams | None = None) -> Request:
        """Queues a request for up to ``max_new_tokens`` tokens after ``prompt`` (token ids), picked
        as ``sampling`` says (default: greedy; its ``stop_token_ids`` end the request early)."""
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        if not 1 <= prompt.size or prompt.size + max_new_tokens > self.max_seq_len or max_new_tokens < 1:
            raise ValueError(f"Engine.add_request: need a non-empty prompt, max_new_tokens >= 1 and "
                             f"len(prompt) + max_new_tokens <= max_seq_len={self.max_seq_len}, "
                             f"got {prompt.size} + {max_new_tokens}")
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"Engine.add_request: sampling must be a SamplingParams, got {type(sampling).__name__}")
        seed = int(self._seeds.integers(2**32)) if sampling.seed is None else sampling.seed
        request = Request(self._next_id, prompt, max_new_tokens, sampling, seed)
        self._next_id += 1
        self.waiting.append(request)
        return request

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages(self, request: Request) -> int:
        return -(-(request.prompt.size + request.max_new_tokens) // self.page_size)

    def _admit(self) -> None:
        while self.waiting and self._free_slots and self._pages(self.waiting[0]) <= self._unreserved_pages:
            request = self.waiting.popleft()
            request.slot = self._free_slots.pop()
            self._unreserved_pages -= self._pages(request)
            self.running.append(request)

    def step(self) -> list[Request]:
        """Runs one engine step; returns the requests that finished in it."""
        return [r for r, _ in self._step_tokens() if r.done]

    def stream(self) -> Iterator[tuple[Request, list[int]]]:
        """Steps until every request is done (including requests added meanwhile), yielding
        ``(request, new_tokens)`` for each request that got tokens, step by step; the last yield of
        a request has ``request.done`` set."""
        while self.has_work:
            yield from self._step_tokens()

    def _step_tokens(self) -> list[tuple[Request, list[int]]]:
        """One engine step -> the new tokens of each request that got some."""
        self._admit()
        decodes = [r for r in self.running if r.prefilled == r.prompt.size]
        rows = [(r, [r.output[-1]]) for r in decodes]
        budget = self.chunk_size
        for r in self.running:
            if r.prefilled < r.prompt.size and budget > 0:
                chunk = r.prompt[r.prefilled:r.prefilled + budget]
                rows.append((r, chunk.tolist()))
                budget -= len(chunk)
        mixed = len(rows) > len(decodes)
        num_tokens = self.max_seqs + self.chunk_size if mixed else self.max_seqs
        tokens = np.zeros(num_tokens, np.int32)
        seq_ids = np.full(self.max_seqs, -1, np.int32)
        q_lens = np.zeros(self.max_seqs, np.int32)
        release = np.full(self.max_seqs, -1, np.int32)
        release[: len(self._to_release)] = self._to_release
        offset = 0
        for i, (r, toks) in enumerate(rows):
            seq_ids[i], q_lens[i] = r.slot, len(toks)
            tokens[offset:offset + len(toks)] = toks
            offset += len(toks)
        padding = [None] * (self.max_seqs - len(rows))
        sampling = SamplingBatch.from_params([r.sampling for r, _ in rows] + padding,
                                             [r.seed for r, _ in rows] + [0] * len(padding))
        next_tokens, ok, self.caches, self.table = self._step(
            self._weights, self.caches, self.table, jnp.asarray(release), jnp.asarray(tokens),
            jnp.asarray(seq_ids), jnp.asarray(q_lens), sampling, max_q_len=self.chunk_size if mixed else 1,
            backend=self.backend)
        self._to_release = []
        next_tokens, ok = np.asarray(next_tokens), np.asarray(ok)
        if not ok[: len(rows)].all():
            raise RuntimeError("Engine: page allocation failed for a reserved request (allocator bug)")
        events = []
        for i, (r, toks) in enumerate(rows):
            if r.prefilled < r.prompt.size:
                r.prefilled += len(toks)
                if r.prefilled < r.prompt.size:
                    continue
            r._append(int(next_tokens[i]))
            events.append((r, r.output[-1:]))
            if r.done:
                self.running.remove(r)
                self._free_slots.append(r.slot)
                self._to_release.append(r.slot)
                self._unreserved_pages += self._pages(r)
        return events

    def run(self, on_step: Callable[[int, int], None] | None = None) -> list[Request]:
        """Steps until every request is done; ``on_step(done, total)`` after each step."""
        total = len(self.waiting) + len(self.running)
        done: list[Request] = []
        while self.has_work:
            done += self.step()
            if on_step:
                on_step(len(done), total)
        return sorted(done, key=lambda r: r.id)


def progress_bar(width: int = 30) -> Callable[[int, int], None]:
    """A one-line progress bar on stderr: requests done / total, elapsed time."""
    start = time.perf_counter()
    interactive = sys.stderr.isatty()

    def show(done: int, total: int) -> None:
        if not interactive and done < total:
            return
        filled = width * done // max(total, 1)
        sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests "
                         f"{time.perf_counter() - start:6.1f}s")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show
