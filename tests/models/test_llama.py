"""The Llama model with paged attention (xla backend) against the same weights run densely."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxattn
from jaxattn.models.llama import PRESETS, AttendFn, Llama, forward_paged


def dense_attend(sliding_window: int | None = None) -> AttendFn:
    """Causal attention over the whole sequence (T == S: no offset), no paging."""
    local_window = None if sliding_window is None else (sliding_window - 1, 0)

    def attend(layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                            local_window_size=local_window)[0]

    return attend


@functools.partial(jax.jit, static_argnums=0)
def _dense_next_token(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, length: jax.Array) -> jax.Array:
    """Greedy next token after ``tokens[:length]``; tokens past ``length`` are padding that the
    causal mask keeps out of earlier rows."""
    model = nnx.merge(graphdef, state)
    hidden = model.hidden(tokens, jnp.arange(tokens.shape[0], dtype=jnp.int32), dense_attend(model.cfg.sliding_window))
    return jnp.argmax(model.logits(hidden[length - 1]))


@functools.partial(jax.jit, static_argnums=0)
def dense_hidden(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array) -> jax.Array:
    """The model's final hidden states ``[T, dim]`` for one whole sequence, attended densely."""
    model = nnx.merge(graphdef, state)
    return model.hidden(tokens, jnp.arange(tokens.shape[0], dtype=jnp.int32), dense_attend(model.cfg.sliding_window))


def dense_greedy(model: Llama, prompt: np.ndarray, new_tokens: int, max_len: int = 64) -> list[int]:
    """Greedy generation that recomputes the whole sequence each step with
    ``jax.nn.dot_product_attention`` (no paging, no cache)."""
    graphdef, state = nnx.split(model)
    seq = np.zeros(max_len, np.int32)
    seq[: len(prompt)] = prompt
    for n in range(len(prompt), len(prompt) + new_tokens):
        seq[n] = int(_dense_next_token(graphdef, state, jnp.asarray(seq), jnp.asarray(n)))
    return seq[len(prompt): len(prompt) + new_tokens].tolist()


def test_paged_step_matches_dense_forward():
    model = Llama(PRESETS["tiny"], nnx.Rngs(2))
    rng = np.random.default_rng()
    lens = [13, 1, 30]
    table = jaxattn.PageTable.create(16, 3, 4, 16)
    caches = model.init_caches(16, 16, layout="NHD")
    ids, q_lens = jnp.asarray([1, 0, 2]), jnp.asarray(lens)
    table, ok = table.extend(ids, q_lens)
    tokens = rng.integers(0, 512, size=sum(lens)).astype(np.int32)
    meta = table.metadata(ids, q_lens, max_q_len=30)
    slots = table.slot_mapping(ids, q_lens, sum(lens))
    paged = jax.jit(lambda g, s, *a: forward_paged(nnx.merge(g, s), *a, backend="xla"), static_argnums=0)
    hidden, _ = paged(*nnx.split(model), jnp.asarray(tokens), caches, meta, slots)
    start = 0
    for n in lens:
        dense = dense_hidden(*nnx.split(model), jnp.asarray(tokens[start:start + n]))
        np.testing.assert_allclose(hidden[start:start + n], dense, rtol=2e-5, atol=2e-5)
        start += n
