"""The engine's host-side scheduling: the page pool's lookup, release and LRU eviction, and the
scheduler's rows, admission and preemption (no model, no device)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxattn.serve.prefix_cache import page_keys
from jaxattn.serve.scheduler import PagePool, Request, Row, Scheduler


def test_lookup_release_and_lru_eviction():
    pool = PagePool(num_pages=8)                                  # 7 usable pages
    a, b = page_keys(np.arange(12), 4), page_keys(np.arange(100, 108), 4)
    assert pool.allocate(3) == [] and pool.free == 4
    assert [pool.register(k, p) for k, p in zip(a, (1, 2, 3))] == [True] * 3
    assert pool.lookup(a[:2]) == [1, 2] and pool.refs == {1: 2, 2: 2, 3: 1}
    assert pool.allocate(1) == [] and pool.free == 3               # the second request's own page
    assert not pool.register(a[0], 4), "a prefix is cached once"
    pool.release([1, 2, 3])                                        # the first request ends
    assert pool.refs == {1: 1, 2: 1, 3: 0} and list(pool.evictable) == [3]
    pool.release([1, 2, 0])                                        # the second: its private page is freed
    assert pool.free == 4 and list(pool.evictable) == [3, 2, 1], "a prefix's tail goes first"
    assert pool.available == 7
    assert pool.allocate(6) == [3, 2] and pool.free == 0
    assert pool.lookup(a) == [1] and pool.lookup(b) == [] and not pool.evictable
    with pytest.raises(RuntimeError, match="2 pages wanted, 0 available"):
        pool.allocate(2)


def _scheduler(num_pages: int, enable_prefix_caching: bool = False, max_step_tokens: int = 8) -> Scheduler:
    return Scheduler(max_seqs=3, num_pages=num_pages, page_size=4, max_step_tokens=max_step_tokens,
                     enable_prefix_caching=enable_prefix_caching)


def _add(scheduler: Scheduler, id: int, prompt_len: int, max_new_tokens: int = 4) -> Request:
    request = Request(id, np.arange(prompt_len, dtype=np.int32), max_new_tokens)
    scheduler.add(request)
    return request


def _run(scheduler: Scheduler, token: int = 7) -> list[tuple[Request, int]]:
    """Schedules a step and completes it as if every row sampled ``token``; returns its rows."""
    schedule = scheduler.schedule()
    scheduler.complete(schedule, np.full(3, token, np.int32), pages=lambda: pytest.fail("no prefix caching"))
    return [(row.request.id, row.count) for row in schedule.rows]


def test_chunked_prefill_beside_decodes_decodes_first():
    """Prompts of 10 and 5 tokens, 8 tokens a step: the first is prefilled over two steps, the second
    joins when budget is left; one-token rows (decodes) come first in a step."""
    scheduler = _scheduler(num_pages=16)
    a, b = _add(scheduler, 0, 10), _add(scheduler, 1, 5)
    assert _run(scheduler) == [(0, 8)]
    assert _run(scheduler) == [(0, 2), (1, 5)]
    assert a.output == b.output == [7]
    assert _run(scheduler) == [(0, 1), (1, 1)]
    assert scheduler.stats["computed_tokens"] == 17 and scheduler.stats["prompt_tokens"] == 15


def test_max_prefill_seqs_bounds_a_steps_prompt_chunks():
    """At most one prompt chunk of more than one token a step: the second prompt waits, and a
    one-token prompt row is not a chunk; decodes are not held back."""
    scheduler = Scheduler(max_seqs=3, num_pages=16, page_size=4, max_step_tokens=8, enable_prefix_caching=False,
                          max_prefill_seqs=1)
    _add(scheduler, 0, 3), _add(scheduler, 1, 2), _add(scheduler, 2, 1)
    assert _run(scheduler) == [(0, 3)]
    assert _run(scheduler) == [(0, 1), (2, 1), (1, 2)]
    assert _run(scheduler) == [(0, 1), (1, 1), (2, 1)]


def test_a_short_pool_preempts_the_latest_admitted_request():
    """5 usable pages of 4 tokens: two requests of 8-token prompts hold 5 pages after their first
    decode; when the later one needs a sixth, it is preempted (pages freed, first in line), and it
    recomputes its prompt and output so far when pages are free again."""
    scheduler = _scheduler(num_pages=6, max_step_tokens=9)
    a = _add(scheduler, 0, 8, max_new_tokens=6)
    assert _run(scheduler) == [(0, 8)]
    b = _add(scheduler, 1, 8, max_new_tokens=6)
    assert _run(scheduler) == [(0, 1), (1, 8)]
    assert scheduler.pool.free == 0
    assert _run(scheduler) == [(0, 1)]
    assert scheduler.stats["preemptions"] == 1 and scheduler.waiting[0] is b and b.computed == 0
    assert b.output == [7] and scheduler.pool.free == 2
    assert _run(scheduler) == [(0, 1), (1, 8)]                 # b's prompt and output so far: 9 tokens
    while scheduler.has_work:
        _run(scheduler)
    assert a.output == b.output == [7] * 6 and a.finish_reason == b.finish_reason == "length"
    assert scheduler.pool.free == 5 and not scheduler.running


def test_prefix_caching_admits_a_request_on_cached_pages():
    """A finished request's full prompt pages are cached (their ids read from the step's page
    window); a request with the same first 8 tokens starts on them."""
    scheduler = _scheduler(num_pages=8, enable_prefix_caching=True)
    first = _add(scheduler, 0, 8, max_new_tokens=1)
    schedule = scheduler.schedule()
    pages = np.asarray([[3, 4, 0]])
    scheduler.complete(schedule, np.full(3, 7, np.int32), pages=lambda: pages)
    assert first.done and scheduler.to_mark == [3, 4]
    assert set(scheduler.pool.key_of) == {3, 4} and list(scheduler.pool.evictable) == [4, 3]   # the tail first
    second = _add(scheduler, 1, 12)
    schedule = scheduler.schedule()
    assert schedule.admitted == [second] and second.blocks[:2] == [3, 4] and second.computed == 12
    assert schedule.rows == [Row(second, 8, 4, True)] and schedule.mark == [3, 4] and schedule.release == [0]
    assert scheduler.stats["cached_tokens"] == 8
