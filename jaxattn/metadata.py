"""Per-step attention inputs: which query tokens belong to which sequence, and where its KV lives."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxattn.checks import INT32_MAX, check_sizes, is_positive_int

# A step whose ``max_q_len`` is 2..SPEC_DECODE_MAX_Q_LEN is a speculative-decode step (each sequence
# verifies up to that many draft tokens); backends may serve such steps with decode-style kernels.
SPEC_DECODE_MAX_Q_LEN = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Device arrays describing one step's batch (B sequences, T packed query tokens).

    Attributes:
      cu_q_lens: int32[B+1], offsets of each sequence's query tokens in ``q``; padded
        sequences repeat the last offset.
      kv_lens: int32[B], each sequence's KV length including this step's tokens.
      block_tables: int32[B, P], page ids of each sequence, in order (0 = null page).
      num_decodes: int32[], sequences ``[0, num_decodes)`` have exactly one query token.
      max_q_len: static bound on the longest query of the step (``None``: up to T; 1: a
        decode-only step; 2..``SPEC_DECODE_MAX_Q_LEN``: a speculative-decode step). Backends use
        it to size their work and choose kernels. A sequence with more query tokens breaks the
        step's contract (see ``validate``).
      max_prefill_seqs: static bound on the sequences with query tokens past the leading decodes
        (None: any number). Sequences ``[d, d + max_prefill_seqs)``, ``d`` the checked decode count
        (``checked_num_decodes``), may hold longer queries; a sequence after them with query tokens
        breaks the step's contract. A mixed step's prefill part then runs over that many
        sequences, not B (``mla_prefill`` expands K/V for those alone).
      page_size, num_pages: static, the page size and pool size of the ``PageTable`` that built
        it (None: not known, e.g. built directly). The attention ops raise ``ValueError`` when
        they differ from the cache's: page ids of one pool read in another are wrong answers.

    The values are data, checked on the device (``validate``): a sequence that breaks the
    contract gets zero output rows on every backend, never rows computed from other pages.
    """

    cu_q_lens: jax.Array
    kv_lens: jax.Array
    block_tables: jax.Array
    num_decodes: jax.Array
    max_q_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    max_prefill_seqs: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    page_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    num_pages: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def batch_size(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    @property
    def q_lens(self) -> jax.Array:
        """int32[B]: number of query tokens of each sequence."""
        return self.cu_q_lens[1:] - self.cu_q_lens[:-1]

    @property
    def checked_num_decodes(self) -> jax.Array:
        """int32[]: ``num_decodes`` capped by the leading run of one-token sequences, so a wrong
        count from a caller cannot send a longer query to a decode kernel; 0 unless the first
        sequence starts at token 0 (decode b is token b)."""
        leading = jnp.where(self.cu_q_lens[0] == 0, count_leading_decodes(self.q_lens), 0)
        return jnp.clip(self.num_decodes, 0, leading).astype(jnp.int32)

    def validate(self, num_tokens: int, num_pages: int, page_size: int) -> jax.Array:
        """bool[B], jittable: whether each sequence keeps the contract for ``q: [num_tokens, ...]``
        over a pool of ``num_pages`` pages of ``page_size`` tokens (see ``sanitize``)."""
        return self._sanitize("AttentionMetadata.validate", num_tokens, num_pages, page_size)[1]

    def sanitize(self, num_tokens: int, num_pages: int, page_size: int) -> tuple["AttentionMetadata", jax.Array]:
        """This metadata with every sequence that breaks the contract emptied, and which keep it.

        Sequence b keeps the contract when its offsets are in order (``cu_q_lens[b]`` and
        ``cu_q_lens[b+1]`` in ``[0, T]``, neither below an earlier offset), its query is at most
        ``max_q_len`` tokens, it is a decode or one of the ``max_prefill_seqs`` sequences after the
        decodes when it has tokens, ``q_len <= kv_lens[b] <= P * page_size``, and the pages covering its
        ``kv_lens[b]`` keys are in ``[1, num_pages)``. Padding sequences (no tokens, no keys)
        keep it. Returns ``(meta, valid)``: ``valid`` bool[B]; in ``meta`` the offsets are made
        non-decreasing within ``[0, T]`` (tokens keep their owner where it is unambiguous), a
        sequence that breaks the contract has ``kv_lens == 0`` (so every backend gives its rows
        zeros), and block-table entries past each sequence's keys repeat its first page (the
        null page for sequences without keys), so no kernel reads a page the sequence does not
        own because of a bad id or a stale entry.
        """
        return self._sanitize("AttentionMetadata.sanitize", num_tokens, num_pages, page_size)

    def _sanitize(self, where: str, num_tokens: int, num_pages: int,
                  page_size: int) -> tuple["AttentionMetadata", jax.Array]:
        check_sizes(where, num_tokens=num_tokens, num_pages=num_pages, page_size=page_size)
        cu_in = self.cu_q_lens
        cu = jnp.clip(jax.lax.cummax(cu_in), 0, num_tokens)
        q_lens = cu[1:] - cu[:-1]
        capacity = min(self.max_pages_per_seq * page_size, INT32_MAX)       # kv_lens are int32
        valid = (cu[:-1] == cu_in[:-1]) & (cu[1:] == cu_in[1:])
        valid &= (self.kv_lens >= q_lens) & (self.kv_lens <= capacity)
        if self.max_q_len is not None:
            valid &= q_lens <= self.max_q_len
        if self.max_prefill_seqs is not None:
            decodes = dataclasses.replace(self, cu_q_lens=cu).checked_num_decodes
            seq = jnp.arange(self.batch_size, dtype=jnp.int32)
            valid &= (q_lens == 0) | (seq < decodes + self.max_prefill_seqs)
        pages_used = pages_for(jnp.minimum(self.kv_lens, capacity), page_size)
        used = jnp.arange(self.max_pages_per_seq, dtype=jnp.int32)[None, :] < pages_used[:, None]
        tables = self.block_tables
        valid &= jnp.all(~used | ((tables >= 1) & (tables < num_pages)), axis=1)
        # Entries past a sequence's keys repeat its first page: a kernel whose key tile spans
        # several pages (cuDNN) still reads only the sequence's own pages, where the masked
        # keys' values are finite (0 * NaN from any other page would be NaN).
        own = jnp.where(valid & (pages_used > 0), tables[:, 0], 0)
        meta = dataclasses.replace(
            self,
            cu_q_lens=cu,
            kv_lens=jnp.where(valid, self.kv_lens, 0),
            block_tables=jnp.where(used & valid[:, None], tables, own[:, None]),
        )
        return meta, valid

    def token_to_seq(self, num_tokens: int) -> jax.Array:
        """int32[T]: the sequence each packed query token belongs to; B for padding tokens."""
        check_sizes("AttentionMetadata.token_to_seq", num_tokens=num_tokens)
        return token_sequences(self.cu_q_lens[1:], num_tokens)

    def positions(self, num_tokens: int) -> jax.Array:
        """int32[T]: absolute position of each query token in its sequence (e.g. for RoPE);
        0 for padding tokens."""
        check_sizes("AttentionMetadata.positions", num_tokens=num_tokens)
        seq = self.token_to_seq(num_tokens)
        b = jnp.minimum(seq, self.batch_size - 1)
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        pos = self.kv_lens[b] - self.q_lens[b] + t - self.cu_q_lens[b]
        return jnp.where(seq < self.batch_size, jnp.maximum(pos, 0), 0)


def token_sequences(ends: jax.Array, num_tokens: int) -> jax.Array:
    """int32[T]: the sequence of each packed token t, given each sequence's end offset ``ends``
    (int32[B], non-decreasing): how many ends are <= t, so B for tokens past the last end."""
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    # scan_unrolled: the default method is a while loop, which XLA's GPU command buffers do not
    # capture (it would split the step's graph and sync the host per iteration).
    return jnp.searchsorted(ends, token, side="right", method="scan_unrolled").astype(jnp.int32)


def count_leading_decodes(q_lens: jax.Array) -> jax.Array:
    """int32[]: how many sequences at the front of the batch have exactly one query token."""
    return jnp.sum(jnp.cumprod((q_lens == 1).astype(jnp.int32)), dtype=jnp.int32)


def pages_for(lens: jax.Array, page_size: int) -> jax.Array:
    """int32[...]: pages that hold ``lens`` tokens (negative lengths hold none). Without
    ``lens + page_size - 1``, which wraps in int32 for lengths near 2**31."""
    lens = jnp.maximum(lens, 0)
    return lens // page_size + (lens % page_size > 0).astype(lens.dtype)


def check_metadata(where: str, meta: AttentionMetadata, cache) -> None:
    """ValueError (prefixed by ``where``) unless ``meta`` has consistent shapes, int32 arrays and
    a valid ``max_q_len``, and was built for ``cache``'s pool (a ``KVCache`` or ``MLACache``: page
    size, pool size) when it says."""
    if not isinstance(meta, AttentionMetadata):
        raise ValueError(f"{where}: meta must be a jaxattn.AttentionMetadata, got {type(meta).__name__}")
    for field in ("cu_q_lens", "kv_lens", "block_tables", "num_decodes"):
        value = getattr(meta, field)
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise ValueError(f"{where}: meta.{field} must be an int32 array, got {type(value).__name__}")
    if meta.kv_lens.ndim != 1 or meta.kv_lens.shape[0] < 1:
        raise ValueError(f"{where}: meta.kv_lens must have shape [B] with B >= 1, got {list(meta.kv_lens.shape)}")
    batch = meta.kv_lens.shape[0]
    for field, shape in (("cu_q_lens", (batch + 1,)), ("num_decodes", ())):
        value = getattr(meta, field)
        if value.shape != shape:
            raise ValueError(f"{where}: meta.{field} must have shape {list(shape)} (B={batch}), "
                             f"got {list(value.shape)}")
    if meta.block_tables.ndim != 2 or meta.block_tables.shape[0] != batch or meta.block_tables.shape[1] < 1:
        raise ValueError(f"{where}: meta.block_tables must be [B={batch}, P], got {list(meta.block_tables.shape)} "
                         f"(P >= 1)")
    for field in ("cu_q_lens", "kv_lens", "block_tables", "num_decodes"):
        dtype = getattr(meta, field).dtype
        if dtype != jnp.int32:
            raise ValueError(f"{where}: meta.{field} must be int32, got {dtype}")
    for field in ("max_q_len", "max_prefill_seqs", "page_size", "num_pages"):
        value = getattr(meta, field)
        if value is not None and not is_positive_int(value):
            raise ValueError(f"{where}: meta.{field} must be None or an int >= 1, got {value!r} (below 2**31)")
    for field in ("page_size", "num_pages"):
        built_for, actual = getattr(meta, field), getattr(cache, field)
        if built_for is not None and built_for != actual:
            raise ValueError(f"{where}: meta was built by a PageTable with {field}={built_for}, but the cache has "
                             f"{field}={actual}; the page table and the cache must describe the same pool")
