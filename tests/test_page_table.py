"""PageTable: invariants under random extend/release/fork/truncate sequences (hypothesis), KV
contents through slot_mapping + KVCache.write, step metadata, scrub, rolling back an invalid
sequence, and argument errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxattn
from jaxattn import KVCache, MLACache, PageTable
from tests.paged_inputs import ALLCLOSE

NUM_PAGES, MAX_SEQS, MAX_PAGES, PAGE = 24, 6, 5, 4
N = 3          # requests per call (static)
MAX_NEW = 6    # tokens per extend request


def check_invariants(table: PageTable) -> None:
    """Free, held and cached-unheld pages partition pages 1.., refcounts count block-table
    entries, the null page is never handed out or cached, and a writable page is neither shared
    nor cached."""
    tables = np.asarray(table.block_tables)
    lens = np.asarray(table.seq_lens)
    refcount = np.asarray(table.refcount)
    cached = np.asarray(table.cached)
    num_free = int(table.num_free)
    free = np.asarray(table.free_pages)[:num_free]
    assert len(set(free.tolist())) == num_free, "free stack has duplicates"
    assert 0 not in free and refcount[0] == 0 and not cached[0], "the null page was handed out"
    counts = np.zeros(NUM_PAGES, np.int64)
    for s in range(MAX_SEQS):
        n = -(-lens[s] // PAGE)
        assert (tables[s, :n] > 0).all() and (tables[s, n:] == 0).all(), f"row {s} does not match its length"
        counts += np.bincount(tables[s, :n], minlength=NUM_PAGES)
        if lens[s] % PAGE:
            last = tables[s, n - 1]
            assert refcount[last] == 1 and not cached[last], "a partial (writable) page is shared or cached"
    np.testing.assert_array_equal(counts, refcount)
    held = set(np.nonzero(refcount)[0].tolist())
    parked = set(np.nonzero(cached & (refcount == 0))[0].tolist())
    assert not cached[free].any(), "a cached page is on the free stack"
    assert held.isdisjoint(free.tolist()) and held | parked | set(free.tolist()) == set(range(1, NUM_PAGES))


@functools.cache
def _jitted():
    def extend(table, cache, ids, deltas, tags):
        old = table.seq_lens[jnp.clip(ids, 0, MAX_SEQS - 1)]
        table, ok = table.extend(ids, old + deltas)
        q_lens = jnp.where(ok, deltas, 0)
        slots = table.slot_mapping(ids, q_lens, N * MAX_NEW)
        return table, cache.write(tags, tags, slots), ok

    def fork(table, cache, src, dst):
        table, ok, copies = table.fork(src, dst)
        return table, cache.copy_pages(copies), ok

    return jax.jit(extend), jax.jit(fork), jax.jit(PageTable.release)


def _truncate(table: PageTable, model: dict[int, list[float]], ids: list[int], cuts: list[int]) -> PageTable:
    """``table.truncate`` of sequences ``ids`` by ``cuts`` tokens each: checks ``ok`` (a valid first
    occurrence, a length in ``[0, old]``, and a cut at a page boundary or in a private, uncached
    page) and cuts ``model``'s contents likewise."""
    tables, refcount, cached = (np.asarray(x) for x in (table.block_tables, table.refcount, table.cached))
    new_lens = [len(model[s]) - cut if 0 <= s < MAX_SEQS else 0 for s, cut in zip(ids, cuts)]
    table, ok = jax.jit(PageTable.truncate)(table, jnp.asarray(ids, jnp.int32), jnp.asarray(new_lens, jnp.int32))
    seen = set()
    for i, (s, new_len) in enumerate(zip(ids, new_lens)):
        expect = 0 <= s < MAX_SEQS and s not in seen and 0 <= new_len <= len(model[s])
        seen.add(s)
        if expect and new_len % PAGE:
            page = tables[s, new_len // PAGE]
            expect = refcount[page] == 1 and not cached[page]
        assert bool(ok[i]) == expect, (ids, cuts, i)
        if expect:
            model[s] = model[s][:new_len]
    return table


def _read(table: PageTable, cache: KVCache, seq: int) -> list[float]:
    n = int(table.seq_lens[seq])
    pages = np.asarray(table.block_tables)[seq]
    pool = np.asarray(cache.k_pages)[:, :, 0, 0]                      # NHD, Hkv = D = 1
    return [float(pool[pages[i // PAGE], i % PAGE]) for i in range(n)]


ids_st = st.lists(st.integers(-1, MAX_SEQS), min_size=N, max_size=N)
op_st = st.one_of(
    st.tuples(st.just("extend"), ids_st, st.lists(st.integers(0, MAX_NEW), min_size=N, max_size=N)),
    st.tuples(st.just("release"), ids_st),
    st.tuples(st.just("fork"), ids_st, ids_st),
    st.tuples(st.just("truncate"), ids_st, st.lists(st.integers(-1, 2 * PAGE), min_size=N, max_size=N)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_st, min_size=1, max_size=14))
def test_random_operations_keep_invariants_and_contents(ops):
    extend, fork, release = _jitted()
    table = PageTable.create(NUM_PAGES, MAX_SEQS, MAX_PAGES, PAGE)
    cache = KVCache.create(NUM_PAGES, PAGE, 1, 1, dtype=jnp.float32, layout="NHD")
    model: dict[int, list[float]] = {s: [] for s in range(MAX_SEQS)}
    next_tag = 1.0
    for op in ops:
        kind, ids = op[0], np.asarray(op[1], np.int32)
        lens_before = np.asarray(table.seq_lens).copy()
        num_free = int(table.num_free)
        if kind == "extend":
            deltas = np.asarray(op[2], np.int32)
            tags = (next_tag + np.arange(N * MAX_NEW, dtype=np.float32)).reshape(-1, 1, 1)
            next_tag += N * MAX_NEW
            table, cache, ok = extend(table, cache, jnp.asarray(ids), jnp.asarray(deltas), jnp.asarray(tags))
            # Expected ok: valid, first occurrence, fits a row, and the running page count fits.
            seen, running, t = set(), 0, 0
            for i, (s, d) in enumerate(zip(ids.tolist(), deltas.tolist())):
                valid = 0 <= s < MAX_SEQS and s not in seen
                seen.add(s)
                need = 0
                if valid:
                    old = len(model[s])
                    need = -(-(old + d) // PAGE) - -(-old // PAGE)
                    valid = -(-(old + d) // PAGE) <= MAX_PAGES
                running += need if valid else 0
                expect = valid and running <= num_free
                assert bool(ok[i]) == expect, (op, i)
                if expect:
                    model[s] += tags[t:t + d, 0, 0].tolist()
                    t += d
        elif kind == "release":
            table = release(table, jnp.asarray(ids))
            for s in ids.tolist():
                if 0 <= s < MAX_SEQS:
                    model[s] = []
        elif kind == "truncate":
            table = _truncate(table, model, ids.tolist(), op[2])
        else:
            dst = np.asarray(op[2], np.int32)
            table, cache, ok = fork(table, cache, jnp.asarray(ids), jnp.asarray(dst))
            active_src = ids[(ids >= 0) & (dst >= 0)].tolist()
            for i, (s, d) in enumerate(zip(ids.tolist(), dst.tolist())):
                if ok[i]:
                    assert 0 <= s < MAX_SEQS and 0 <= d < MAX_SEQS and lens_before[d] == 0 and d not in active_src
                    model[d] = list(model[s])
        check_invariants(table)
        for s in range(MAX_SEQS):
            assert int(table.seq_lens[s]) == len(model[s]), (op, s)
            assert _read(table, cache, s) == model[s], (op, s)


prefix_op_st = st.one_of(
    st.tuples(st.just("extend"), ids_st, st.lists(st.integers(0, MAX_NEW), min_size=N, max_size=N)),
    st.tuples(st.just("release"), ids_st),
    st.tuples(st.just("mark"), st.integers(0, MAX_SEQS - 1)),
    st.tuples(st.just("evict"), st.lists(st.integers(-1, NUM_PAGES), min_size=N, max_size=N)),
    st.tuples(st.just("attach"), st.integers(-1, MAX_SEQS - 1), st.lists(st.integers(0, 30), max_size=MAX_PAGES)),
    st.tuples(st.just("truncate"), st.integers(-1, MAX_SEQS - 1), st.integers(-1, 2 * PAGE)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(prefix_op_st, min_size=1, max_size=16))
def test_prefix_caching_operations_keep_invariants_and_never_write_a_cached_page(ops):
    """extend/release/truncate with mark_cached (a sequence's full pages), evict and attach (cached
    pages chosen at random): the invariants hold, sequences read what was written or attached, a
    cached page's contents never change (truncate never leaves one partial), and only attach,
    release and truncate bring cached pages into or out of use."""
    extend, _, release = _jitted()
    mark, evict, attach = jax.jit(PageTable.mark_cached), jax.jit(PageTable.evict), jax.jit(PageTable.attach)
    table = PageTable.create(NUM_PAGES, MAX_SEQS, MAX_PAGES, PAGE)
    cache = KVCache.create(NUM_PAGES, PAGE, 1, 1, dtype=jnp.float32, layout="NHD")
    model: dict[int, list[float]] = {s: [] for s in range(MAX_SEQS)}
    snapshot: dict[int, list[float]] = {}           # contents of each cached page when it was marked
    next_tag = 1.0
    for op in ops:
        kind = op[0]
        pool = np.asarray(cache.k_pages)[:, :, 0, 0]
        if kind == "extend":
            ids, deltas = np.asarray(op[1], np.int32), np.asarray(op[2], np.int32)
            tags = (next_tag + np.arange(N * MAX_NEW, dtype=np.float32)).reshape(-1, 1, 1)
            next_tag += N * MAX_NEW
            table, cache, ok = extend(table, cache, jnp.asarray(ids), jnp.asarray(deltas), jnp.asarray(tags))
            t = 0
            for i, (s, d) in enumerate(zip(ids.tolist(), deltas.tolist())):
                if ok[i]:
                    model[s] += tags[t:t + d, 0, 0].tolist()
                    t += d
        elif kind == "release":
            ids = np.asarray(op[1], np.int32)
            table = release(table, jnp.asarray(ids))
            for s in ids.tolist():
                if 0 <= s < MAX_SEQS:
                    model[s] = []
        elif kind == "mark":
            s = op[1]
            full = np.asarray(table.block_tables)[s, :len(model[s]) // PAGE]
            marks = np.full(MAX_PAGES, -1, np.int32)
            marks[:full.size] = full
            table = mark(table, jnp.asarray(marks))
            for p in full.tolist():
                snapshot.setdefault(p, pool[p].tolist())
        elif kind == "evict":
            pages = np.asarray(op[1], np.int32)
            parked = np.asarray(table.cached) & (np.asarray(table.refcount) == 0)
            num_free = int(table.num_free)
            table = evict(table, jnp.asarray(pages))
            gone = {p for p in pages.tolist() if 0 <= p < NUM_PAGES and parked[p]}
            assert int(table.num_free) == num_free + len(gone)
            for p in gone:
                del snapshot[p]
        elif kind == "truncate":
            table = _truncate(table, model, [op[1]], [op[2]])
        else:
            dst, picks = op[1], op[2]
            cached_pages = np.nonzero(np.asarray(table.cached))[0]
            chosen = [int(cached_pages[i % cached_pages.size]) for i in picks] if cached_pages.size else []
            row = np.zeros((1, MAX_PAGES), np.int32)
            row[0, :len(chosen)] = chosen
            empty = dst >= 0 and not model[dst]
            table, ok = attach(table, jnp.asarray([dst], jnp.int32), jnp.asarray(row))
            assert bool(ok[0]) == empty, (op, chosen)
            if empty:
                model[dst] = [x for p in chosen for x in snapshot[p]]
        check_invariants(table)
        pool = np.asarray(cache.k_pages)[:, :, 0, 0]
        cached = np.asarray(table.cached)
        assert set(snapshot) == set(np.nonzero(cached)[0].tolist())
        for p, contents in snapshot.items():
            assert pool[p].tolist() == contents, f"cached page {p} was written"
        for s in range(MAX_SEQS):
            assert int(table.seq_lens[s]) == len(model[s]), (op, s)
            assert _read(table, cache, s) == model[s], (op, s)


def test_attach_shares_cached_pages_and_release_parks_them_until_evicted():
    table = PageTable.create(8, 3, 3, 4)
    table, _ = table.extend(jnp.asarray([0]), jnp.asarray([10]))        # pages 1, 2 full, 3 partial
    table = table.mark_cached(jnp.asarray([1, 2, 3, -1]))             # 3 is marked too: the caller's promise
    table, ok = table.attach(jnp.asarray([1, 0, -1]), jnp.asarray([[1, 2, 0], [1, 0, 0], [1, 0, 0]]))
    np.testing.assert_array_equal(ok, [True, False, False])            # 0 is not empty, -1 is padding
    np.testing.assert_array_equal(table.refcount[:4], [0, 2, 2, 1])
    assert int(table.seq_lens[1]) == 8
    _, ok = table.attach(jnp.asarray([2]), jnp.asarray([[4, 0, 0]]))   # page 4 is free, not cached
    assert not bool(ok[0])
    _, ok = table.attach(jnp.asarray([2]), jnp.asarray([[1, 0, 2]]))   # a gap
    assert not bool(ok[0])
    table = table.release(jnp.asarray([0, 1]))
    assert int(table.num_free) == 4                                    # 4..7; 1, 2, 3 stay cached
    table = table.evict(jnp.asarray([2, 2, 5, -1]))                   # 5 is free: ignored; 2 once
    assert int(table.num_free) == 5 and np.asarray(table.cached).tolist()[:4] == [False, True, False, True]


def test_extend_allocates_lowest_pages_first_and_rejects_what_does_not_fit():
    table = PageTable.create(6, 4, 3, 4)
    table, ok = table.extend(jnp.asarray([0, 1, 2]), jnp.asarray([5, 4, 13]))
    np.testing.assert_array_equal(ok, [True, True, False])          # 13 tokens need 4 > 3 pages
    np.testing.assert_array_equal(table.block_tables[:2], [[1, 2, 0], [3, 0, 0]])
    table, ok = table.extend(jnp.asarray([1, 0]), jnp.asarray([12, 9]))
    np.testing.assert_array_equal(ok, [True, False])                 # 2 + 1 pages needed, 2 free
    assert int(table.seq_lens[0]) == 5 and int(table.num_free) == 0
    table, ok = table.extend(jnp.asarray([0]), jnp.asarray([3]))
    assert not bool(ok[0]), "shrinking is not an extend"


def test_fork_shares_full_pages_and_copies_the_partial_one():
    table = PageTable.create(10, 4, 4, 4)
    table, _ = table.extend(jnp.asarray([0]), jnp.asarray([10]))    # pages 1, 2 full; 3 partial
    table, ok, copies = table.fork(jnp.asarray([0, 0, -1]), jnp.asarray([1, 0, 2]))
    np.testing.assert_array_equal(ok, [True, False, False])
    np.testing.assert_array_equal(copies, [[3, 4], [-1, -1], [-1, -1]])
    np.testing.assert_array_equal(table.block_tables[1], [1, 2, 4, 0])
    np.testing.assert_array_equal(table.refcount[:5], [0, 2, 2, 1, 1])
    table = table.release(jnp.asarray([0]))
    np.testing.assert_array_equal(table.refcount[:5], [0, 1, 1, 0, 1])
    assert 3 in np.asarray(table.free_pages)[: int(table.num_free)]


def test_release_with_scrub_zeroes_only_freed_pages():
    table = PageTable.create(8, 3, 2, 2)
    table, _ = table.extend(jnp.asarray([0, 1]), jnp.asarray([4, 2]))
    table, _, copies = table.fork(jnp.asarray([0]), jnp.asarray([2]))   # shares pages 1, 2
    caches = [KVCache(jnp.ones((8, 1, 2, 4)), jnp.ones((8, 1, 2, 4))), MLACache(jnp.ones((8, 2, 6)), kv_lora_rank=4)]
    table, caches = table.release(jnp.asarray([0, 1]), scrub=caches)
    for pages in (caches[0].k_pages, caches[0].v_pages, caches[1].pages):
        zeroed = ~np.asarray(pages).reshape(8, -1).any(axis=1)
        np.testing.assert_array_equal(zeroed, [False, False, False, True, False, False, False, False])


def test_metadata_and_slot_mapping_decodes_first_and_padding():
    table = PageTable.create(16, 4, 4, 4)
    table, _ = table.extend(jnp.asarray([2, 0, 1]), jnp.asarray([6, 9, 3]))
    ids, q_lens = jnp.asarray([0, 2, 1, -1]), jnp.asarray([1, 1, 3, 5])
    meta = jax.jit(lambda t, i, q: t.metadata(i, q, max_q_len=3))(table, ids, q_lens)
    np.testing.assert_array_equal(meta.cu_q_lens, [0, 1, 2, 5, 10])       # padding keeps its tokens' place
    np.testing.assert_array_equal(meta.kv_lens, [9, 6, 3, 0])
    np.testing.assert_array_equal(meta.block_tables[3], 0)
    assert int(meta.num_decodes) == 2 and meta.max_q_len == 3
    slots = np.asarray(table.slot_mapping(ids, q_lens, 8).slots)
    bt = np.asarray(table.block_tables)
    expected = [bt[0, 2] * 4 + 0, bt[2, 1] * 4 + 1, bt[1, 0] * 4, bt[1, 0] * 4 + 1, bt[1, 0] * 4 + 2, -1, -1, -1]
    np.testing.assert_array_equal(slots, expected)


def test_num_decodes_counts_only_the_leading_run():
    table = PageTable.create(16, 4, 4, 4)
    table, _ = table.extend(jnp.asarray([0, 1, 2]), jnp.asarray([3, 3, 3]))
    meta = table.metadata(jnp.asarray([0, 1, 2]), jnp.asarray([1, 2, 1]))
    assert int(meta.num_decodes) == 1


def test_end_to_end_step_matches_reference():
    """extend -> slot_mapping -> write -> metadata -> attention equals dense attention."""
    rng = np.random.default_rng()
    table = PageTable.create(32, 4, 8, 8)
    cache = KVCache.create(32, 8, 2, 16, dtype=jnp.float32)
    keys = {s: np.zeros((0, 2, 16)) for s in range(3)}
    vals = {s: np.zeros((0, 2, 16)) for s in range(3)}
    for q_lens in ([7, 20, 3], [1, 1, 4]):
        ids = jnp.asarray([0, 1, 2, -1])
        ql = jnp.asarray(q_lens + [0])
        table, ok = table.extend(ids, table.seq_lens[jnp.clip(ids, 0)] + ql)
        assert bool(ok[:3].all())
        t = sum(q_lens) + 2
        k = rng.normal(size=(t, 2, 16)).astype(np.float32)
        v = rng.normal(size=(t, 2, 16)).astype(np.float32)
        cache = cache.write(jnp.asarray(k), jnp.asarray(v), table.slot_mapping(ids, ql, t))
        start = 0
        for s, n in enumerate(q_lens):
            keys[s] = np.concatenate([keys[s], k[start:start + n]])
            vals[s] = np.concatenate([vals[s], v[start:start + n]])
            start += n
    q = rng.normal(size=(8, 4, 16)).astype(np.float32)
    meta = table.metadata(ids, ql)
    out = np.asarray(jaxattn.paged_attention(jnp.asarray(q), cache, meta, backend="xla"))
    start = 0
    for s, n in enumerate(q_lens):
        np.testing.assert_allclose(out[start:start + n], _dense_attention(q[start:start + n], keys[s], vals[s]),
                                   **ALLCLOSE[jnp.dtype(jnp.float32)])
        start += n
    np.testing.assert_array_equal(out[start:], 0)


def _dense_attention(q: np.ndarray, keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """Causal float64 attention of one sequence's last ``len(q)`` tokens ``q [n, Hq, D]`` over its
    ``keys, vals [kv, Hkv, D]`` (GQA: query head h reads KV head ``h // (Hq / Hkv)``) -> [n, Hq, D]."""
    n, kv, group = q.shape[0], keys.shape[0], q.shape[1] // keys.shape[1]
    mask = (np.arange(n)[:, None] + kv - n) >= np.arange(kv)[None]
    k_h, v_h = (np.repeat(x.astype(np.float64), group, axis=1) for x in (keys, vals))
    logits = np.einsum("qhd,khd->hqk", q.astype(np.float64), k_h) / np.sqrt(q.shape[2])
    weights = np.exp(np.where(mask[None], logits, -np.inf) - logits.max(axis=-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", weights / weights.sum(axis=-1, keepdims=True), v_h)


def test_truncate_drops_pages_past_the_new_length_and_never_cuts_into_a_shared_page():
    table = PageTable.create(12, 4, 4, 4)
    table, _ = table.extend(jnp.asarray([0, 1]), jnp.asarray([14, 6]))        # 0: pages 1-4; 1: pages 5, 6
    table, _, _ = table.fork(jnp.asarray([0]), jnp.asarray([2]))              # 2 shares 1-3, copies 4 into 7
    table = table.mark_cached(jnp.asarray([5]))
    free = int(table.num_free)
    table, ok = table.truncate(jnp.asarray([0, 2, 2, 1, 3, -1]), jnp.asarray([6, 12, 0, 2, 0, 0]))
    # 0 -> 6 tokens ends inside shared page 2; 2 -> 12 drops its copy 7; 2 again is a repeat;
    # 1 -> 2 ends inside cached page 5; 3 is empty (0 -> 0); -1 is padding
    np.testing.assert_array_equal(ok, [False, True, False, False, True, False])
    np.testing.assert_array_equal(table.seq_lens, [14, 6, 12, 0])
    np.testing.assert_array_equal(table.block_tables[2], [1, 2, 3, 0])
    assert int(table.num_free) == free + 1 and int(table.refcount[7]) == 0
    table, ok = table.truncate(jnp.asarray([0, 1, 2]), jnp.asarray([8, 4, 15]))   # 15 grows: refused
    np.testing.assert_array_equal(ok, [True, True, False])
    np.testing.assert_array_equal(table.block_tables[:2], [[1, 2, 0, 0], [5, 0, 0, 0]])
    np.testing.assert_array_equal(table.refcount[:8], [0, 2, 2, 1, 0, 1, 0, 0])
    assert int(table.num_free) == free + 3                                     # 4 and 6 freed too
    table, ok = table.truncate(jnp.asarray([2]), jnp.asarray([9]))            # page 3 is 2's alone now
    assert bool(ok[0]) and int(table.seq_lens[2]) == 9


def test_an_invalid_sequence_rolled_back_by_truncate_is_computed_again():
    """A step whose query tokens run past T flags the sequences past it invalid (zero rows) after
    ``extend`` counted their tokens; truncating them back to their length before the step and
    computing their tokens again in a step that holds them gives dense attention."""
    rng = np.random.default_rng()
    table = PageTable.create(16, 2, 4, 4)
    cache = KVCache.create(16, 4, 1, 8, dtype=jnp.float32)
    ids = jnp.asarray([0, 1])

    def step(table, cache, q_lens, q, kv):
        table, ok = table.extend(ids, table.seq_lens + q_lens)
        cache = cache.write(kv, -kv, table.slot_mapping(ids, q_lens, q.shape[0]))
        out, valid = jaxattn.paged_attention(q, cache, table.metadata(ids, q_lens), backend="xla", return_status=True)
        return table, cache, ok, out, valid

    kv = rng.normal(size=(12, 1, 8)).astype(np.float32)
    q = rng.normal(size=(12, 2, 8)).astype(np.float32)
    table, cache, _, _, _ = step(table, cache, jnp.asarray([3, 2]), jnp.asarray(q[:5]), jnp.asarray(kv[:5]))
    q_lens = jnp.asarray([2, 5])
    table, cache, ok, out, valid = step(table, cache, q_lens, jnp.asarray(q[5:11]), jnp.asarray(kv[5:11]))
    np.testing.assert_array_equal(ok, [True, True])
    np.testing.assert_array_equal(valid, [True, False])                      # 2 + 5 tokens, T = 6
    assert not np.asarray(out[2:]).any()
    free = int(table.num_free)
    table, ok = table.truncate(jnp.where(valid, -1, ids), table.seq_lens[jnp.maximum(ids, 0)] - q_lens)  # README's
    np.testing.assert_array_equal(ok, [False, True])
    np.testing.assert_array_equal(table.seq_lens, [5, 2])
    assert int(table.num_free) == free + 1                                   # the page of positions 4..6
    q1, kv1 = q[np.r_[3:5, 7:12]], kv[np.r_[3:5, 7:12]]                     # sequence 1's tokens, new ones again
    table, cache, _, out, valid = step(table, cache, jnp.asarray([0, 5]), jnp.asarray(q1[2:]), jnp.asarray(kv1[2:]))
    assert bool(valid.all())
    np.testing.assert_allclose(out, _dense_attention(q1[2:], kv1, -kv1), **ALLCLOSE[jnp.dtype(jnp.float32)])


def test_errors():
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        PageTable.create(1, 2, 2, 4)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        PageTable.create(8, 2, 2, 0)
    table = PageTable.create(8, 2, 2, 4)
    with pytest.raises(ValueError, match=r"extend: new_lens must be int\[2\]"):
        table.extend(jnp.asarray([0, 1]), jnp.asarray([1, 2, 3]))
    with pytest.raises(ValueError, match=r"release: seq_ids must be int\[N\]"):
        table.release(jnp.asarray([[0]]))
    with pytest.raises(ValueError, match=r"evict: pages must be int\[N\]"):
        table.evict(jnp.asarray([1.0]))
    with pytest.raises(ValueError, match=r"fork: dst_ids must be int\[1\]"):
        table.fork(jnp.asarray([0]), jnp.asarray([0.5]))
    with pytest.raises(ValueError, match=r"metadata: q_lens must be int\[1\]"):
        table.metadata(jnp.asarray([0]), jnp.asarray([1, 1]))


def test_extend_grants_in_order_and_a_refusal_takes_no_pages_from_later_entries():
    table = PageTable.create(8, 4, 8, 4)                          # 7 free pages
    table, ok = table.extend([0, 1, 2, 3], [12, 24, 4, 0])          # 3 pages, 6 (refused), 1, 0
    np.testing.assert_array_equal(ok, [True, False, True, True])
    np.testing.assert_array_equal(table.seq_lens, [12, 0, 4, 0])
    assert int(table.num_free) == 3
    table, ok = table.extend(jnp.asarray([2, 0, 1]), jnp.asarray([20, 13, 4]))   # +4 (refused), +1, +1
    np.testing.assert_array_equal(ok, [False, True, True])
    assert int(table.num_free) == 1


def test_lengths_near_int32_max_are_refused_not_wrapped():
    """A length whose page count would wrap in int32 is past the table's capacity: refused, and
    the table (free pages included) unchanged."""
    table = PageTable.create(8, 2, 4, 4)
    for length in (2 ** 31 - 1, 2 ** 31 - 3):
        after, ok = table.extend(jnp.asarray([0, 1]), jnp.asarray([length, 3], jnp.int32))
        np.testing.assert_array_equal(ok, [False, True])
        np.testing.assert_array_equal(after.seq_lens, [0, 3])
        assert int(after.num_free) == 6


def test_host_ids_and_lengths_outside_int32_raise():
    table = PageTable.create(8, 2, 4, 4)
    with pytest.raises(ValueError, match=r"extend: seq_ids must be int\[N\] with int32 values"):
        table.extend(np.asarray([2 ** 32]), np.asarray([3]))                # JAX would wrap it to sequence 0
    with pytest.raises(ValueError, match=r"extend: new_lens must be int\[1\] like the ids with int32 values"):
        table.extend([0], [2 ** 40])
    with pytest.raises(ValueError, match="max_pages_per_seq \\* page_size .* must fit int32"):
        PageTable.create(8, 2, 2 ** 20, 2 ** 12)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        PageTable.create(8, 2, 4, 2 ** 31)


def test_release_scrubs_only_caches_of_its_own_pool():
    table, ok = PageTable.create(8, 2, 4, 4).extend([0], [5])
    for other in (KVCache.create(4, 4, 1, 8), KVCache.create(8, 8, 1, 8)):
        with pytest.raises(ValueError, match="release: scrub has a cache of .* the same pool"):
            table.release([0], scrub=[KVCache.create(8, 4, 1, 8), other])
    with pytest.raises(ValueError, match="scrub must be a KVCache or MLACache, or a pytree of them, got a leaf"):
        table.release([0], scrub=jnp.zeros(3))
    released, (scrubbed,) = table.release([0], scrub=[KVCache.create(8, 4, 1, 8)])
    assert int(released.num_free) == 7 and scrubbed.num_pages == 8


def test_attach_and_slot_mapping_name_their_bad_arguments():
    table = PageTable.create(8, 2, 4, 4)
    with pytest.raises(ValueError, match=r"attach: pages must be int\[1, 4\] \(ids x max_pages_per_seq\), got None"):
        table.attach([0], None)
    for num_tokens in (None, 0, -1, 2.5, True):
        with pytest.raises(ValueError, match="slot_mapping: num_tokens must be an int in \\[1, 2\\*\\*31 - 1\\]"):
            table.slot_mapping([0], [1], num_tokens)
    with pytest.raises(ValueError, match="slot_mapping: seq_ids must have at least one row"):
        table.slot_mapping(jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32), 4)


@pytest.mark.parametrize("name", ["max_q_len", "max_prefill_seqs"])
@pytest.mark.parametrize("bound", [0, -1, True, 2.0])
def test_metadata_rejects_a_bad_static_bound(name, bound):
    table = PageTable.create(8, 2, 2, 4)
    with pytest.raises(ValueError, match=f"PageTable.metadata: {name} must be None or an int >= 1"):
        table.metadata(jnp.asarray([0, 1]), jnp.asarray([1, 1]), **{name: bound})


def test_create_rejects_a_bool_page_size():
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        PageTable.create(8, 2, 2, True)
