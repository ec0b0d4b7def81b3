"""The engine's host-side scheduling: requests, the page pool's host view, and which tokens each
step computes.

Scheduling (as vLLM's): a request is a list of tokens (prompt, then output) of which the first
``computed`` have K/V in the cache; each step computes one token of each request that has one
left (a decode) and chunks of the others' (prefill), at most ``max_step_tokens`` tokens in all.
Pages are taken as tokens arrive, not reserved: when the pool cannot hold a running request's
next tokens, the latest admitted request is preempted (its pages freed, itself put first in line
to recompute its prompt and output so far; its seeds depend on positions, so its tokens stay the
same). With prefix caching a new request starts on the cached pages of its longest cached prefix
(keys: ``jaxattn.serve.prefix_cache.page_keys``), and always computes at least its last token, for the
logits.

Steps overlap with scheduling: the engine schedules step n+1 while step n runs, so a request's
token sampled in step n is ``pending`` (on the device) when step n+1 is scheduled; step n+1 takes
it as its input on the device, and ``complete(n)`` brings it to the host one step late. A request
that stops in step n has one more row in step n+1, whose token is dropped; a request that reached
``max_new_tokens`` with its pending tokens is not scheduled again.

``PagePool`` mirrors the device page table's pool (``jaxattn.page_table``), so the scheduler
never reads the device to schedule; the table follows the same operations in the step.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import numpy as np

from jaxattn.serve.prefix_cache import page_keys
from jaxattn.serve.sampling import SamplingParams
from jaxattn.serve.structured_output import Grammar


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and the ``SamplingParams.logprobs`` most likely tokens
    of its step, ``(token id, log-probability)`` most likely first (``jaxattn.serve.sampling.token_logprobs``)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(eq=False)
class Request:
    """A request and its state: ``output`` grows as tokens come; ``finish_reason`` is set when it ends."""

    id: int
    prompt: np.ndarray                      # int32[L]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0                           # sampling.seed, or the one the engine drew
    output: list[int] = dataclasses.field(default_factory=list)
    # with sampling.logprobs: one entry per output token
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    # "stop": output ends with a stop token, or completes its grammar; "length": max_new_tokens; "abort": Engine.abort
    finish_reason: str | None = None
    slot: int = -1                          # sequence id in the page table while running
    computed: int = 0                       # tokens (prompt, then output) whose K/V is in the cache
    pending: int = 0                        # tokens sampled on the device, not yet in ``output``
    # while running: its pages in order (a cached page's id, 0 for a private page), the keys of
    # its full prompt pages, and how many of those pages were cached or offered to the cache
    blocks: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)
    registered: int = 0
    # another choice of the same prompt (Engine.add_choices): with prefix caching this request is
    # admitted once that one's full prompt pages are cached, and starts on them
    prefill_after: Request | None = None
    # with sampling.structured_outputs: its grammar, advanced by each output token
    grammar: Grammar | None = None
    # speculation: the drafts of its rows in flight (their kept count is not known yet), and whether
    # the step that sampled its last token proposed its next drafts (a step with a grammar row does not)
    in_flight_drafts: int = 0
    drafts_ready: bool = False
    # benchmarks and tests: the tokens an "oracle" drafter proposes after the prompt (jaxattn.serve.speculative)
    draft_oracle: np.ndarray | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Tokens of the request so far, the pending ones included."""
        return self.prompt.size + len(self.output) + self.pending

    @property
    def num_known(self) -> int:
        """Tokens on the host: the prompt and ``output``."""
        return self.prompt.size + len(self.output)

    @property
    def sampled_all(self) -> bool:
        """Whether its last token (``max_new_tokens``) is sampled, on the host or pending."""
        return len(self.output) + self.pending >= self.max_new_tokens

    @property
    def tokens(self) -> np.ndarray:
        """int32[num_known]: the prompt, then the output so far."""
        return self.tokens_between(0, self.num_known)

    def tokens_between(self, start: int, stop: int) -> np.ndarray:
        """int32[stop - start]: known tokens ``start .. stop - 1`` (``stop <= num_known``)."""
        n = self.prompt.size
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return np.asarray(self.output[start - n:stop - n], np.int32)
        return np.concatenate([self.prompt[start:], np.asarray(self.output[max(start - n, 0):stop - n], np.int32)])

    def _append(self, token: int) -> None:
        self.output.append(token)
        if token in self.sampling.stop_token_ids:
            self.finish_reason = "stop"
        elif self.grammar is not None and self.grammar.accept(token):
            self.finish_reason = "stop"             # the grammar is complete and allows no more
        elif len(self.output) >= self.max_new_tokens:
            self.finish_reason = "length"


