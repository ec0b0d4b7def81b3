"""A functional, jittable page manager: block tables, refcounted pages and a free stack.

Every method is a pure function of device arrays with static shapes, so it runs inside the
same jitted step as attention. Costs are O(N * max_pages_per_seq) for N requests (plus an N x N
comparison of the request ids): nothing searches the pool.

Prefix caching splits between the host and this table. The host page pool
(``jaxattn.serve.scheduler.PagePool``, owned by the Engine's scheduler) keeps the hash map from a chain
of prompt tokens (page i's key hashes its tokens with page i-1's key) to the page holding their
K/V, and an LRU order of the cached pages no sequence holds. The table keeps
a ``cached`` flag per page and three operations: ``mark_cached`` flags full pages once their K/V
is written, ``attach`` starts an empty sequence on cached pages (refcount + 1: a new request's
longest cached prefix), and ``evict`` returns cached pages that no sequence holds to the free
stack. ``release`` keeps a cached page out of the free stack when its refcount drops to 0, so its
contents wait for the next request with the same prefix until the host evicts it.

Invariants (checked by the property tests):
  * page 0 is the null page: never handed out, never in the free stack, never cached;
  * every other page is exactly one of: on the free stack (``free_pages[:num_free]``), referenced
    (``refcount[p]`` is the number of block-table entries holding p), or cached and unreferenced;
  * sequence s holds ``ceil(seq_lens[s] / page_size)`` pages; the rest of its row is 0;
  * a page held by several sequences, or cached, is full for all of them, so it is never written
    again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.checks import INT32_MAX, check_sizes, int_array, is_positive_int
from jaxattn.kv_cache import KVCache, MLACache, SlotMapping
from jaxattn.metadata import AttentionMetadata, count_leading_decodes, pages_for, token_sequences


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTable:
    """State of the page manager.

    Attributes:
      block_tables: int32[max_seqs, max_pages_per_seq], page ids of each sequence (0 = none).
      seq_lens: int32[max_seqs], tokens of each sequence.
      refcount: int32[num_pages], number of sequences holding each page.
      free_pages: int32[num_pages], a stack whose first ``num_free`` entries are the free pages.
      num_free: int32[], size of the free stack.
      cached: bool[num_pages], pages kept for prefix caching (off the free stack while cached).
      page_size: tokens per page (static).
    """

    block_tables: jax.Array
    seq_lens: jax.Array
    refcount: jax.Array
    free_pages: jax.Array
    num_free: jax.Array
    cached: jax.Array
    page_size: int = dataclasses.field(default=16, metadata=dict(static=True))

    @classmethod
    def create(cls, num_pages: int, max_seqs: int, max_pages_per_seq: int, page_size: int) -> "PageTable":
        """An empty table; pages 1..num_pages-1 are free (page 0 is the null page)."""
        for name, value in (("num_pages", num_pages), ("max_seqs", max_seqs),
                            ("max_pages_per_seq", max_pages_per_seq), ("page_size", page_size)):
            if not is_positive_int(value):
                raise ValueError(f"PageTable.create: {name} must be a positive int, got {value!r}")
        if num_pages < 2:
            raise ValueError(f"PageTable.create: num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if max_pages_per_seq * page_size > INT32_MAX:
            raise ValueError(f"PageTable.create: max_pages_per_seq * page_size (a sequence's most tokens) must fit "
                             f"int32, got {max_pages_per_seq} * {page_size}")
        # Page 1 on top of the stack: low ids are handed out first.
        free = np.concatenate([np.arange(num_pages - 1, 0, -1), [0]]).astype(np.int32)
        return cls(
            block_tables=jnp.zeros((max_seqs, max_pages_per_seq), jnp.int32),
            seq_lens=jnp.zeros((max_seqs,), jnp.int32),
            refcount=jnp.zeros((num_pages,), jnp.int32),
            free_pages=jnp.asarray(free),
            num_free=jnp.asarray(num_pages - 1, jnp.int32),
            cached=jnp.zeros((num_pages,), bool),
            page_size=int(page_size),
        )

    @property
    def num_pages(self) -> int:
        return self.refcount.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    @property
    def num_pages_held(self) -> jax.Array:
        """int32[max_seqs]: pages each sequence holds."""
        return pages_for(self.seq_lens, self.page_size)

    # -- allocation -------------------------------------------------------------------------

    def extend(self, seq_ids: jax.Array, new_lens: jax.Array) -> tuple["PageTable", jax.Array]:
        """Grows sequences to ``new_lens`` total tokens, allocating the pages they need.

        Args:
          seq_ids: int32[N]; ids < 0 are padding.
          new_lens: int32[N], the new total length of each sequence.

        Returns:
          (table, ok): ``ok[i]`` is False for padding, an invalid or repeated id, a length
          that shrinks or exceeds ``max_pages_per_seq * page_size``, or when too few pages are
          free. Requests are granted in order: request i gets its pages when the pages still
          free after the granted requests before it suffice, so a refused request takes no
          pages from later ones. A request that is not ok leaves its sequence unchanged; its
          tokens must then not be written or attended (e.g. ``seq_ids = where(ok, seq_ids, -1)``
          before ``slot_mapping`` and ``metadata``).
        """
        seq_ids, new_lens = self._check_requests("extend", seq_ids, new_lens=new_lens)
        valid = self._valid_ids(seq_ids)
        row = jnp.where(valid, seq_ids, 0)
        old_lens = self.seq_lens[row]
        have = pages_for(old_lens, self.page_size)
        want = pages_for(new_lens, self.page_size)
        valid &= (new_lens >= old_lens) & (want <= self.max_pages_per_seq)
        ok = valid & _grant_in_order(jnp.where(valid, want - have, 0), self.num_free)
        need = jnp.where(ok, want - have, 0)
        table, pages = self._pop(need)                                      # [N, max_pages_per_seq]
        slot = have[:, None] + jnp.arange(self.max_pages_per_seq)[None, :]
        taken = pages > 0
        block_tables = table.block_tables.at[
            jnp.where(taken, row[:, None], self.max_seqs), jnp.where(taken, slot, 0)
        ].set(pages, mode="drop")
        seq_lens = table.seq_lens.at[jnp.where(ok, row, self.max_seqs)].set(new_lens, mode="drop")
        return dataclasses.replace(table, block_tables=block_tables, seq_lens=seq_lens), ok

    def release(self, seq_ids: jax.Array, scrub=None):
        """Frees sequences (their pages return to the free stack when no one else holds them and
        they are not cached).

        Args:
          seq_ids: int32[N]; ids < 0 (padding), invalid ids and repeats are ignored.
          scrub: optional KVCache or MLACache, or pytree of them (e.g. one per layer): pages freed by this
            call are zeroed in each, so the next tenant of a page cannot read old contents.

        Returns:
          The table, or ``(table, scrubbed_caches)`` when ``scrub`` is given.
        """
        (seq_ids,) = self._check_requests("release", seq_ids)
        valid = self._valid_ids(seq_ids)
        table, freed_pages = self._shrink(valid, jnp.where(valid, seq_ids, 0), jnp.zeros_like(seq_ids))
        if scrub is None:
            return table
        for cache in jax.tree.leaves(scrub, is_leaf=_is_cache):
            if not _is_cache(cache):
                raise ValueError(f"PageTable.release: scrub must be a KVCache or MLACache, or a pytree of them, "
                                 f"got a leaf of type {type(cache).__name__}")
            if (cache.page_size, cache.num_pages) != (self.page_size, self.num_pages):
                raise ValueError(f"PageTable.release: scrub has a cache of {cache.num_pages} pages of "
                                 f"{cache.page_size}, but this table has {self.num_pages} pages of {self.page_size}; "
                                 f"the page table and the caches must describe the same pool")
        scrubbed = jax.tree.map(lambda c: c.zero_pages(freed_pages), scrub, is_leaf=_is_cache)
        return table, scrubbed

    def truncate(self, seq_ids: jax.Array, new_lens: jax.Array) -> tuple["PageTable", jax.Array]:
        """Shrinks sequences to ``new_lens`` total tokens, dropping the pages past them (a page
        returns to the free stack when no one else holds it and it is not cached): e.g. a step's
        tokens rolled back after ``paged_attention`` flagged the sequence invalid, or rejected
        draft tokens. Kept tokens keep their K/V; the dropped ones are written again when the
        sequence is extended over them.

        Args:
          seq_ids: int32[N]; ids < 0 are padding.
          new_lens: int32[N], the new total length of each sequence.

        Returns:
          (table, ok): ``ok[i]`` is False for padding, an invalid or repeated id, a length that
          is negative or grows, or one that ends inside a page that is shared or cached (its
          next tokens would be written into a page that must never be written again; release
          the sequence instead). A request that is not ok leaves its sequence unchanged.
        """
        seq_ids, new_lens = self._check_requests("truncate", seq_ids, new_lens=new_lens)
        valid = self._valid_ids(seq_ids)
        row = jnp.where(valid, seq_ids, 0)
        keep = pages_for(new_lens, self.page_size)
        last = self.block_tables[row, jnp.clip(keep - 1, 0, self.max_pages_per_seq - 1)]
        writable = (new_lens % self.page_size == 0) | ((self.refcount[last] == 1) & ~self.cached[last])
        ok = valid & (new_lens >= 0) & (new_lens <= self.seq_lens[row]) & writable
        return self._shrink(ok, row, new_lens)[0], ok

    def fork(self, src_ids: jax.Array, dst_ids: jax.Array) -> tuple["PageTable", jax.Array, jax.Array]:
        """Makes each ``dst`` a copy of ``src`` (e.g. for beam search or parallel sampling).

        Full pages are shared (refcount + 1); a partial last page is copied into a fresh page,
        so shared pages are never written again.

        Args:
          src_ids, dst_ids: int32[N]; a row with either id < 0 is padding.

        Returns:
          (table, ok, copies): ``ok[i]`` is False for padding, invalid ids, a ``dst`` that is
          not empty, repeated or also a source in this call, or when no page is free for the
          copy (granted in order, as ``extend``). ``copies`` is int32[N, 2] of (src_page, dst_page) rows for
          ``KVCache.copy_pages`` (-1 where nothing is copied).
        """
        src_ids, dst_ids = self._check_requests("fork", src_ids, "src_ids", dst_ids=dst_ids)
        valid = self._valid_ids(dst_ids) & (src_ids >= 0) & (src_ids < self.max_seqs)
        active_src = jnp.where((src_ids >= 0) & (dst_ids >= 0), src_ids, -1)
        valid &= ~jnp.any(dst_ids[:, None] == active_src[None, :], axis=1)
        src = jnp.where(valid, src_ids, 0)
        dst = jnp.where(valid, dst_ids, 0)
        valid &= self.seq_lens[dst] == 0
        lens = self.seq_lens[src]
        full = lens // self.page_size
        partial = (lens % self.page_size) > 0
        need = jnp.where(valid & partial, 1, 0)
        ok = valid & _grant_in_order(need, self.num_free)
        need = jnp.where(ok, need, 0)
        table, new_pages = self._pop(need)
        new_page = new_pages[:, 0]

        slot = jnp.arange(self.max_pages_per_seq)[None, :]
        shared = ok[:, None] & (slot < full[:, None])
        src_rows = self.block_tables[src]
        dst_row = jnp.where(shared, src_rows, 0)
        dst_row = jnp.where(slot == full[:, None], jnp.where(need > 0, new_page, 0)[:, None], dst_row)
        refcount = table.refcount.at[jnp.where(shared, src_rows, self.num_pages)].add(1, mode="drop")
        rows = jnp.where(ok, dst, self.max_seqs)
        table = dataclasses.replace(
            table,
            refcount=refcount,
            block_tables=table.block_tables.at[rows].set(dst_row, mode="drop"),
            seq_lens=table.seq_lens.at[rows].set(lens, mode="drop"),
        )
        last = src_rows[jnp.arange(src.shape[0]), jnp.minimum(full, self.max_pages_per_seq - 1)]
        copies = jnp.where((need > 0)[:, None], jnp.stack([last, new_page], axis=1), -1)
        return table, ok, copies

    # -- prefix caching ---------------------------------------------------------------------

    def mark_cached(self, pages: jax.Array) -> "PageTable":
        """Flags pages as cached: when no sequence holds one any more it stays off the free stack,
        its contents kept for ``attach``, until ``evict``. Mark only full pages whose K/V is
        written (no sequence writes a full page again).

        Args:
          pages: int32[M]; entries outside ``[1, num_pages)`` (padding: -1) and pages no sequence
            holds are ignored.
        """
        (pages,) = self._check_requests("mark_cached", pages, "pages")
        ok = self._page_ids(pages) & (self.refcount[jnp.clip(pages, 0, self.num_pages - 1)] > 0)
        cached = self.cached.at[jnp.where(ok, pages, self.num_pages)].set(True, mode="drop")
        return dataclasses.replace(self, cached=cached)

    def evict(self, pages: jax.Array) -> "PageTable":
        """Returns cached pages that no sequence holds to the free stack (their contents are
        dropped). ``pages``: int32[M]; other entries (padding -1, held or uncached pages, repeats)
        are ignored."""
        (pages,) = self._check_requests("evict", pages, "pages")
        page_c = jnp.clip(pages, 0, self.num_pages - 1)
        ok = self._page_ids(pages) & self.cached[page_c] & (self.refcount[page_c] == 0) & _first_occurrence(pages)
        table = self._push(jnp.where(ok, pages, -1))
        cached = table.cached.at[jnp.where(ok, pages, self.num_pages)].set(False, mode="drop")
        return dataclasses.replace(table, cached=cached)

    def attach(self, seq_ids: jax.Array, pages: jax.Array) -> tuple["PageTable", jax.Array]:
        """Starts empty sequences on cached pages: sequence ``seq_ids[i]`` holds the nonzero
        leading entries of ``pages[i]`` (refcount + 1 each) and has ``page_size`` tokens per page.

        Args:
          seq_ids: int32[N]; ids < 0 are padding.
          pages: int32[N, max_pages_per_seq], page ids then zeros.

        Returns:
          (table, ok): ``ok[i]`` is False for padding, an invalid or repeated id, a sequence that
          is not empty, or pages that are not all cached or not followed only by zeros; such rows
          change nothing.
        """
        (seq_ids,) = self._check_requests("attach", seq_ids)
        pages = int_array("PageTable.attach", "pages", pages,
                          f"int[{seq_ids.shape[0]}, {self.max_pages_per_seq}] (ids x max_pages_per_seq)",
                          (seq_ids.shape[0], self.max_pages_per_seq))
        valid = self._valid_ids(seq_ids)
        row = jnp.where(valid, seq_ids, 0)
        count = jnp.sum(pages != 0, axis=1, dtype=jnp.int32)
        leading = jnp.arange(self.max_pages_per_seq)[None, :] < count[:, None]
        page_c = jnp.clip(pages, 0, self.num_pages - 1)
        proper = jnp.where(leading, self._page_ids(pages) & self.cached[page_c], pages == 0)
        ok = valid & (self.seq_lens[row] == 0) & jnp.all(proper, axis=1)
        refcount = self.refcount.at[jnp.where(ok[:, None] & leading, pages, self.num_pages)].add(1, mode="drop")
        rows = jnp.where(ok, row, self.max_seqs)
        return dataclasses.replace(
            self,
            refcount=refcount,
            block_tables=self.block_tables.at[rows].set(pages, mode="drop"),
            seq_lens=self.seq_lens.at[rows].set(count * self.page_size, mode="drop"),
        ), ok

    # -- step inputs ------------------------------------------------------------------------

    def metadata(self, seq_ids: jax.Array, q_lens: jax.Array, max_q_len: int | None = None,
                 max_prefill_seqs: int | None = None) -> AttentionMetadata:
        """``AttentionMetadata`` for a step over sequences ``seq_ids`` with ``q_lens`` new tokens
        each (already counted in ``seq_lens`` by ``extend``), packed in this order.

        A row with an id outside ``[0, max_seqs)`` (padding, or a request ``extend`` refused,
        set to -1) keeps its tokens' place in the packing but has no keys: its rows come out
        zero and ``paged_attention``'s status flags them when it has tokens. Put decodes (q_len
        1) first: ``num_decodes`` counts the leading run of them, so a batch in another order is
        still correct, just served by the general path. ``max_q_len``, ``max_prefill_seqs``: None
        or an int >= 1 (``AttentionMetadata``'s static bounds).
        """
        for name, bound in (("max_q_len", max_q_len), ("max_prefill_seqs", max_prefill_seqs)):
            if bound is not None and not is_positive_int(bound):
                raise ValueError(f"PageTable.metadata: {name} must be None or an int >= 1, got {bound!r}")
        seq_ids, q_lens = self._check_requests("metadata", seq_ids, q_lens=q_lens)
        valid, row, q_lens = self._step_rows(seq_ids, q_lens)
        kv_lens = jnp.where(valid, self.seq_lens[row], 0)
        block_tables = jnp.where(valid[:, None], self.block_tables[row], 0)
        cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)])
        num_decodes = count_leading_decodes(q_lens)
        return AttentionMetadata(cu_q_lens, kv_lens, block_tables, num_decodes, max_q_len=max_q_len,
                                 max_prefill_seqs=max_prefill_seqs, page_size=self.page_size,
                                 num_pages=self.num_pages)

    def slot_mapping(self, seq_ids: jax.Array, q_lens: jax.Array, num_tokens: int) -> SlotMapping:
        """The cache slot of each packed new token (``SlotMapping``: int32[num_tokens] ``slots``,
        -1 for padding tokens, with this table's page size and pool size, which
        ``KVCache.write`` checks against the cache's).

        Token i of sequence s (in ``seq_ids`` order) sits at position ``seq_lens[s] - q_len + i``.
        Tokens of rows with an id outside ``[0, max_seqs)`` keep their place in the packing and
        get -1 (as in ``metadata``), as do tokens past a sequence's length.
        """
        check_sizes("PageTable.slot_mapping", num_tokens=num_tokens)
        seq_ids, q_lens = self._check_requests("slot_mapping", seq_ids, q_lens=q_lens)
        if seq_ids.shape[0] < 1:
            raise ValueError("PageTable.slot_mapping: seq_ids must have at least one row")
        valid, row, q_lens = self._step_rows(seq_ids, q_lens)
        ends = jnp.cumsum(q_lens, dtype=jnp.int32)
        token = jnp.arange(num_tokens, dtype=jnp.int32)
        seq = token_sequences(ends, num_tokens)
        seq_c = jnp.minimum(seq, seq_ids.shape[0] - 1)
        r = row[seq_c]
        pos = self.seq_lens[r] - q_lens[seq_c] + token - (ends[seq_c] - q_lens[seq_c])
        page_idx = jnp.clip(pos // self.page_size, 0, self.max_pages_per_seq - 1)
        page = self.block_tables[r, page_idx]
        ok = (seq < seq_ids.shape[0]) & valid[seq_c] & (pos >= 0) & (pos < self.seq_lens[r]) & (page > 0)
        slots = jnp.where(ok, page * self.page_size + pos % self.page_size, -1)
        return SlotMapping(slots, page_size=self.page_size, num_pages=self.num_pages)

    # -- helpers ----------------------------------------------------------------------------

    def _check_requests(self, where: str, ids: jax.Array, ids_name: str = "seq_ids",
                        **others: jax.Array) -> tuple[jax.Array, ...]:
        ids = int_array(f"PageTable.{where}", ids_name, ids, "int[N]")
        if ids.ndim != 1:
            raise ValueError(f"PageTable.{where}: {ids_name} must be int[N], got {ids.dtype}{list(ids.shape)}")
        return (ids, *(int_array(f"PageTable.{where}", name, value, f"int[{ids.shape[0]}] like the ids", ids.shape)
                       for name, value in others.items()))

    def _shrink(self, active: jax.Array, row: jax.Array, new_lens: jax.Array) -> tuple["PageTable", jax.Array]:
        """Sets rows ``row`` (where ``active``, no row twice) to ``new_lens`` tokens (no more than
        they have), dropping their pages past ``pages_for(new_lens)``: refcount - 1, and a page
        no one holds any more and not cached goes back to the free stack. Returns the table and
        the pages freed, int32[N * max_pages_per_seq] (-1 elsewhere)."""
        entries = self.block_tables[row]                                    # [N, MP]
        index = jnp.arange(self.max_pages_per_seq)[None, :]
        dropped = active[:, None] & (index >= pages_for(new_lens, self.page_size)[:, None])
        dropped &= (index < self.num_pages_held[row][:, None]) & (entries > 0)
        pages = jnp.where(dropped, entries, self.num_pages).reshape(-1)
        refcount = self.refcount.at[pages].add(-1, mode="drop")
        # A page freed by this call is pushed once, by its first entry.
        index = jnp.arange(pages.shape[0], dtype=jnp.int32)
        first = jnp.full((self.num_pages,), pages.shape[0], jnp.int32).at[pages].min(index, mode="drop")
        pages_c = jnp.minimum(pages, self.num_pages - 1)
        freed = (pages < self.num_pages) & (refcount[pages_c] == 0) & (first[pages_c] == index) & ~self.cached[pages_c]
        freed_pages = jnp.where(freed, pages, -1)
        table = self._push(freed_pages)
        rows = jnp.where(active, row, self.max_seqs)
        return dataclasses.replace(
            table,
            refcount=refcount,
            block_tables=table.block_tables.at[rows].set(jnp.where(dropped, 0, entries), mode="drop"),
            seq_lens=table.seq_lens.at[rows].set(new_lens, mode="drop"),
        ), freed_pages

    def _valid_ids(self, ids: jax.Array) -> jax.Array:
        """In range and not a repeat of an earlier entry."""
        return (ids >= 0) & (ids < self.max_seqs) & _first_occurrence(ids)

    def _page_ids(self, pages: jax.Array) -> jax.Array:
        """Pages that may be handed out: in ``[1, num_pages)``."""
        return (pages >= 1) & (pages < self.num_pages)

    def _step_rows(self, seq_ids: jax.Array, q_lens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(valid id, table row, q_lens >= 0) of each step row; every row keeps its tokens."""
        valid = (seq_ids >= 0) & (seq_ids < self.max_seqs)
        return valid, jnp.where(valid, seq_ids, 0), jnp.maximum(q_lens, 0)

    def _pop(self, need: jax.Array) -> tuple["PageTable", jax.Array]:
        """Pops ``need[i]`` pages for request i from the free stack -> int32[N, max_pages_per_seq]
        (0 past ``need[i]``). The caller guarantees ``sum(need) <= num_free``."""
        start = jnp.cumsum(need) - need
        j = jnp.arange(self.max_pages_per_seq)[None, :]
        depth = start[:, None] + j
        take = j < need[:, None]
        pages = jnp.where(take, self.free_pages[jnp.clip(self.num_free - 1 - depth, 0, self.num_pages - 1)], 0)
        refcount = self.refcount.at[jnp.where(take, pages, self.num_pages)].set(1, mode="drop")
        return dataclasses.replace(self, refcount=refcount, num_free=self.num_free - jnp.sum(need)), pages

    def _push(self, pages: jax.Array) -> "PageTable":
        """Pushes the pages >= 0 of ``pages`` onto the free stack."""
        push = pages >= 0
        pos = self.num_free + jnp.cumsum(push) - push
        free_pages = self.free_pages.at[jnp.where(push, pos, self.num_pages)].set(pages, mode="drop")
        return dataclasses.replace(self, free_pages=free_pages, num_free=self.num_free + jnp.sum(push, dtype=jnp.int32))


def _is_cache(x) -> bool:
    return isinstance(x, (KVCache, MLACache))


def _first_occurrence(ids: jax.Array) -> jax.Array:
    """bool[N]: entries that do not repeat an earlier one. An N x N comparison rather than a sort:
    one small fusion on the GPU for step-sized N."""
    earlier = jnp.tril(jnp.ones((ids.shape[0], ids.shape[0]), bool), k=-1)
    return ~jnp.any(earlier & (ids[:, None] == ids[None, :]), axis=1)


def _grant_in_order(need: jax.Array, num_free: jax.Array) -> jax.Array:
    """bool[N]: request i is granted when ``need[i]`` pages remain free after the granted requests
    before it. The scan is unrolled over N: a while loop would leave the step's command buffer."""
    def grant(free, n):
        granted = n <= free
        return free - jnp.where(granted, n, 0), granted

    return jax.lax.scan(grant, num_free, need, unroll=True)[1]

