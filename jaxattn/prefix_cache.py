"""The host side of automatic prefix caching: which pages hold which token prefixes.

A full page of a prompt is keyed by a hash of its tokens chained with the previous page's key, so
a key names the whole prefix up to the end of its page (K/V at a position depend on every token
before it). ``PagePool`` maps keys to the pages that hold them, counts the running requests that
hold each cached page, keeps cached pages no request holds in LRU order, and mirrors the size of
the device table's free stack, so the engine schedules without reading the device. The device
side (``PageTable.mark_cached``, ``attach``, ``evict``) follows the same operations a step later
or in the same step; ``jaxattn.page_table`` describes it.
"""

from __future__ import annotations

import collections
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


class PagePool:
    """Host view of a page table's pool (``num_pages - 1`` usable pages) and its cached prefixes.

    Every usable page is free (``free`` counts them, as the table's ``num_free``), cached and held
    by ``refs[page]`` requests, cached and held by none (``evictable``, least recently used first),
    or held privately by one request (only counted by the requests themselves).
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