class PagePool:
    """Host view of a page table's pool (``num_pages - 1`` usable pages) and its cached prefixes.

    Every usable page is free (``free`` counts them, as the table's ``num_free``), cached and held
    by ``refs[page]`` requests, cached and held by none (``evictable``, least recently used first),
    or held privately by one request (only counted by the requests themselves). Cached pages are
    keyed by ``page_keys``; the device side (``PageTable.mark_cached``, ``attach``, ``evict``)
    follows the same operations a step later or in the same step.
    """

    def __init__(self, num_pages: int):
        self.usable = num_pages - 1
        self.free = num_pages - 1
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.refs: dict[int, int] = {}
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def held(self) -> int:
        """Pages held by requests (private or cached)."""
        return self.usable - self.free - len(self.evictable)

    @property
    def available(self) -> int:
        """Pages an allocation can get: free ones, then evicted ones."""
        return self.free + len(self.evictable)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest cached prefix of ``keys``, now held by the caller (release them)."""
        pages = []
        for key in keys:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
            self.refs[page] += 1
            self.evictable.pop(page, None)
        return pages

    def register(self, key: bytes, page: int) -> bool:
        """Caches the full page ``page``, held by one request, under ``key``; False (nothing
        changes) when another page already holds ``key``."""
        if key in self.page_of:
            return False
        self.page_of[key], self.key_of[page], self.refs[page] = page, key, 1
        return True

    def release(self, blocks: list[int]) -> None:
        """A request lets go of its pages: ``blocks`` in order, cached page ids or 0 for a private
        page (back to the free stack). Cached pages no one holds become evictable, the last page
        of a prefix first (so a shared beginning outlives its tails)."""
        self.free += blocks.count(0)
        for page in reversed(blocks):
            if page:
                self.refs[page] -= 1
                if self.refs[page] == 0:
                    self.evictable[page] = None

    def allocate(self, count: int) -> list[int]:
        """Takes ``count`` pages off the free stack, evicting least recently used cached pages
        first when it is short; returns the evicted pages (for ``PageTable.evict``)."""
        if count > self.available:
            raise RuntimeError(f"PagePool: {count} pages wanted, {self.available} available (scheduler bug)")
        evicted = []
        while self.free < count:
            page, _ = self.evictable.popitem(last=False)
            del self.page_of[self.key_of.pop(page)], self.refs[page]
            evicted.append(page)
            self.free += 1
        self.free -= count
        return evicted


@dataclasses.dataclass(frozen=True)
class Row:
    """One step row: ``count`` tokens of ``request`` from position ``start``; ``samples``: the row
    reaches the request's last token, so the step samples its next one. A speculating row is its
    pending token and ``drafts`` draft tokens (``count = 1 + drafts``), proposed on the device; its
    ``start`` is a lower bound while an earlier row's kept drafts are not known."""

    request: Request
    start: int
    count: int
    samples: bool
    drafts: int = 0


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One step's work, in step order (one-token rows, the decodes, first).

    Attributes:
      rows: the step rows.
      admitted: the requests admitted in this step (they start on their cached pages, if any).
      evicted: cached pages evicted for this step's allocations.
      release: sequence slots to free before the step's allocations (finished or preempted requests).
      mark: pages to mark cached (prompt pages that earlier steps filled).
    """

    rows: list[Row]
    admitted: list[Request]
    evicted: list[int]
    release: list[int]
    mark: list[int]

    @property
    def mixed(self) -> bool:
        """Whether a row computes a prompt chunk (more than one token that are not a token and its drafts)."""
        return any(row.count - row.drafts > 1 for row in self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(row.count for row in self.rows)


@dataclasses.dataclass(frozen=True)
class PageUsage:
    """The pool's pages as the host sees them: ``in_use`` held by live requests, ``free``, and
    ``cached`` (holding a cached prompt prefix, held or not)."""

    in_use: int
    free: int
    cached: int


class Scheduler:
    """Requests waiting and running over ``max_seqs`` sequence slots and a pool of ``num_pages``
    pages of ``page_size`` tokens, at most ``max_step_tokens`` tokens per step (``>= max_seqs``, so
    every decode fits), and at most ``prefill_chunk`` prompt tokens of one request per step
    (default: ``max_step_tokens``) in at most ``max_prefill_seqs`` prompt chunks of more than one
    token (default: any number; requests past them wait for the next step).

    With ``draft_tokens`` K > 0 (speculation, ``jaxattn.serve.speculative``), a decode row carries K
    drafts when the request can take them (``_can_speculate``) and the step's token budget has
    room. The host learns how many drafts a row kept one step late, so it counts a speculating
    row as one token (``computed`` is then a lower bound, raised when the row completes) and
    holds pages for the drafts of the rows in flight too (the device cuts a sequence back to its
    kept tokens, so it never holds more pages than the host counts; ``seq_capacity``, the tokens
    a sequence may reach on the device, bounds the rows). ``draft_scratch``: tokens a row that
    samples may write past its own in the step (a draft model's drafts), counted in its pages.

    ``stats`` counts prompt tokens, cached tokens (prompt tokens a request found in the cache when
    admitted, again when re-admitted after a preemption), computed tokens (all tokens the steps
    ran), evicted pages and preemptions.
    """

    def __init__(self, *, max_seqs: int, num_pages: int, page_size: int, max_step_tokens: int,
                 enable_prefix_caching: bool, prefill_chunk: int | None = None, draft_tokens: int = 0,
                 seq_capacity: int | None = None, draft_scratch: int = 0, max_prefill_seqs: int | None = None):
        if max_step_tokens < max_seqs:
            raise ValueError(f"Scheduler: max_step_tokens must be >= max_seqs={max_seqs} (every decode fits in a "
                             f"step), got {max_step_tokens}")
        self.page_size, self.max_step_tokens = page_size, max_step_tokens
        self.prefill_chunk = prefill_chunk or max_step_tokens
        self.max_prefill_seqs = max_prefill_seqs or max_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self.draft_tokens, self.seq_capacity, self.draft_scratch = draft_tokens, seq_capacity, draft_scratch
        self.pool = PagePool(num_pages)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []             # in order of admission
        self.stats: collections.Counter[str] = collections.Counter()
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self.to_release: list[int] = []               # slots the next step frees
        self.to_mark: list[int] = []                  # pages the next step marks cached

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def page_usage(self) -> PageUsage:
        return PageUsage(self.pool.held, self.pool.free, len(self.pool.page_of))

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.stats["prompt_tokens"] += request.prompt.size

    def abort(self, request: Request) -> None:
        """Ends ``request`` (waiting or running; a finished one stays as it is): its slot and pages
        are freed in the next step, a token it has in flight is dropped."""
        if request.done:
            return
        if request in self.running:
            self._finish(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.finish_reason = "abort"

    def _new_pages(self, request: Request, count: int, drafts: int = 0) -> int:
        """Pages ``request`` needs to compute ``count`` more tokens (``drafts`` of them drafts),
        after the drafts in flight (and the draft scratch of a row that samples)."""
        samples = request.computed + count - drafts == request.num_tokens
        extent = request.computed + request.in_flight_drafts + count + (self.draft_scratch if samples else 0)
        return -(-extent // self.page_size) - len(request.blocks)

    def _can_speculate(self, request: Request) -> bool:
        """Whether a decode of ``request`` may carry drafts: its drafts were proposed, it has no
        grammar, asks for no logprobs, holds no stop token back, and its drafts fit its sequence."""
        k = self.draft_tokens
        return (k > 0 and request.drafts_ready and request.grammar is None and request.sampling.logprobs is None
                and len(request.output) + request.pending >= request.sampling.min_tokens
                and request.computed + request.in_flight_drafts + k + 1 + self.draft_scratch <= self.seq_capacity)

    def schedule(self) -> Schedule | None:
        """This step's work (None: nothing to compute, free or cache). A request whose last token
        is in flight leaves its slot and pages now (unless it has prompt pages to cache when its
        step completes). Running requests come first, in order of admission: when the pool cannot
        hold one's next tokens, the latest admitted request is preempted (it may be this one). New
        requests are admitted only when no one was preempted, while slots, the token budget and
        pages last, in order (a choice waiting for its first choice's prompt pages lets the ones
        behind it by). Decodes always fit: the budget they leave goes to prefill chunks."""
        def todo(request: Request) -> int:
            return 0 if request.sampled_all else request.num_tokens - request.computed

        for request in list(self.running):
            if request.sampled_all and self._registered_all(request):
                self._finish(request)                 # its last token is in flight: free its slot now
        rows: list[tuple[Request, int, int, int]] = []          # (request, tokens, drafts, new pages)
        budget = self.max_step_tokens - sum(todo(r) == 1 for r in self.running)
        need, preempted = 0, False
        chunks = 0                                   # rows of more than one prompt token
        for request in list(self.running):
            if request.slot < 0:                     # preempted by an earlier row
                break
            left = todo(request)
            count = left if left <= 1 else min(left, budget, self.prefill_chunk)
            if count > 1 and chunks == self.max_prefill_seqs:
                continue
            chunks += count > 1
            if count == 0:
                continue
            drafts = self.draft_tokens if left == 1 and budget >= self.draft_tokens and \
                self._can_speculate(request) else 0
            count += drafts
            pages = self._new_pages(request, count, drafts)
            while pages > self.pool.available - need:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.slot < 0:
                break
            rows.append((request, count, drafts, pages))
            need += pages
            budget -= count if left > 1 else drafts
        admitted, held_back = [], []
        while not preempted and self.waiting and self._free_slots and budget > 0:
            request = self.waiting[0]
            if self._waits_for_prefill(request):
                held_back.append(self.waiting.popleft())
                continue
            keys = page_keys(request.tokens, self.page_size) if self.enable_prefix_caching else []
            # at least the last token is computed, for its logits
            request.blocks = self.pool.lookup(keys[:(request.num_tokens - 1) // self.page_size])
            request.computed = len(request.blocks) * self.page_size
            count = min(request.num_tokens - request.computed, budget, self.prefill_chunk)
            if count > 1 and chunks == self.max_prefill_seqs:
                break
            chunks += count > 1
            pages = self._new_pages(request, count)
            if pages > self.pool.available - need:
                self.pool.release(request.blocks)
                request.blocks, request.computed = [], 0
                break
            self.waiting.popleft()
            request.slot, request.keys, request.registered = self._free_slots.pop(), keys, len(request.blocks)
            self.running.append(request)
            admitted.append(request)
            rows.append((request, count, 0, pages))
            need += pages
            budget -= count
            self.stats["cached_tokens"] += min(request.computed, request.prompt.size)
        self.waiting.extendleft(reversed(held_back))
        if not rows and not (self.to_release or self.to_mark):
            return None
        # a row under a grammar that samples defers the step's picks, which verify no drafts
        deferred = any(r.grammar is not None and r.computed + count - drafts == r.num_tokens
                       for r, count, drafts, _ in rows)
        if deferred and any(drafts for _, _, drafts, _ in rows):
            rows = [(r, count - drafts, 0, self._new_pages(r, count - drafts)) for r, count, drafts, _ in rows]
            need = sum(pages for *_, pages in rows)
        evicted = self.pool.allocate(need)
        self.stats["evicted_pages"] += len(evicted)
        step_rows = []
        # one-token rows (decodes) first, then decodes with drafts, then prompt chunks
        for request, count, drafts, pages in sorted(rows, key=lambda row: (row[1] - row[2] > 1, row[2] > 0)):
            request.blocks += [0] * pages
            start = request.computed
            request.computed += count - drafts
            samples = request.computed == request.num_tokens
            request.pending += samples
            request.in_flight_drafts += drafts
            if samples:
                request.drafts_ready = not deferred
            step_rows.append(Row(request, start, count, samples, drafts))
            self.stats["computed_tokens"] += count
        schedule = Schedule(step_rows, admitted, evicted, self.to_release, self.to_mark)
        self.to_release, self.to_mark = [], []
        return schedule

    def _waits_for_prefill(self, request: Request) -> bool:
        """Whether ``request`` waits for its ``prefill_after`` choice (with prefix caching, until
        the full prompt pages it can reuse are cached; not once that choice ended)."""
        first = request.prefill_after
        if first is None or first.done or not self.enable_prefix_caching:
            return False
        return first.slot < 0 or first.registered < (first.prompt.size - 1) // self.page_size

    def _registered_all(self, request: Request) -> bool:
        """Whether every full prompt page ``request`` has computed is cached or was offered."""
        full = min(request.computed, len(request.keys) * self.page_size) // self.page_size
        return not self.enable_prefix_caching or request.registered >= full

    def _preempt(self, request: Request) -> None:
        """Frees ``request``'s pages and puts it first in line: it recomputes its prompt and
        output so far (its sampling seeds depend on positions only, so its tokens do not change).
        A token it has pending reaches ``output`` before it is admitted again (``complete`` of the
        step in flight comes before the next schedule)."""
        self._finish(request)
        request.computed = 0
        self.waiting.appendleft(request)
        self.stats["preemptions"] += 1

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        self._free_slots.append(request.slot)
        self.to_release.append(request.slot)
        self.pool.release(request.blocks)
        request.blocks, request.slot = [], -1

    def complete(self, schedule: Schedule, next_tokens: np.ndarray, pages: Callable[[], np.ndarray],
                 logprobs: Callable[[], tuple[np.ndarray, ...]] | None = None,
                 drafts: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None) -> list[tuple[Request, list[int]]]:
        """Applies the step that ran ``schedule``: ``next_tokens`` (int32[>= rows], per step row)
        are appended to the requests of the rows that sampled (dropped for requests that ended
        meanwhile), finished requests released, and (with prefix caching) the prompt pages the
        step filled cached, their ids read from ``pages()`` (int32[rows, W]: per row, the page
        ids from the one holding its first token on; read only when needed). ``logprobs()``
        (``sampling.token_logprobs``' arrays, per row) gives the entries of requests that ask
        for them; ``drafts()`` (``speculative.verify_drafts``' tokens int32[rows, K + 1] and
        accepted int32[rows]) the tokens of speculating rows, their kept drafts then the model's
        token (those past a stop token or ``max_new_tokens`` are dropped). Returns ``(request,
        new tokens)`` of each request that got some."""
        if self.enable_prefix_caching:
            self._register(schedule.rows, pages)
        events = []
        step_logprobs = step_drafts = None           # read once, if a row needs them
        for i, row in enumerate(schedule.rows):
            r = row.request
            if not row.samples:
                continue
            r.pending -= 1
            r.in_flight_drafts -= row.drafts
            if r.done:                               # stopped or aborted while this row ran
                continue
            new = [int(next_tokens[i])]
            if row.drafts:
                if step_drafts is None:
                    step_drafts = drafts()
                kept = int(step_drafts[1][i])
                new = step_drafts[0][i, :kept + 1].tolist()
                if r.slot >= 0:                      # else preempted while this row ran: it recomputes
                    r.computed += kept
            if r.sampling.logprobs is not None:
                if step_logprobs is None:
                    step_logprobs = logprobs()
                chosen, top_ids, top_logprobs = step_logprobs
                top = zip(top_ids[i, :r.sampling.logprobs].tolist(), top_logprobs[i, :r.sampling.logprobs].tolist())
                r.logprobs.append(TokenLogprobs(float(chosen[i]), tuple(top)))
            appended = len(r.output)
            for token in new:
                r._append(token)
                if r.done:
                    break
            events.append((r, r.output[appended:]))
            if r.done:
                if r.slot >= 0:                      # running
                    self._finish(r)
                elif r in self.waiting:              # preempted while this row ran
                    self.waiting.remove(r)
        return events

    def _register(self, rows: list[Row], pages: Callable[[], np.ndarray]) -> None:
        """Caches the prompt pages that this step filled (marked on the device in the next step
        scheduled). Rows of requests no longer running (preempted or finished meanwhile) are
        skipped: their pages are freed."""
        new = []
        for i, row in enumerate(rows):
            request = row.request
            if request.slot < 0:
                continue
            full = min(row.start + row.count, len(request.keys) * self.page_size) // self.page_size
            new += [(request, i, row.start // self.page_size, p) for p in range(request.registered, full)]
            request.registered = max(request.registered, full)
        if not new:
            return
        step_pages = pages()
        for request, i, first, p in new:
            page = int(step_pages[i, p - first])
            if self.pool.register(request.keys[p], page):   # else another request cached it first
                request.blocks[p] = page
                self.to_mark.append(page)
