"""The engine's jitted decode step (and mixed step) on random caches, and the bytes a decode step
must read: shared by the whole-step benchmarks (bench_e2e, bench_tp, profile_step)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxattn
from benchmarks.common import PAGE
from jaxattn.attention import backend_for
from jaxattn.serve.models import fusion
from jaxattn.serve.models.llama import Llama, shard_model
from jaxattn.serve.speculative import SpeculativeConfig
from jaxattn.serve.step import DraftState, SpecRows, StepRecord, make_engine_step
from jaxattn.sharding import num_head_shards, tensor_parallel_mesh


def fill(model: Llama, batch: int, context: int, steps: int | np.ndarray, seed: int, mesh: Mesh | None = None,
         kv_dtype=None, width: int = 0):
    """Caches with random KV (of ``kv_dtype``, default the model's; FP8 caches keep their unit
    scales), and a table where every sequence holds ``context - 1`` tokens with pages for ``steps``
    more (one count, or one per sequence), at least ``width`` keys wide; with a ``mesh``, the pools
    split by KV heads and the table replicated (as ``Engine(mesh=)``)."""
    pages = -(-(context + np.broadcast_to(steps, (batch,))) // PAGE)
    pages_per_seq, num_pages = max(int(pages.max()), -(-width // PAGE)), 1 + int(pages.sum())
    caches = model.init_caches(num_pages, PAGE, "HND", dtype=kv_dtype, mesh=mesh)
    key = jax.random.key(seed)

    def random_pages(k, pages):
        return jax.device_put(jax.random.normal(k, pages.shape, jnp.bfloat16).astype(pages.dtype), pages.sharding)

    # one layer at a time, each zero pool dropped as its random one is made: at context 4096 the
    # zero and random pools of all 32 layers together (2 x 35 GB) did not fit an 80 GB GPU
    for layer, (k_key, v_key) in enumerate(jax.random.split(key, (len(caches), 2))):
        cache = caches[layer]
        caches[layer] = dataclasses.replace(cache, k_pages=random_pages(k_key, cache.k_pages),
                                            v_pages=random_pages(v_key, cache.v_pages))
    table = jaxattn.PageTable.create(num_pages, batch, pages_per_seq, PAGE)
    if mesh is not None:
        table = jax.device_put(table, NamedSharding(caches[0].k_pages.sharding.mesh, PartitionSpec()))
    ids = jnp.arange(batch, dtype=jnp.int32)
    table, ok = jax.jit(jaxattn.PageTable.extend)(table, ids, jnp.full((batch,), context - 1, jnp.int32))
    assert bool(ok.all())
    return caches, table


def _engine_step(model: Llama, mesh: Mesh | None, fuse_projections: bool):
    """The engine's jitted step and the weights it takes, the model fused and placed first as the
    ``Engine`` does it."""
    if fuse_projections:
        fusion.fuse_projections(model, num_head_shards(*tensor_parallel_mesh(mesh)) if mesh is not None else 1)
    if mesh is not None:
        shard_model(model, mesh)
    return make_engine_step(model)


def decode_step(model: Llama, backend: str, batch: int, context: int, steps: int, mesh: Mesh | None = None,
                kv_dtype=None, draft_tokens: int = 0, fuse_projections: bool = True, width: int = 0):
    """``(model_step, state, weights, plan)``: one greedy decode step of the engine as a function
    of its state (next tokens, caches, table, drafting), chained calls of which decode ``batch``
    sequences from ``context - 1`` tokens on (room for ``7 * steps + 8`` steps); the first state;
    the model's weights; what ``paged_attention`` runs. With a ``mesh``, the model (``shard_model``),
    the caches and the table are placed over it as ``Engine(mesh=)`` places them;
    ``kv_dtype``: the caches' (default the model's). With ``draft_tokens`` K > 0 it is the
    speculating engine's step instead (n-gram drafts, vLLM's default lookup): every row verifies
    its K drafts in K + 1 query tokens and keeps what it accepts (random weights: about none).
    ``fuse_projections``: the model's q/k/v and gate/up projections fused first, in place, for the
    ``mesh``'s shard count, as the ``Engine`` fuses them (``jaxattn.serve.models.fusion``).
    ``width``: the block table's keys at least (an engine's ``max_seq_len``; ``fill``)."""
    cfg = model.cfg
    step, weights = _engine_step(model, mesh, fuse_projections)
    row_tokens = draft_tokens + 1
    caches, table = fill(model, batch, context, row_tokens * (7 * steps + 8), seed=batch + context, mesh=mesh,
                         kv_dtype=kv_dtype, width=width)
    ids = jnp.arange(batch, dtype=jnp.int32)
    q_lens = jnp.full((batch,), row_tokens, jnp.int32)
    no_release = jnp.full((batch,), -1, jnp.int32)
    no_tokens = jnp.zeros((batch * row_tokens,), jnp.int32)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=batch), jnp.int32)
    q = jnp.zeros((batch * row_tokens, cfg.num_q_heads, cfg.head_dim), cfg.dtype)
    meta = table.metadata(ids, q_lens, max_q_len=row_tokens)
    plan = str(backend_for(q, caches[0], meta, backend=backend))
    drafting = spec = drafter = None
    token_src = ids
    if draft_tokens:
        drafter = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": draft_tokens})
        history = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(batch, table.max_pages_per_seq * PAGE)),
                              jnp.int32)
        drafting = DraftState(history, jnp.asarray(rng.integers(0, cfg.vocab_size, size=(batch, row_tokens)),
                                                   jnp.int32))
        # every row's inputs: its token sampled last and its drafts, from the step before
        spec = SpecRows(jnp.arange(batch * row_tokens, dtype=jnp.int32), jnp.ones((batch,), bool),
                        jnp.zeros((batch,), bool))
        token_src = jnp.full((batch * row_tokens,), -1, jnp.int32)
        if mesh is not None:
            drafting = jax.device_put(drafting, NamedSharding(caches[0].k_pages.sharding.mesh, PartitionSpec()))

    def model_step(state):      # as the Engine's decode step: each row's input is its previous token
        tok, caches, table, drafting = state
        (tok, *_), ok, pages, caches, table, drafting = step(
            weights, caches, table, tok, no_release, no_tokens, token_src, ids, q_lens, drafting=drafting, spec=spec,
            max_q_len=row_tokens, backend=backend, drafter=drafter)
        return tok, caches, table, drafting

    return model_step, (tokens, caches, table, drafting), weights, plan


def mixed_step(model: Llama, backend: str, rows: int, tokens: int, decodes: int, chunks: int, chunk: int,
               context: int, max_seq_len: int, kv_dtype=None, fuse_projections: bool = True,
               max_q_len: int | None = None):
    """``(model_step, state, weights, record)``: the engine's mixed step at a compiled shape of
    ``rows`` rows and ``tokens`` tokens (static ``max_q_len``, default ``chunk``; the engine's is
    ``min(tokens, prefill_chunk)``) running ``decodes`` rows of one token and then ``chunks`` rows
    of ``chunk`` prompt tokens, every sequence from ``context - 1`` tokens on, the other rows and
    tokens padding, in block tables ``max_seq_len`` keys wide (the engine's). Chained calls redo the
    same step (the decodes on their sampled tokens): the table is not advanced, so every call
    does the same work and the tables stay as wide as the engine's. ``record``: a call's
    ``StepRecord`` counts (rows, tokens, keys read, attention pairs), for
    ``bench_serving.step_bound``'s roofline. ``kv_dtype``: the caches' (default the model's)."""
    used, max_q_len = decodes + chunks * chunk, max_q_len or chunk
    if decodes + chunks > rows or used > tokens or not 2 <= chunk <= max_q_len or context + chunk > max_seq_len:
        raise ValueError(f"mixed_step: {decodes} decodes + {chunks} x {chunk} tokens at context {context} do not fit "
                         f"a step of {rows} rows and {tokens} tokens (2 <= chunk <= max_q_len={max_q_len}) in "
                         f"sequences of max_seq_len={max_seq_len}")
    step, weights = _engine_step(model, None, fuse_projections)
    room = np.ones(rows, np.int64)
    room[decodes:decodes + chunks] = chunk
    caches, table = fill(model, rows, context, room, seed=rows + context, kv_dtype=kv_dtype, width=max_seq_len)
    ids = np.full(rows, -1, np.int32)
    ids[:decodes + chunks] = np.arange(decodes + chunks)
    q_lens = np.zeros(rows, np.int32)
    q_lens[:decodes], q_lens[decodes:decodes + chunks] = 1, chunk
    token_src = np.full(tokens, -1, np.int32)
    token_src[:decodes] = np.arange(decodes)            # a decode's input: the token its row sampled last
    rng = np.random.default_rng(0)
    new_tokens = jnp.asarray(rng.integers(0, model.cfg.vocab_size, size=tokens), jnp.int32)
    no_release = jnp.full((rows,), -1, jnp.int32)
    first = jnp.asarray(rng.integers(0, model.cfg.vocab_size, size=rows), jnp.int32)
    ids, q_lens, token_src = (jnp.asarray(x) for x in (ids, q_lens, token_src))

    copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))

    def model_step(state):
        tok, caches, table = state
        # the step donates its table: it gets a copy (a few small copies a call), the state keeps the original
        (tok, *_), ok, pages, caches, _, _ = step(weights, caches, copy(table), tok, no_release, new_tokens,
                                                  token_src, ids, q_lens, max_q_len=max_q_len, backend=backend)
        return tok, caches, table

    return model_step, (first, caches, table), weights, step_record(decodes, chunks, chunk, context, rows, tokens)


