"""The DeepSeek-shaped MLA model with paged latents (xla backend; chunked prefill over expanded
K/V, then absorbed steps), and served by the Engine, against the same weights run densely
without a cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxattn
from jaxattn.serve.engine import Engine
from jaxattn.serve.models.deepseek import PRESETS, DeepSeek, forward_paged


def _dense_attend(scale: float):
    """Causal multi-head attention over one whole sequence, K/V expanded from its latents."""

    def attend(layer, q, latents, w_uk, w_uv):
        rank = w_uk.shape[0]
        c_kv, k_rope = latents[:, :rank], latents[:, rank:]
        k_nope = jnp.einsum("sr,rhn->shn", c_kv, w_uk)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, None], (*k_nope.shape[:2], k_rope.shape[-1]))], -1)
        v = jnp.einsum("sr,rhv->shv", c_kv, w_uv)
        s = jnp.einsum("thd,shd->hts", q, k) * scale
        causal = jnp.tril(jnp.ones((q.shape[0], k.shape[0]), bool))
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        return jnp.einsum("hts,shv->thv", p, v)

    return attend


@functools.partial(jax.jit, static_argnums=0)
def _dense_hidden(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, state)
    return model.hidden(tokens, jnp.arange(tokens.shape[0], dtype=jnp.int32), _dense_attend(model.cfg.scale))


@functools.partial(jax.jit, static_argnums=(0, 7, 8))
def _paged_step(graphdef, state, caches, table, tokens, seq_ids, q_lens, max_q_len, backend):
    model = nnx.merge(graphdef, state)
    table, ok = table.extend(seq_ids, table.seq_lens[seq_ids] + q_lens)
    meta = table.metadata(seq_ids, q_lens, max_q_len=max_q_len)
    slots = table.slot_mapping(seq_ids, q_lens, tokens.shape[0])
    hidden, caches = forward_paged(model, tokens, caches, meta, slots, backend=backend)
    return hidden, caches, table, ok


@pytest.mark.parametrize("backend", ["xla", pytest.param("auto", marks=pytest.mark.gpu)])
def test_paged_chunked_prefill_and_decodes_match_dense_forward(backend):
    """On a GPU, auto runs the absorbed steps on the triton kernels (float32 matmuls everywhere)."""
    with jax.default_matmul_precision("float32"):
        _paged_matches_dense(backend)


def _paged_matches_dense(backend: str):
    model = DeepSeek(PRESETS["tiny"], nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 512, size=n).astype(np.int32) for n in (16, 24)]
    table = jaxattn.PageTable.create(num_pages=12, max_seqs=2, max_pages_per_seq=4, page_size=8)
    caches = model.init_caches(12, 8)
    # (tokens of sequence 0, of sequence 1, max_q_len): a chunked prefill (expanded K/V), a decode
    # beside the prompt's last chunk (absorbed: max_q_len 16), then decodes (absorbed).
    steps = [((0, 13), (0, 8), None), ((13, 14), (8, 21), 16), ((14, 15), (21, 22), 1), ((15, 16), (22, 24), 16)]
    # Causal: a prefix's hidden states are those of the whole (zero-padded) sequence.
    dense = [_dense_hidden(graphdef, state, jnp.zeros(32, jnp.int32).at[:seq.size].set(seq)) for seq in seqs]
    for (a0, a1), (b0, b1), max_q_len in steps:
        tokens = np.zeros(24, np.int32)                                    # the rest is padding
        tokens[:a1 - a0 + b1 - b0] = np.concatenate([seqs[0][a0:a1], seqs[1][b0:b1]])
        q_lens = jnp.asarray([a1 - a0, b1 - b0], jnp.int32)
        hidden, caches, table, ok = _paged_step(graphdef, state, caches, table, jnp.asarray(tokens),
                                                jnp.asarray([0, 1], jnp.int32), q_lens, max_q_len, backend)
        assert np.asarray(ok).all()
        for expected, (lo, hi), start in ((dense[0], (a0, a1), 0), (dense[1], (b0, b1), a1 - a0)):
            np.testing.assert_allclose(hidden[start:start + hi - lo], expected[lo:hi], rtol=1e-4, atol=1e-4)


def dense_greedy(model: DeepSeek, prompt: np.ndarray, new_tokens: int, max_len: int = 32) -> list[int]:
    """The dense forward's greedy continuation of ``prompt``: ``new_tokens`` tokens."""
    graphdef, state = nnx.split(model)
    seq = np.zeros(max_len, np.int32)                 # one shape: causal, so padding never reaches earlier rows
    seq[:prompt.size] = prompt
    for n in range(prompt.size, prompt.size + new_tokens):
        hidden = _dense_hidden(graphdef, state, jnp.asarray(seq))
        seq[n] = int(jnp.argmax(model.logits(hidden[n - 1])))
    return seq[prompt.size:prompt.size + new_tokens].tolist()


@pytest.mark.parametrize("backend, max_prefill_seqs", [("xla", None), ("auto", None), ("auto", 1)])
def test_engine_greedy_tokens_match_dense_forward(backend, max_prefill_seqs):
    """auto serves a mixed step's decodes absorbed and its prompt chunks expanded over at most
    ``max_prefill_seqs`` sequences (the engine's default for an MLA model: 8); xla serves it whole."""
    model = DeepSeek(PRESETS["tiny"], nnx.Rngs(1))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, size=n).astype(np.int32) for n in (13, 21, 5, 9)]
    engine = Engine(model, max_seqs=3, max_seq_len=32, page_size=8, max_step_tokens=12, prefill_chunk=6,
                    backend=backend, max_prefill_seqs=max_prefill_seqs, record_steps=True)
    assert engine.max_prefill_seqs == (max_prefill_seqs or 8)
    requests = [engine.add_request(p, max_new_tokens=6) for p in prompts]
    engine.run()
    for prompt, request in zip(prompts, requests):
        assert request.output == dense_greedy(model, prompt, 6)
    assert any(record.decode_rows and record.prefill_tokens for record in engine.step_records)
