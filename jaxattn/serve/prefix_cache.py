"""The keys of automatic prefix caching: which token prefix a full page holds.

A full page of a prompt is keyed by a hash of its tokens chained with the previous page's key, so
a key names the whole prefix up to the end of its page (K/V at a position depend on every token
before it). ``jaxattn.serve.scheduler.PagePool`` maps keys to the pages that hold them (host side, LRU
eviction); the device side (``PageTable.mark_cached``, ``attach``, ``evict``) is described in
``jaxattn.page_table``.
"""

from __future__ import annotations

import hashlib

import numpy as np


def page_keys(tokens: np.ndarray, page_size: int) -> list[bytes]:
    """Chained keys of the full pages of ``tokens``: key i hashes page i's tokens and key i - 1."""
    keys, key = [], b""
    for start in range(0, tokens.size - page_size + 1, page_size):
        key = hashlib.blake2b(key + tokens[start:start + page_size].astype(np.int32).tobytes(),
                              digest_size=16).digest()
        keys.append(key)
    return keys
