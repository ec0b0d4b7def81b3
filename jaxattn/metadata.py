"""Per-step attention inputs: which query tokens belong to which sequence, and where its KV lives."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
        decode-only step). Backends use it to size their work and choose kernels. It is a
        promise: tokens of a sequence past the bound may not be computed (the ``xla`` backend
        returns zeros for them).
    """

    cu_q_lens: jax.Array
    kv_lens: jax.Array
    block_tables: jax.Array
    num_decodes: jax.Array
    max_q_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))

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
        count from a caller cannot send a longer query to a decode kernel."""
        return jnp.clip(self.num_decodes, 0, count_leading_decodes(self.q_lens)).astype(jnp.int32)

    def token_to_seq(self, num_tokens: int) -> jax.Array:
        """int32[T]: the sequence each packed query token belongs to; B for padding tokens."""
        return token_sequences(self.cu_q_lens[1:], num_tokens)

    def positions(self, num_tokens: int) -> jax.Array:
        """int32[T]: absolute position of each query token in its sequence (e.g. for RoPE);
        0 for padding tokens."""
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
