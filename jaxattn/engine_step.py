"""The engine's device step: one jitted function per model structure, and the packing of a
``jaxattn.scheduler.Schedule`` into its operands.

The step frees finished sequences, runs prefix caching's page operations, allocates pages, writes
K/V, runs attention in every layer and samples the next tokens, over donated KV caches and page
table. Only two step shapes exist (decode-only: ``max_seqs`` tokens, ``max_q_len`` 1; mixed:
``max_seqs + chunk_size`` tokens, ``max_q_len`` ``chunk_size``), so a serving loop compiles twice
and then replays.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxattn
from jaxattn.models.base import Cache, PagedModel
from jaxattn.sampling import SamplingBatch, sample
from jaxattn.scheduler import Schedule


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixOps:
    """One step's prefix-caching operations on the page table (-1 / 0 padding).

    Attributes:
      mark: int32[M], pages to mark cached (``PageTable.mark_cached``).
      evict: int32[M], cached pages to free (``PageTable.evict``).
      attach: int32[B, P], cached pages each step row's new sequence starts on (``PageTable.attach``).
    """

    mark: jax.Array
    evict: jax.Array
    attach: jax.Array


StepFn = Callable[..., tuple[jax.Array, jax.Array, list[Cache], jaxattn.PageTable]]


def make_engine_step(model: PagedModel) -> tuple[StepFn, list[jax.Array]]:
    """The jitted engine step for ``model`` (an ``nnx.Module``), and the model's weights as the
    flat list it takes.

    ``step(weights, caches, table, release_ids, tokens, seq_ids, q_lens, sampling=None, prefix=None,
    *, max_q_len, backend)`` frees ``release_ids``, appends ``q_lens`` tokens to sequences
    ``seq_ids`` (int32[B], decodes first, -1 padding; ``tokens`` int32[T] packed) and returns (next
    token per row int32[B], ok bool[B], caches, table); caches and table are donated. Rows sample
    with ``sampling`` (a ``SamplingBatch``; None: greedy). ``prefix`` (``PrefixOps``) marks pages
    cached before the release, then evicts pages and attaches cached pages to new sequences before
    the extend. The model's structure is closed over rather than passed, so a call neither hashes
    it nor flattens its state: that cut the host time of an 8-layer step from 2.4 to 0.6 ms
    (measured on CPU).
    """
    graphdef, state = nnx.split(model)
    weights, treedef = jax.tree.flatten(state)
    return _jitted_step(graphdef, treedef), weights


@functools.cache
def _jitted_step(graphdef: nnx.GraphDef, treedef) -> StepFn:
    """One jitted step per model structure, shared by engines (and their compile caches)."""

    @functools.partial(jax.jit, static_argnames=("max_q_len", "backend"), donate_argnames=("caches", "table"))
    def step(weights, caches, table, release_ids, tokens, seq_ids, q_lens, sampling=None, prefix=None, *,
             max_q_len: int, backend: str):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
        if prefix is not None:
            table = table.mark_cached(prefix.mark)
        table = table.release(release_ids)
        if prefix is not None:
            table = table.evict(prefix.evict)
            attach_ids = jnp.where(jnp.any(prefix.attach != 0, axis=1), seq_ids, -1)
            table, attached = table.attach(attach_ids, prefix.attach)
        table, ok = table.extend(seq_ids, table.seq_lens[jnp.maximum(seq_ids, 0)] + q_lens)
        if prefix is not None:
            ok &= attached | (attach_ids < 0)
        seq_ids = jnp.where(ok, seq_ids, -1)        # refused: its tokens stay in place as padding
        meta = table.metadata(seq_ids, q_lens, max_q_len=max_q_len)
        slots = table.slot_mapping(seq_ids, q_lens, tokens.shape[0])
        hidden, caches = model.forward_paged(tokens, caches, meta, slots, backend)
        last = jnp.maximum(meta.cu_q_lens[1:] - 1, 0)
        logits = model.logits(hidden[last])
        if sampling is None:
            next_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:   # the sampled token's position seeds its random numbers
            next_tokens = sample(logits, sampling, meta.kv_lens)
        return next_tokens, ok, caches, table

    return step


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The host operands of one step (``make_engine_step``'s), B = ``max_seqs`` rows.

    Attributes:
      release_ids: int32[B], slots to free (-1 padding).
      tokens: int32[T], the rows' tokens packed (T = B, or B + chunk_size in a mixed step).
      seq_ids: int32[B], each row's slot (-1 padding); q_lens: int32[B], its token count.
      sampling: per-row sampling parameters and seeds.
      prefix: prefix caching's page operations.
      max_q_len: 1 (decode-only step) or chunk_size (mixed step).
    """

    release_ids: np.ndarray
    tokens: np.ndarray
    seq_ids: np.ndarray
    q_lens: np.ndarray
    sampling: SamplingBatch
    prefix: PrefixOps
    max_q_len: int


def _padded(values: list[int], size: int) -> np.ndarray:
    """int32[size]: ``values``, then -1."""
    out = np.full(size, -1, np.int32)
    out[:len(values)] = values
    return out


def pack_step(schedule: Schedule, *, max_seqs: int, chunk_size: int, page_size: int, max_pages_per_seq: int,
              step_pages: int) -> StepInputs:
    """The operands of the step that runs ``schedule``; ``step_pages`` is the fixed length of the
    mark and evict lists (the most pages one step may cache or evict)."""
    rows = schedule.rows
    num_tokens = max_seqs + chunk_size if schedule.mixed else max_seqs
    tokens = np.zeros(num_tokens, np.int32)
    seq_ids = np.full(max_seqs, -1, np.int32)
    q_lens = np.zeros(max_seqs, np.int32)
    attach = np.zeros((max_seqs, max_pages_per_seq), np.int32)
    offset = 0
    for i, (r, count) in enumerate(rows):
        seq_ids[i], q_lens[i] = r.slot, count
        tokens[offset:offset + count] = r.tokens_between(r.computed, r.computed + count)
        offset += count
        if r in schedule.admitted:
            cached = r.computed // page_size
            attach[i, :cached] = r.blocks[:cached]
    padding = [None] * (max_seqs - len(rows))
    sampling = SamplingBatch.from_params([r.sampling for r, _ in rows] + padding,
                                         [r.seed for r, _ in rows] + [0] * len(padding))
    prefix = PrefixOps(mark=_padded(schedule.mark, step_pages), evict=_padded(schedule.evicted, step_pages),
                       attach=attach)
    return StepInputs(_padded(schedule.release, max_seqs), tokens, seq_ids, q_lens, sampling, prefix,
                      max_q_len=chunk_size if schedule.mixed else 1)
