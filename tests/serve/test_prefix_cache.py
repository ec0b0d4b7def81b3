"""Prefix caching's chained page keys (the pool that maps them to pages: tests/serve/test_scheduler.py)."""

from __future__ import annotations

import numpy as np

from jaxattn.serve.prefix_cache import page_keys


def test_page_keys_chain_whole_prefixes():
    tokens = np.arange(10)
    keys = page_keys(tokens, 4)
    assert len(keys) == 2                                          # the partial third page has no key
    assert page_keys(np.arange(8), 4) == keys
    changed = tokens.copy()
    changed[1] = 99
    assert not set(page_keys(changed, 4)) & set(keys), "a key names everything before it"
    assert page_keys(np.concatenate([tokens[4:8], tokens[:4]]), 4)[0] != keys[1]
