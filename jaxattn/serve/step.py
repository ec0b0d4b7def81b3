"""The engine's device step: one jitted function per model structure, the shapes it is compiled
for, the packing of a ``jaxattn.serve.scheduler.Schedule`` into its operands, and the ``StepRunner``
that holds the device state the step runs over.

The step frees finished sequences, runs prefix caching's page operations, allocates pages, writes
K/V, runs attention in every layer and samples the next tokens, over donated KV caches and page
table. A decode row's input may be the token the previous step sampled, still on the device
(``token_src``), so the host schedules step n+1 while step n runs. Step shapes come from two
bucket lists (``StepBuckets``): a decode-only step has as many rows and tokens as the smallest
row bucket that holds its rows (one bucket up to 256 rows); a mixed step has ``max_seqs`` rows
and the smallest token bucket that holds its tokens. A serving loop compiles one step per bucket
(``Engine.warmup``), per sampling mode (greedy steps skip the sampler) and with and without
logprobs (steps with no row asking for them skip them), and then replays.

A step with a row that samples under a grammar (structured output) is launched in two parts: the
step proper, which returns its rows' logits, and, once the host has the tokens of the step before
(so each grammar holds every token before this step's), ``pick_tokens`` over those logits with
the grammars' token masks (``StepRunner.pick``). The host fills the masks while the GPU runs the
step proper: the overlap keeps rows under a grammar in every step. The step proper is compiled
once per shape for this, and ``pick_tokens`` once per row count and sampling mode.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxattn
from jaxattn.metadata import token_sequences
from jaxattn.serve.models.base import Cache, PagedModel
from jaxattn.serve.sampling import SamplingBatch, SamplingParams, mask_logits, sample, token_logprobs
from jaxattn.serve.scheduler import Request, Schedule
from jaxattn.serve.speculative import SpeculativeConfig, ngram_drafts, oracle_drafts, verify_drafts
from jaxattn.serve.structured_output import Grammar, fill_masks, mask_words
from jaxattn.sharding import tensor_parallel_mesh

# The engine's own log (the warm-up's compiles); a handler on the root logger (``logging.basicConfig``,
# as ``jaxattn.serve``'s command line sets up) shows its INFO records.
logger = logging.getLogger("jaxattn.serve.engine")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixOps:
    """One step's prefix-caching operations on the page table (-1 / 0 padding).

    Attributes:
      mark: int32[M], pages to mark cached (``PageTable.mark_cached``).
      evict: int32[M], cached pages to free (``PageTable.evict``).
      attach: int32[R, P], cached pages each step row's new sequence starts on (``PageTable.attach``).
    """

    mark: jax.Array
    evict: jax.Array
    attach: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
    """A speculating engine's device state, by sequence slot (C: the page table's tokens per sequence).

    Attributes:
      history: int32[max_seqs, C], each sequence's tokens by position (its computed tokens and the
        one sampled last), what ``speculative.ngram_drafts`` looks up.
      next_inputs: int32[max_seqs, K + 1], each sequence's token sampled last and the K drafts that
        follow it: a speculating row's inputs in the next step.
      caches: the draft model's caches, one per layer, over the engine's page table (method
        "draft_model"; else None).
    """

    history: jax.Array
    next_inputs: jax.Array
    caches: list[Cache] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecRows:
    """One step's speculating rows: ``src`` int32[T], where >= 0 the packed token is
    ``DraftState.next_inputs.reshape(-1)[src]``; ``rows`` bool[R], the rows that verify drafts;
    ``samples`` bool[R], the rows that sample (a draft model drafts after them)."""

    src: jax.Array
    rows: jax.Array
    samples: jax.Array

    @classmethod
    def none(cls, shape: "StepShape") -> "SpecRows":
        """Host arrays for a step of ``shape`` with no row speculating or sampling (filled in by ``pack_step``)."""
        return cls(np.full(shape.tokens, -1, np.int32), np.zeros(shape.rows, bool), np.zeros(shape.rows, bool))


StepFn = Callable[..., tuple[tuple[jax.Array, ...], jax.Array, jax.Array, list[Cache], jaxattn.PageTable,
                             DraftState | None]]


def make_engine_step(model: PagedModel, draft: PagedModel | None = None) -> tuple[StepFn, list[jax.Array]]:
    """The jitted engine step for ``model`` (an ``nnx.Module``; ``draft``: a speculating engine's
    draft model), and the models' weights as the flat list it takes (the model's, then the draft's).

    ``step(weights, caches, table, prev_tokens, release_ids, tokens, token_src, seq_ids, q_lens,
    sampling=None, prefix=None, drafting=None, spec=None, *, max_q_len, backend, logprobs=False,
    deferred=False, drafter=None, max_prefill_seqs=None)`` frees ``release_ids`` (int32[max_seqs], -1 padding), appends
    ``q_lens`` tokens to sequences ``seq_ids`` (int32[R], decodes first, -1 padding) and returns
    ``(picked, ok, pages, caches, table, drafting)``; caches, table and drafting are donated.
    ``picked`` is ``pick_tokens``' ``(next_tokens, step_logprobs)``, or with ``deferred`` what it
    takes: ``(logits [R, V], positions int32[R])``. With a ``drafter`` (a
    ``speculative.SpeculativeConfig``; ``drafting`` its ``DraftState``, ``spec`` the step's
    ``SpecRows``), ``picked`` adds ``(tokens int32[R, K + 1], accepted int32[R])``
    (``speculative.verify_drafts``), the speculating rows' sequences are cut back to their kept
    tokens, and every row that samples proposes its next drafts (a draft model computes its K/V
    for the step's tokens, then drafts K tokens greedily, one pass each, over pages it takes
    past the row's tokens and gives back).
    ``tokens`` (int32[T]) are the rows' tokens packed; where ``token_src`` (int32[T]) is >= 0 the
    token is ``prev_tokens[token_src]`` instead (``prev_tokens``: the previous step's
    ``next_tokens``). Outputs: ``ok`` bool[R], its
    pages were granted; ``pages`` int32[R, W], each row's page ids from the page of its first token
    on (0 past its pages; W = ``page_window(max_q_len, page_size)``). Rows sample with ``sampling``
    (a ``SamplingBatch``; None: greedy). ``prefix`` (``PrefixOps``) marks pages cached
    before the release, then evicts pages and attaches cached pages to new sequences before the
    extend. The model's structure is closed over rather than passed, so a call neither hashes it
    nor flattens its state: that cut the host time of an 8-layer step from 2.4 to 0.6 ms
    (measured on CPU).
    """
    graphdef, state = nnx.split(model)
    weights, treedef = jax.tree.flatten(state)
    if draft is None:
        return _jitted_step(graphdef, treedef), weights
    draft_graphdef, draft_state = nnx.split(draft)
    draft_weights, draft_treedef = jax.tree.flatten(draft_state)
    return _jitted_step(graphdef, treedef, draft_graphdef, draft_treedef), weights + draft_weights


@functools.cache
def _jitted_step(graphdef: nnx.GraphDef, treedef, draft_graphdef: nnx.GraphDef | None = None,
                 draft_treedef=None) -> StepFn:
    """One jitted step per model structure (and draft model's), shared by engines (and their
    compile caches)."""

    @functools.partial(jax.jit, static_argnames=("max_q_len", "max_prefill_seqs", "backend", "logprobs", "deferred",
                                                 "drafter"),
                       donate_argnames=("caches", "table", "drafting"))
    def step(weights, caches, table, prev_tokens, release_ids, tokens, token_src, seq_ids, q_lens, sampling=None,
             prefix=None, drafting=None, spec=None, *, max_q_len: int, backend: str, logprobs: bool = False,
             deferred: bool = False, drafter: SpeculativeConfig | None = None, max_prefill_seqs: int | None = None):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights[:treedef.num_leaves]))
        draft = None
        if draft_graphdef is not None:
            draft = nnx.merge(draft_graphdef, jax.tree.unflatten(draft_treedef, weights[treedef.num_leaves:]))
        tokens = jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], tokens)
        if drafter is not None:
            tokens = jnp.where(spec.src >= 0, drafting.next_inputs.reshape(-1)[jnp.maximum(spec.src, 0)], tokens)
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
        meta = table.metadata(seq_ids, q_lens, max_q_len=max_q_len, max_prefill_seqs=max_prefill_seqs)
        slots = table.slot_mapping(seq_ids, q_lens, tokens.shape[0])
        hidden, caches = model.forward_paged(tokens, caches, meta, slots, backend)
        pages = _row_pages(table, seq_ids, q_lens, page_window(max_q_len, table.page_size))
        if drafter is not None:
            drafting = _record_inputs(drafting, tokens, seq_ids, meta)
        if draft is not None:           # the draft model's K/V of every token the step computes
            _, draft_caches = draft.forward_paged(tokens, drafting.caches, meta, slots, backend)
            drafting = dataclasses.replace(drafting, caches=draft_caches)
        if deferred or drafter is None:
            last = jnp.maximum(meta.cu_q_lens[1:] - 1, 0)
            logits = model.logits(hidden[last])
            if deferred:
                picked = (logits, meta.kv_lens)
            else:
                picked = _pick(logits, meta.kv_lens, sampling, None, max_seqs=table.max_seqs, logprobs=logprobs)
            return picked, ok, pages, caches, table, drafting
        picked, table, drafting = _verify(model, hidden, tokens, seq_ids, meta, sampling, table, drafting,
                                          spec.rows & (seq_ids >= 0), drafter, logprobs=logprobs)
        if draft is not None:
            drafts, table, draft_caches = _draft_greedily(draft, table, drafting.caches, drafting.next_inputs,
                                                          jnp.where(spec.samples, seq_ids, -1), drafter.num_drafts,
                                                          backend)
            drafting = dataclasses.replace(drafting, caches=draft_caches, next_inputs=drafts)
        return picked, ok, pages, caches, table, drafting

    return step


def _record_inputs(drafting: DraftState, tokens: jax.Array, seq_ids: jax.Array, meta) -> DraftState:
    """``drafting`` with the step's packed ``tokens`` written into ``history`` at their positions."""
    ends = meta.cu_q_lens[1:]
    token = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    seq = jnp.minimum(token_sequences(ends, tokens.shape[0]), seq_ids.shape[0] - 1)
    position = meta.kv_lens[seq] - ends[seq] + token
    rows = jnp.where((seq_ids[seq] >= 0) & (token < ends[seq]), seq_ids[seq], drafting.history.shape[0])
    return dataclasses.replace(drafting, history=drafting.history.at[rows, position].set(tokens, mode="drop"))


def _verify(model: PagedModel, hidden: jax.Array, tokens: jax.Array, seq_ids: jax.Array, meta,
            sampling: SamplingBatch | None, table: jaxattn.PageTable, drafting: DraftState, speculating: jax.Array,
            drafter: SpeculativeConfig, *, logprobs: bool) -> tuple[tuple, jaxattn.PageTable, DraftState]:
    """A speculating step's tokens: each row's last K + 1 logits verify its drafts (the other rows
    pick from their last, as without speculation), the speculating sequences are cut back to the
    tokens they keep, and each row's next token and next drafts are recorded in ``drafting``.
    Returns ``((next_tokens int32[max_seqs], step_logprobs, tokens int32[R, K + 1], accepted
    int32[R]), table, drafting)``."""
    k = drafter.num_drafts
    rows = seq_ids.shape[0]
    window = jnp.maximum(meta.cu_q_lens[1:, None] - (k + 1) + jnp.arange(k + 1)[None, :], 0)      # [R, K + 1]
    logits = model.logits(hidden[window.reshape(-1)]).reshape(rows, k + 1, -1)
    positions = meta.kv_lens[:, None] - k + jnp.arange(k + 1)[None, :]
    out, accepted, next_tokens = verify_drafts(logits, tokens[window[:, 1:]], speculating, sampling, positions)
    lengths = meta.kv_lens - jnp.where(speculating, k - accepted, 0)
    table, _ = table.truncate(jnp.where(speculating, seq_ids, -1), lengths)
    slot = jnp.where(seq_ids >= 0, seq_ids, table.max_seqs)
    history = drafting.history.at[slot, lengths].set(next_tokens, mode="drop")
    history_rows, known = history[jnp.maximum(seq_ids, 0)], jnp.minimum(lengths + 1, history.shape[1])
    if drafter.method == "oracle":
        drafts = oracle_drafts(history_rows, known, num_drafts=k)
    elif drafter.method == "ngram":
        drafts = ngram_drafts(history_rows, known, num_drafts=k, min_n=drafter.prompt_lookup_min,
                              max_n=drafter.prompt_lookup_max)
    else:                                           # a draft model's, drafted by the caller
        drafts = jnp.zeros((rows, k), jnp.int32)
    next_inputs = drafting.next_inputs.at[slot].set(jnp.concatenate([next_tokens[:, None], drafts], axis=1),
                                                    mode="drop")
    step_logprobs = token_logprobs(logits[:, k], next_tokens) if logprobs else None
    padded = jnp.zeros((table.max_seqs,), jnp.int32).at[:rows].set(next_tokens)
    return (padded, step_logprobs, out, accepted), table, DraftState(history, next_inputs, drafting.caches)


def _draft_greedily(draft: PagedModel, table: jaxattn.PageTable, caches: list[Cache], next_inputs: jax.Array,
                    seq_ids: jax.Array, k: int, backend: str) -> tuple[jax.Array, jaxattn.PageTable, list[Cache]]:
    """The draft model's K greedy tokens after each sequence ``seq_ids`` (int32[R], -1: none)
    and its token sampled last (``next_inputs[:, 0]``): K decode passes of the draft, each
    writing its K/V on pages taken past the sequence's tokens, which are given back after (the
    next step computes the K/V of the tokens it keeps again). Returns ``(next_inputs with the
    drafts, table, caches)``."""
    rows = jnp.maximum(seq_ids, 0)
    lengths = table.seq_lens[rows]
    ones = jnp.ones_like(seq_ids)
    token = next_inputs[rows, 0]
    drafts = []
    for j in range(k):
        table, ok = table.extend(seq_ids, lengths + j + 1)
        ids = jnp.where(ok, seq_ids, -1)
        meta = table.metadata(ids, ones, max_q_len=1)
        hidden, caches = draft.forward_paged(token, caches, meta, table.slot_mapping(ids, ones, ids.shape[0]), backend)
        token = jnp.argmax(draft.logits(hidden), axis=-1).astype(jnp.int32)
        drafts.append(token)
    table, _ = table.truncate(seq_ids, lengths)
    slot = jnp.where(seq_ids >= 0, seq_ids, table.max_seqs)
    return next_inputs.at[slot, 1:].set(jnp.stack(drafts, axis=1), mode="drop"), table, caches


def _pick(logits: jax.Array, positions: jax.Array, sampling: SamplingBatch | None, allowed: jax.Array | None, *,
          max_seqs: int, logprobs: bool) -> tuple[jax.Array, tuple[jax.Array, ...] | None]:
    """The rows' next tokens from their ``logits`` [R, V]: int32[max_seqs] (0 past R), sampled
    with ``sampling`` (None: greedy; ``positions`` int32[R], each token's position, seeds its
    random numbers) among the tokens ``allowed`` (int32[R, ceil(V / 32)] bitmasks,
    ``sampling.mask_logits``; None: all); with ``logprobs``, each row's
    ``sampling.token_logprobs`` of its token (the model's, before the mask), else None."""
    candidates = logits if allowed is None else mask_logits(logits, allowed)
    if sampling is None:
        next_tokens = jnp.argmax(candidates, axis=-1).astype(jnp.int32)
    else:
        next_tokens = sample(candidates, sampling, positions)
    step_logprobs = token_logprobs(logits, next_tokens) if logprobs else None
    return jnp.zeros((max_seqs,), jnp.int32).at[:next_tokens.shape[0]].set(next_tokens), step_logprobs


# A deferred step's tokens, picked among its grammars' tokens (the second part of its launch).
pick_tokens = jax.jit(_pick, static_argnames=("max_seqs", "logprobs"))


def page_window(max_q_len: int, page_size: int) -> int:
    """Pages a row of at most ``max_q_len`` new tokens can touch."""
    return 1 if max_q_len == 1 else -(-max_q_len // page_size) + 1


def _row_pages(table: jaxattn.PageTable, seq_ids: jax.Array, q_lens: jax.Array, window: int) -> jax.Array:
    """int32[R, window]: each row's page ids from the page holding its first new token on."""
    rows = jnp.maximum(seq_ids, 0)
    first = (table.seq_lens[rows] - q_lens) // table.page_size
    cols = first[:, None] + jnp.arange(window)[None, :]
    pages = table.block_tables[rows[:, None], jnp.minimum(cols, table.max_pages_per_seq - 1)]
    return jnp.where((seq_ids[:, None] >= 0) & (cols < table.max_pages_per_seq), pages, 0)


def buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """``smallest``, doubling while below ``largest``, then ``largest`` (``(largest,)`` when
    ``smallest >= largest``)."""
    sizes = []
    while smallest < largest:
        sizes.append(smallest)
        smallest *= 2
    return (*sizes, largest)


ROWS_BUCKET_FROM = 128      # the smallest decode-only step of an engine of more rows
MIXED_TOKENS_STEP = 128       # the prompt tokens a mixed step's second bucket adds to a batch of decodes


def mixed_buckets(decodes: int, largest: int, step: int = MIXED_TOKENS_STEP) -> tuple[int, ...]:
    """``decodes``, then ``decodes`` + ``step``, + 2 ``step``, + 4 ``step``, ... while below
    ``largest``, then ``largest``: a mixed step holds a batch of decodes and prompt chunks, so its
    prompt part grows by doubling."""
    sizes, grow = [], step
    while decodes < largest:
        sizes.append(decodes)
        decodes, grow = sizes[0] + grow, grow * 2
    return (*sizes, largest)


@dataclasses.dataclass(frozen=True)
class StepShape:
    """A compiled step's static shape: ``rows`` (R), ``tokens`` (T), ``max_q_len`` (1:
    decode-only) and ``max_prefill_seqs`` (the rows of more than one token a mixed step may hold,
    ``AttentionMetadata.max_prefill_seqs``; None: any)."""

    rows: int
    tokens: int
    max_q_len: int
    max_prefill_seqs: int | None = None


@dataclasses.dataclass(frozen=True)
class StepBuckets:
    """The step shapes an engine compiles: decode-only steps of ``rows`` rows and tokens, mixed
    steps of ``max_seqs`` rows and ``tokens`` tokens (each list ascending), whose rows hold at most
    ``prefill_chunk`` tokens (their static ``max_q_len``: prefill kernels launch work per row and
    per tile of ``max_q_len``, so a bound far below the step's tokens keeps a mixed step of a few
    hundred rows from launching mostly empty tiles)."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    prefill_chunk: int | None = None      # the longest row of a mixed step (its max_q_len); None: its tokens
    draft_tokens: int = 0                 # K of a speculating engine: its decode steps have rows of K + 1 tokens
    max_prefill_seqs: int | None = None   # the prompt chunks of a mixed step, at most; None: any number

    @classmethod
    def default(cls, max_seqs: int, max_step_tokens: int, prefill_chunk: int | None = None,
                draft_tokens: int = 0, max_prefill_seqs: int | None = None) -> "StepBuckets":
        """Rows ``ROWS_BUCKET_FROM`` (128), doubling, up to ``max_seqs``; tokens ``mixed_buckets``
        from ``max(max_seqs, 64)`` up to ``max_step_tokens``. Padding rows cost attention nothing,
        and below the GPU's ridge (about 270 rows of bf16 weights on an H100, 190 on an H200) a
        decode step's GEMMs read the weights in the same time whatever the rows; above it they grow
        with the rows: Llama-3-8B's decode step on an H200 spent 4.36 ms in GEMMs at 128 rows and
        5.86 ms at 256 (benchmarks/RESULTS.md, step_profile_rows), where chat-like traffic runs
        decode-only steps of 87 rows on average. Smaller buckets would add compiles (10-70 s each
        at 8B) for no GEMM time. A mixed step is mostly a full batch of decodes plus a few hundred
        prompt tokens (and compute-bound there): on the chat trace (benchmarks/step_padding.py, the
        scheduler replayed as the H100 run of 2026-11-27 served it) tokens doubling from
        ``max_seqs`` left 29.9% of the mixed steps' tokens as padding, ``mixed_buckets`` 19.6% with
        one shape more.
        With ``draft_tokens`` K, a decode step of b rows has room for b (K + 1) tokens."""
        return cls(buckets(ROWS_BUCKET_FROM, max_seqs) if max_seqs > ROWS_BUCKET_FROM else (max_seqs,),
                   mixed_buckets(max(max_seqs, 64), max_step_tokens), prefill_chunk, draft_tokens, max_prefill_seqs)

    def _shape(self, rows: int, tokens: int, max_q_len: int) -> StepShape:
        if max_q_len > 1 and self.prefill_chunk:
            max_q_len = min(max_q_len, self.prefill_chunk)
        return StepShape(rows, tokens, max_q_len, self.max_prefill_seqs)

    def shape(self, schedule: Schedule) -> StepShape:
        """The shape that runs ``schedule``: the smallest bucket that holds it."""
        if not schedule.mixed:
            return self._decode_shape(next(b for b in self.rows if b >= len(schedule.rows)))
        tokens = next(b for b in self.tokens if b >= schedule.num_tokens)
        return self._shape(self.rows[-1], tokens, tokens)

    def _decode_shape(self, rows: int) -> StepShape:
        width = 1 + self.draft_tokens
        return StepShape(rows, rows * width, width)

    @property
    def shapes(self) -> list[StepShape]:
        """Every shape, decode-only then mixed."""
        return [self._decode_shape(b) for b in self.rows] + [self._shape(self.rows[-1], b, b) for b in self.tokens]


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The host operands of one step (``make_engine_step``'s) of shape ``shape`` (R rows, T tokens).

    Attributes:
      release_ids: int32[max_seqs], slots to free (-1 padding).
      tokens: int32[T], the rows' tokens packed; token_src: int32[T], where >= 0 the token is the
        previous step's ``next_tokens[token_src]`` (a decode whose input is not on the host yet).
      seq_ids: int32[R], each row's slot (-1 padding); q_lens: int32[R], its token count.
      sampling: per-row sampling parameters, seeds and banned tokens; None when every row is
        greedy and none holds its stop tokens back (``min_tokens``).
      prefix: prefix caching's page operations (None without prefix caching).
      logprobs: a row asks for its token's logprobs (the step computes them for every row).
      grammars: ``(grammar, row)`` of each row that samples under a grammar.
      deferred: the step's tokens are picked apart (``StepRunner.pick``): it has such a row.
      spec: the speculating rows and where their tokens come from (a speculating engine's; else None).
    """

    shape: StepShape
    release_ids: np.ndarray
    tokens: np.ndarray
    token_src: np.ndarray
    seq_ids: np.ndarray
    q_lens: np.ndarray
    sampling: SamplingBatch | None
    prefix: PrefixOps | None
    logprobs: bool = False
    grammars: list[tuple[Grammar, int]] = dataclasses.field(default_factory=list)
    deferred: bool = False
    spec: SpecRows | None = None


def _padded(values: list[int], size: int) -> np.ndarray:
    """int32[size]: ``values``, then -1."""
    out = np.full(size, -1, np.int32)
    out[:len(values)] = values
    return out


def pack_step(schedule: Schedule, shape: StepShape, *, max_seqs: int, page_size: int, max_pages_per_seq: int,
              step_pages: int | None, previous_rows: Mapping[Request, int], draft_tokens: int | None = None
              ) -> StepInputs:
    """The operands of the step that runs ``schedule`` at ``shape``. ``step_pages`` is the fixed
    length of the mark and evict lists (the most pages one step may cache or evict; None:
    no prefix caching); ``previous_rows`` maps the requests of the previous step's sampling rows
    to their row there (where a pending token comes from); ``draft_tokens``: K of a speculating
    engine (its rows with drafts take their K + 1 tokens from ``DraftState.next_inputs``)."""
    tokens = np.zeros(shape.tokens, np.int32)
    token_src = np.full(shape.tokens, -1, np.int32)
    seq_ids = np.full(shape.rows, -1, np.int32)
    q_lens = np.zeros(shape.rows, np.int32)
    spec = None
    if draft_tokens is not None:
        spec = SpecRows.none(shape)
    offset = 0
    for i, row in enumerate(schedule.rows):
        r = row.request
        seq_ids[i], q_lens[i] = r.slot, row.count
        if spec is not None:
            spec.samples[i] = row.samples
        if row.drafts:
            spec.src[offset:offset + row.count] = r.slot * (draft_tokens + 1) + np.arange(row.count)
            spec.rows[i] = True
            offset += row.count
            continue
        known = min(row.start + row.count, r.num_known) - row.start
        if known > 0:
            tokens[offset:offset + known] = r.tokens_between(row.start, row.start + known)
        if known < row.count:       # the token the previous step sampled, still on the device
            token_src[offset + known] = previous_rows[r]
        offset += row.count
    sampled = [row.request.sampling for row in schedule.rows]
    logprobs = any(row.samples and row.request.sampling.logprobs is not None for row in schedule.rows)
    # outputs before the token each row samples (its own is pending already)
    generated = [len(row.request.output) + row.request.pending - row.samples for row in schedule.rows]
    held_back = any(row.samples and n < row.request.sampling.min_tokens for row, n in zip(schedule.rows, generated))
    grammars = [(row.request.grammar, i) for i, row in enumerate(schedule.rows)
                if row.samples and row.request.grammar is not None]
    sampling = None
    if held_back or not all(p.greedy for p in sampled):
        padding = shape.rows - len(sampled)
        sampling = SamplingBatch.from_params(sampled + [None] * padding,
                                             [row.request.seed for row in schedule.rows] + [0] * padding, generated)
    prefix = None
    if step_pages is not None:
        attach = np.zeros((shape.rows, max_pages_per_seq), np.int32)
        for i, row in enumerate(schedule.rows):
            if row.request in schedule.admitted:
                cached = row.start // page_size
                attach[i, :cached] = row.request.blocks[:cached]
        prefix = PrefixOps(mark=_padded(schedule.mark, step_pages), evict=_padded(schedule.evicted, step_pages),
                           attach=attach)
    return StepInputs(shape, _padded(schedule.release, max_seqs), tokens, token_src, seq_ids, q_lens, sampling,
                      prefix, logprobs, grammars, bool(grammars), spec)


@dataclasses.dataclass
class StepRecord:
    """What one step computed and when (``Engine(record_steps=True)``), for serving benchmarks.

    Attributes:
      rows, decode_rows: step rows with work, and those of one token (and its drafts).
      tokens, prefill_tokens: tokens computed, and those of prompt chunks (rows of more than one
        token that are not a token and its drafts).
      draft_tokens: draft tokens verified.
      context_tokens: sum over rows of the sequence length after the step (the keys attention reads).
      attention_pairs: sum over the step's tokens of the keys each attends to (causal).
      padded_rows, padded_tokens: the compiled shape that ran it.
      t_start, t_launched, t_done: ``time.perf_counter()`` when scheduling began, when the step
        call returned, and when its tokens reached the host.
    """

    rows: int
    decode_rows: int
    tokens: int
    prefill_tokens: int
    context_tokens: int
    attention_pairs: int
    padded_rows: int
    padded_tokens: int
    t_start: float
    draft_tokens: int = 0
    t_launched: float = 0.0
    t_done: float = 0.0

    @classmethod
    def of(cls, schedule: Schedule, shape: StepShape, t_start: float) -> "StepRecord":
        rows = schedule.rows
        decodes = sum(row.count - row.drafts == 1 for row in rows)
        return cls(rows=len(rows), decode_rows=decodes, tokens=schedule.num_tokens,
                   prefill_tokens=sum(row.count for row in rows if row.count - row.drafts > 1),
                   context_tokens=sum(row.start + row.count for row in rows),
                   attention_pairs=sum(row.count * row.start + row.count * (row.count + 1) // 2 for row in rows),
                   padded_rows=shape.rows, padded_tokens=shape.tokens, t_start=t_start,
                   draft_tokens=sum(row.drafts for row in rows))


class StepRunner:
    """The engine's device side (vLLM's model runner beside its engine core): the model's weights,
    one KV cache per layer, the page table and the previous step's sampled tokens, all on the
    device, and the jitted step over them (``make_engine_step``), compiled once per ``buckets``
    shape. ``launch`` runs one step of a schedule and returns its outputs without waiting for them;
    the ``Engine`` keeps the requests, the scheduler and the loop.

    With a ``mesh``, the weights are placed for tensor parallelism, the caches split by KV heads
    and the table and tokens replicated (``Engine``'s docstring). With a ``drafter``, the step
    speculates (``jaxattn.serve.speculative``) over a ``DraftState``, replicated too (a ``draft`` model's
    caches: not on a mesh).
    """

    def __init__(self, model: PagedModel, *, max_seqs: int, num_pages: int, page_size: int, pages_per_seq: int,
                 max_step_tokens: int, prefill_chunk: int | None, layout: str, kv_dtype, mesh: Mesh | None,
                 backend: str, enable_prefix_caching: bool, drafter: SpeculativeConfig | None = None,
                 draft: PagedModel | None = None, max_prefill_seqs: int | None = None):
        self.max_seqs, self.backend, self.vocab_size = max_seqs, backend, model.cfg.vocab_size
        self.drafter = drafter
        self._step, self._weights = make_engine_step(model, draft)
        if mesh is not None:
            self._weights = jax.device_put(self._weights, jax.tree.leaves(model.param_shardings(mesh)))
        self._new_caches = functools.partial(model.init_caches, num_pages, page_size, layout, kv_dtype, mesh=mesh)
        self._new_draft_caches = None if draft is None else functools.partial(draft.init_caches, num_pages,
                                                                              page_size, layout, kv_dtype)
        self._new_table = functools.partial(jaxattn.PageTable.create, num_pages, max_seqs, pages_per_seq, page_size)
        self._mesh = mesh
        self.caches = self.drafting = None
        self.reset()
        self.buckets = StepBuckets.default(max_seqs, max_step_tokens, prefill_chunk,
                                           drafter.num_drafts if drafter else 0, max_prefill_seqs)
        # pages one step may allocate (rows of one page, plus its prompt chunks' pages) or cache
        self.step_pages = max_seqs + max_step_tokens // page_size + 1 if enable_prefix_caching else None

    def reset(self) -> None:
        """Fresh device state for the compiled step: an empty page table, no previous tokens, no
        drafts, no step waiting for its pick (at start, and after a failed step). The KV caches
        stay unless a failed step consumed or poisoned them: their contents mean nothing to an
        empty table."""
        if not _usable(self.caches):
            self.caches = None                       # the old pool's memory goes before the new one's comes
            self.caches = self._new_caches()
        self.table = self._new_table()
        self.prev_tokens = jnp.zeros((self.max_seqs,), jnp.int32)
        if self.drafter is not None:
            draft_caches = None if self.drafting is None else self.drafting.caches
            if self._new_draft_caches is not None and not _usable(draft_caches):
                self.drafting = None                 # as the pool's: the old caches' memory first
                draft_caches = self._new_draft_caches()
            capacity = self.table.max_pages_per_seq * self.table.page_size
            self.drafting = DraftState(jnp.zeros((self.max_seqs, capacity), jnp.int32),
                                       jnp.zeros((self.max_seqs, self.drafter.num_drafts + 1), jnp.int32), draft_caches)
        self._unpicked: StepLaunch | None = None   # a deferred step launched and not picked yet
        if self._mesh is not None:
            replicated = NamedSharding(tensor_parallel_mesh(self._mesh)[0], PartitionSpec())
            self.table, self.prev_tokens, self.drafting = jax.device_put(
                (self.table, self.prev_tokens, self.drafting), replicated)

    def launch(self, schedule: Schedule, previous_rows: Mapping[Request, int]) -> "StepLaunch":
        """Runs the step of ``schedule`` (``previous_rows``: ``pack_step``'s), its outputs copied to
        the host asynchronously. A step with rows under a grammar returns unpicked: ``pick`` it
        once every step before it has completed, and before the next launch."""
        if self._unpicked is not None:
            raise RuntimeError("StepRunner.launch: the previous step's tokens are not picked yet (pick it first)")
        shape = self.buckets.shape(schedule)
        inputs = pack_step(schedule, shape, max_seqs=self.max_seqs, page_size=self.table.page_size,
                           max_pages_per_seq=self.table.max_pages_per_seq, step_pages=self.step_pages,
                           previous_rows=previous_rows, draft_tokens=self.drafter and self.drafter.num_drafts)
        if self.drafter is not None:
            oracle = self.drafter.method == "oracle"
            for row in schedule.rows:   # tokens the step does not compute (cached prompt pages; the oracle's)
                if row.request in schedule.admitted and (row.start > 0 or oracle):
                    self.drafting = _write_history(self.drafting, row.request.slot,
                                                   _history_row(row.request, self.drafting.history.shape[1], oracle))
        return self._launch(inputs)

    def pick(self, launch: "StepLaunch") -> None:
        """Picks the tokens of ``launch``, a deferred step: fills its grammar rows' token masks
        (their grammars must hold every token before the step's) and runs ``pick_tokens`` over
        its logits; ``launch.next_tokens`` and ``launch.logprobs`` are then set."""
        logits, positions = launch.row_logits
        inputs = launch.inputs
        allowed = np.full((inputs.shape.rows, mask_words(self.vocab_size)), -1, np.int32)
        fill_masks(inputs.grammars, allowed)
        self._picked(launch, *pick_tokens(logits, positions, inputs.sampling, allowed, max_seqs=self.max_seqs,
                                          logprobs=inputs.logprobs))

    def _launch(self, inputs: StepInputs) -> "StepLaunch":
        args, kwargs = self._operands(inputs)
        picked, ok, pages, self.caches, self.table, drafting = self._step(*args, **kwargs)
        if self.drafter is not None:
            self.drafting = drafting
        ok.copy_to_host_async()
        launch = StepLaunch(inputs, ok, pages)
        if inputs.deferred:
            launch.row_logits, self._unpicked = picked, launch
        else:
            self._picked(launch, *picked)
        return launch

    def _picked(self, launch: "StepLaunch", next_tokens: jax.Array, step_logprobs: tuple[jax.Array, ...] | None,
                *drafts: jax.Array) -> None:
        """Records a step's tokens (``drafts``: a speculating step's ``(tokens, accepted)``)."""
        for output in (next_tokens, *(step_logprobs or ()), *drafts):
            output.copy_to_host_async()
        launch.next_tokens, launch.logprobs, launch.row_logits = next_tokens, step_logprobs, None
        launch.drafts = drafts or None
        self.prev_tokens, self._unpicked = next_tokens, None

    def warmup(self, *, sampled: bool = True, logprobs: bool = False, masked: bool = False,
               compile_threads: int = 1) -> None:
        """Compiles the step for every shape in ``buckets`` (greedy; with ``sampled`` the sampling
        variant too; with ``logprobs`` each of those with logprobs; with ``masked`` the deferred
        step and its picks, structured output's) by running it on padding rows, which changes no
        state. With ``compile_threads`` > 1 the steps are traced one by one, then XLA compiles
        that many at a time (it releases the GIL), before each runs once. Logs one INFO line per
        step compiled (its shape and seconds) and one for the total on the
        ``jaxattn.serve.engine`` logger."""
        variants = [(sampling, with_masks, with_logprobs) for with_masks in (False, True)[:1 + masked]
                    for with_logprobs in (False, True)[:1 + logprobs] for sampling in (False, True)[:1 + sampled]]
        steps = [(shape, variant) for shape in self.buckets.shapes for variant in variants]
        start = time.perf_counter()
        if self.drafter is not None:            # a free slot's history is never read: its write changes nothing
            self.drafting = _write_history(self.drafting, 0, np.zeros(self.drafting.history.shape[1], np.int32))
        inputs = [self.padding_inputs(shape, sampled=sampling, masked=with_masks, logprobs=with_logprobs)
                  for shape, (sampling, with_masks, with_logprobs) in steps]

        def log(i: int, seconds: float) -> None:
            shape, (sampling, with_masks, with_logprobs) = steps[i]
            logger.info("compiled step %d/%d (%s, %d rows, %d tokens, max_q_len %d, %s%s%s) in %.1f s", i + 1,
                        len(steps), "decode" if shape.max_q_len == 1 else "mixed", shape.rows, shape.tokens,
                        shape.max_q_len, "sampled" if sampling else "greedy",
                        " with logprobs" if with_logprobs else "",
                        ", picked apart with token masks" if with_masks else "", seconds)

        if compile_threads > 1:
            # the step's jit cache is XLA's: a step compiled ahead here runs below without compiling again
            lowered = [self.trace(step_inputs).lower() for step_inputs in inputs]

            def compile_step(i: int) -> None:
                compile_start = time.perf_counter()
                lowered[i].compile()
                log(i, time.perf_counter() - compile_start)

            with concurrent.futures.ThreadPoolExecutor(compile_threads) as pool:
                list(pool.map(compile_step, range(len(steps))))
        for i, step_inputs in enumerate(inputs):
            step_start = time.perf_counter()
            launch = self._launch(step_inputs)
            if step_inputs.deferred:
                self.pick(launch)
            jax.block_until_ready((self.table, launch.next_tokens))
            if compile_threads <= 1:
                log(i, time.perf_counter() - step_start)
        logger.info("compiled %d steps in %.1f s", len(steps), time.perf_counter() - start)

    def trace(self, inputs: StepInputs) -> jax.stages.Traced:
        """The step traced on this runner's state and ``inputs`` (for tests and tools)."""
        args, kwargs = self._operands(inputs)
        return self._step.trace(*args, **kwargs)

    def padding_inputs(self, shape: StepShape, *, sampled: bool, masked: bool = False,
                       logprobs: bool = False) -> StepInputs:
        """The operands of a step of ``shape`` whose rows are all padding (sampling ones with
        ``sampled``; deferred, its tokens picked with token masks that allow every token, with
        ``masked``; asking for logprobs with ``logprobs``)."""
        prefix = None
        if self.step_pages is not None:
            no_pages = np.full(self.step_pages, -1, np.int32)
            prefix = PrefixOps(no_pages, no_pages, np.zeros((shape.rows, self.table.max_pages_per_seq), np.int32))
        sampling = None
        if sampled:
            sampling = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * shape.rows, [0] * shape.rows)
        spec = None
        if self.drafter is not None:
            spec = SpecRows.none(shape)
        return StepInputs(shape, np.full(self.max_seqs, -1, np.int32), np.zeros(shape.tokens, np.int32),
                          np.full(shape.tokens, -1, np.int32), np.full(shape.rows, -1, np.int32),
                          np.zeros(shape.rows, np.int32), sampling, prefix, logprobs, [], masked, spec)

    def _operands(self, inputs: StepInputs) -> tuple[tuple, dict]:
        """The step's arguments: the device state, then ``inputs`` (a deferred step takes neither
        sampling nor logprobs: its pick does)."""
        deferred = inputs.deferred
        return ((self._weights, self.caches, self.table, self.prev_tokens, inputs.release_ids, inputs.tokens,
                 inputs.token_src, inputs.seq_ids, inputs.q_lens, None if deferred else inputs.sampling,
                 inputs.prefix, self.drafting, inputs.spec),
                dict(max_q_len=inputs.shape.max_q_len, max_prefill_seqs=inputs.shape.max_prefill_seqs,
                     backend=self.backend, logprobs=inputs.logprobs and not deferred, deferred=deferred,
                     drafter=self.drafter))


def _usable(arrays) -> bool:
    """Whether ``arrays`` (a pytree; None: no) can feed a step: none was donated to a call that
    failed (deleted) or is the output of one (its error raised on waiting)."""
    leaves = jax.tree.leaves(arrays)
    if not leaves or any(leaf.is_deleted() for leaf in leaves):
        return False
    try:
        jax.block_until_ready(leaves)
    except Exception:  # noqa: BLE001 - any error of the computation that made them
        return False
    return True


@functools.partial(jax.jit, donate_argnums=0)
def _write_history(drafting: DraftState, slot: int, tokens: jax.Array) -> DraftState:
    """``drafting`` with ``tokens`` (int32[C]) as sequence ``slot``'s history."""
    return dataclasses.replace(drafting, history=drafting.history.at[slot].set(tokens))


def _history_row(request: Request, capacity: int, oracle: bool) -> np.ndarray:
    """int32[capacity]: ``request``'s known tokens, or with ``oracle`` its prompt and
    ``draft_oracle``, then zeros."""
    tokens = request.tokens
    if oracle and request.draft_oracle is not None:
        tokens = np.concatenate([request.prompt, np.asarray(request.draft_oracle, np.int32)])
    row = np.zeros(capacity, np.int32)
    row[:min(tokens.size, capacity)] = tokens[:capacity]
    return row


@dataclasses.dataclass
class StepLaunch:
    """A launched step: its ``inputs``, its outputs on the device (``ok``, ``pages``), and its
    tokens (``next_tokens``, ``logprobs``: ``make_engine_step``'s; ``drafts``: a speculating
    step's ``(tokens, accepted)``), None while a deferred step waits for ``StepRunner.pick`` (its
    ``row_logits`` meanwhile)."""

    inputs: StepInputs
    ok: jax.Array
    pages: jax.Array
    next_tokens: jax.Array | None = None
    logprobs: tuple[jax.Array, ...] | None = None
    row_logits: tuple[jax.Array, jax.Array] | None = None
    drafts: tuple[jax.Array, jax.Array] | None = None

    @property
    def shape(self) -> StepShape:
        return self.inputs.shape
