"""The host side of prefix caching: chained page keys, and the pool's lookup, release and LRU eviction."""

from __future__ import annotations

import numpy as np
import pytest

from jaxattn.prefix_cache import PagePool, page_keys


def test_page_keys_chain_whole_prefixes():
    tokens = np.arange(10)
    keys = page_keys(tokens, 4)
    assert len(keys) == 2                                          # the partial third page has no key
    assert page_keys(np.arange(8), 4) == keys
    changed = tokens.copy()
    changed[1] = 99
    assert not set(page_keys(changed, 4)) & set(keys), "a key names everything before it"
    assert page_keys(np.concatenate([tokens[4:8], tokens[:4]]), 4)[0] != keys[1]


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
