"""The engine's host-side scheduling: requests, the page pool's host view, and which tokens each
step computes.

Scheduling (as vLLM's): a request is a list of tokens (prompt, then output) of which the first
``computed`` have K/V in the cache; each step computes one token of each request that has one
left (a decode) and a chunk of the others' (prefill) within ``chunk_size`` tokens. Pages are
taken as tokens arrive, not reserved: when the pool cannot hold a running request's next tokens,
the latest admitted request is preempted (its pages freed, itself put first in line to recompute
its prompt and output so far; its seeds depend on positions, so its tokens stay the same). With
prefix caching a new request starts on the cached pages of its longest cached prefix (keys:
``jaxattn.prefix_cache.page_keys``), and always computes at least its last token, for the logits.

``PagePool`` mirrors the device page table's pool (``jaxattn.page_table``), so the scheduler
never reads the device to schedule; the table follows the same operations in the step.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import numpy as np

from jaxattn.prefix_cache import page_keys
from jaxattn.sampling import SamplingParams


@dataclasses.dataclass(eq=False)
class Request:
    """A request and its state: ``output`` grows as tokens come; ``finish_reason`` is set when it ends."""

    id: int
    prompt: np.ndarray                      # int32[L]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0                           # sampling.seed, or the one the engine drew
    output: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None        # "stop": output ends with a stop token; "length": max_new_tokens
    slot: int = -1                          # sequence id in the page table while running
    computed: int = 0                       # tokens (prompt, then output) whose K/V is in the cache
    # while running: its pages in order (a cached page's id, 0 for a private page), the keys of
    # its full prompt pages, and how many of those pages were cached or offered to the cache
    blocks: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)
    registered: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return self.prompt.size + len(self.output)

    @property
    def tokens(self) -> np.ndarray:
        """int32[num_tokens]: the prompt, then the output so far."""
        return self.tokens_between(0, self.num_tokens)

    def tokens_between(self, start: int, stop: int) -> np.ndarray:
        n = self.prompt.size
        if stop <= n:
            return self.prompt[start:stop]
        return np.concatenate([self.prompt[start:], np.asarray(self.output[max(start - n, 0):stop - n], np.int32)])

    def _append(self, token: int) -> None:
        self.output.append(token)
        if token in self.sampling.stop_token_ids:
            self.finish_reason = "stop"
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
        self.free = num_pages - 1
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.refs: dict[int, int] = {}
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

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
class Schedule:
    """One step's work, in step order (one-token rows, the decodes, first).

    Attributes:
      rows: ``(request, tokens to compute)`` per step row.
      admitted: the requests admitted in this step (they start on their cached pages, if any).
      evicted: cached pages evicted for this step's allocations.
      release: sequence slots to free before the step's allocations (finished or preempted requests).
      mark: pages to mark cached (prompt pages filled in the previous step).
    """

    rows: list[tuple[Request, int]]
    admitted: list[Request]
    evicted: list[int]
    release: list[int]
    mark: list[int]

    @property
    def mixed(self) -> bool:
        """Whether a row computes more than one token (a prefill chunk)."""
        return any(count > 1 for _, count in self.rows)


class Scheduler:
    """Requests waiting and running over ``max_seqs`` sequence slots and a pool of ``num_pages``
    pages of ``page_size`` tokens, at most ``chunk_size`` prefill tokens per step.

    ``stats`` counts prompt tokens, cached tokens (prompt tokens a request found in the cache when
    admitted, again when re-admitted after a preemption), computed tokens (all tokens the steps
    ran), evicted pages and preemptions.
    """

    def __init__(self, *, max_seqs: int, num_pages: int, page_size: int, chunk_size: int,
                 enable_prefix_caching: bool):
        self.page_size, self.chunk_size, self.enable_prefix_caching = page_size, chunk_size, enable_prefix_caching
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

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.stats["prompt_tokens"] += request.prompt.size

    def _new_pages(self, request: Request, count: int) -> int:
        """Pages ``request`` needs to compute ``count`` more tokens."""
        return -(-(request.computed + count) // self.page_size) - len(request.blocks)

    def schedule(self) -> Schedule:
        """This step's work. Running requests come first, in order of admission: when the pool
        cannot hold one's next tokens, the latest admitted request is preempted (it may be this
        one). New requests are admitted only when no one was preempted, while slots, prefill
        budget and pages last."""
        rows: list[tuple[Request, int]] = []
        budget, need = self.chunk_size, 0
        preempted = False
        for request in list(self.running):
            if request not in self.running:          # preempted by an earlier row
                break
            todo = request.num_tokens - request.computed
            count = 1 if todo == 1 else min(todo, budget)
            if count == 0:
                continue
            while self._new_pages(request, count) > self.pool.available - need:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request not in self.running:
                break
            rows.append((request, count))
            need += self._new_pages(request, count)
            budget -= count if todo > 1 else 0
        admitted = []
        while not preempted and self.waiting and self._free_slots and budget > 0:
            request = self.waiting[0]
            keys = page_keys(request.tokens, self.page_size) if self.enable_prefix_caching else []
            # at least the last token is computed, for its logits
            request.blocks = self.pool.lookup(keys[:(request.num_tokens - 1) // self.page_size])
            request.computed = len(request.blocks) * self.page_size
            count = min(request.num_tokens - request.computed, budget)
            if self._new_pages(request, count) > self.pool.available - need:
                self.pool.release(request.blocks)
                request.blocks, request.computed = [], 0
                break
            self.waiting.popleft()
            request.slot, request.keys, request.registered = self._free_slots.pop(), keys, len(request.blocks)
            self.running.append(request)
            admitted.append(request)
            rows.append((request, count))
            need += self._new_pages(request, count)
            budget -= count
            self.stats["cached_tokens"] += min(request.computed, request.prompt.size)
        evicted = self.pool.allocate(need)
        self.stats["evicted_pages"] += len(evicted)
        for request, count in rows:
            request.blocks += [0] * self._new_pages(request, count)
        rows.sort(key=lambda row: row[1] > 1)        # one-token rows (decodes) first
        schedule = Schedule(rows, admitted, evicted, self.to_release, self.to_mark)
        self.to_release, self.to_mark = [], []
        return schedule

    def _preempt(self, request: Request) -> None:
        """Frees ``request``'s pages and puts it first in line: it recomputes its prompt and
        output so far (its sampling seeds depend on positions only, so its tokens do not change)."""
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

    def complete(self, schedule: Schedule, next_tokens: np.ndarray,
                 block_tables: Callable[[], np.ndarray]) -> list[tuple[Request, list[int]]]:
        """Applies a step that ran ``schedule``: its rows' tokens are computed, ``next_tokens``
        (int32[B], per step row) appended to the requests that reached their end, finished
        requests released, and (with prefix caching) the prompt pages the step filled cached,
        their ids read from ``block_tables()`` (the device table's ``[max_seqs, P]``, read only
        when needed). Returns ``(request, new tokens)`` of each request that got some."""
        for r, count in schedule.rows:
            r.computed += count
            self.stats["computed_tokens"] += count
        if self.enable_prefix_caching:
            self._register(schedule.rows, block_tables)
        events = []
        for i, (r, count) in enumerate(schedule.rows):
            if r.computed < r.num_tokens:            # a prefill chunk before the last
                continue
            r._append(int(next_tokens[i]))
            events.append((r, r.output[-1:]))
            if r.done:
                self._finish(r)
        return events

    def _register(self, rows: list[tuple[Request, int]], block_tables: Callable[[], np.ndarray]) -> None:
        """Caches the prompt pages that this step filled (marked on the device in the next step)."""
        new = []
        for request, _ in rows:
            full = min(request.computed, len(request.keys) * self.page_size) // self.page_size
            new += [(request, i) for i in range(request.registered, full)]
            request.registered = max(request.registered, full)
        if not new:
            return
        tables = block_tables()
        for request, i in new:
            page = int(tables[request.slot, i])
            if self.pool.register(request.keys[i], page):   # else another request cached it first
                request.blocks[i] = page
                self.to_mark.append(page)