def step_record(decodes: int, chunks: int, chunk: int, context: int, rows: int, tokens: int) -> StepRecord:
    """The ``StepRecord`` counts (rows, tokens, keys read, attention pairs) of a step of ``decodes``
    rows of one token and ``chunks`` rows of ``chunk`` prompt tokens, every sequence from
    ``context - 1`` tokens on, compiled at ``rows`` x ``tokens``: for ``bench_serving.step_bound``."""
    return StepRecord(rows=decodes + chunks, decode_rows=decodes, tokens=decodes + chunks * chunk,
                      prefill_tokens=chunks * chunk, context_tokens=decodes * context + chunks * (context - 1 + chunk),
                      attention_pairs=decodes * context + chunks * (chunk * (context - 1) + chunk * (chunk + 1) // 2),
                      padded_rows=rows, padded_tokens=tokens, t_start=0.0)


def step_bytes(cfg, weights: list[jax.Array], batch: int, context: int) -> tuple[float, float]:
    """(weight bytes, KV bytes) a decode step must read: every weight once (embedding: only the
    ``batch`` rows read) and the K/V of every layer once."""
    weight_bytes = sum(x.size * x.dtype.itemsize for x in weights) \
        - cfg.vocab_size * cfg.dim * jnp.dtype(cfg.dtype).itemsize + batch * cfg.dim * 2   # embed: B rows
    kv_bytes = 2 * cfg.num_layers * batch * context * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    return weight_bytes, kv_bytes


def fits(cfg, batch: int, context: int, free_bytes: float) -> bool:
    """Whether the KV of ``batch`` sequences at ``context`` (and the xla backend's per-layer gather) fit."""
    kv = 2 * cfg.num_layers * batch * (context + 64) * cfg.num_kv_heads * cfg.head_dim * 2
    gather = 2 * batch * context * cfg.num_kv_heads * cfg.head_dim * 2   # the xla backend's per-layer gather
    return kv + 2 * gather < 0.8 * free_bytes
