"""Sampling: top-k / top-p never emit an excluded token (property test against a sort-based
reference), sampled frequencies follow the softmax, greedy rows take the argmax, logprobs are
the log-softmax, and bad parameters are named."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxattn.serve.sampling import (
    MAX_BANNED,
    MAX_LOGPROBS,
    SamplingBatch,
    SamplingParams,
    _sortable,
    _threshold,
    _top_k,
    sample,
    token_logprobs,
)

B, V = 4, 12


@functools.cache
def _sample():
    return jax.jit(sample)


def _allowed(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """bool[V]: the tokens a row may emit, from sorting (ties with the cut-off are allowed)."""
    scaled = logits.astype(np.float64) / temperature
    order = np.sort(scaled)[::-1]
    keep = scaled >= (order[top_k - 1] if 0 < top_k < V else -np.inf)
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    desc = np.sort(probs)[::-1]
    before = np.cumsum(desc) - desc                      # mass of the strictly more likely tokens
    cut = desc[before < top_p - 1e-6].min() if top_p < 1 else 0.0
    # float32 rounding may shift the cut by a hair: allow tokens within 1e-5 of it
    return keep & (probs >= cut * (1 - 1e-5))


# No subnormal logits: XLA flushes them to zero, where the float64 reference would not.
row_st = st.tuples(st.lists(st.floats(-5, 5, width=32, allow_subnormal=False), min_size=V, max_size=V),
                   st.sampled_from([0.5, 1.0, 2.0]), st.integers(-1, V + 2), st.sampled_from([0.1, 0.5, 0.9, 1.0]),
                   st.integers(0, 2**32 - 1), st.integers(0, 1000))


@settings(max_examples=60, deadline=None)
@given(st.lists(row_st, min_size=B, max_size=B))
def test_top_k_and_top_p_never_emit_excluded_tokens(rows):
    logits = np.asarray([r[0] for r in rows], np.float32)
    params = SamplingBatch(temperature=np.asarray([r[1] for r in rows], np.float32),
                           top_k=np.asarray([r[2] for r in rows], np.int32),
                           top_p=np.asarray([r[3] for r in rows], np.float32),
                           seed=np.asarray([r[4] for r in rows], np.uint32))
    tokens = np.asarray(_sample()(jnp.asarray(logits), params, jnp.asarray([r[5] for r in rows], jnp.int32)))
    for i, (_, temperature, top_k, top_p, _, _) in enumerate(rows):
        assert _allowed(logits[i], temperature, top_k, top_p)[tokens[i]], (i, rows[i], tokens[i])


def test_threshold_finds_the_kth_largest_value():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 50)).astype(np.float32) * 10
    x[1, :5] = -np.inf
    for k in (1, 7, 45, 50):
        thr = _threshold(_sortable(jnp.asarray(x)), jnp.ones_like(x), jnp.full((3,), float(k)))
        expected = _sortable(jnp.asarray(np.sort(x, axis=1)[:, ::-1][:, k - 1]))
        np.testing.assert_array_equal(thr, expected)


def test_frequencies_follow_the_softmax():
    """Many rows with the same logits and different seeds: the tokens' frequencies match the
    temperature-scaled softmax restricted to the top-k tokens."""
    n = 4000
    logits = np.log(np.asarray([0.05, 0.4, 0.1, 0.3, 0.15], np.float32))
    params = SamplingBatch(temperature=np.full(n, 1.0, np.float32), top_k=np.full(n, 4, np.int32),
                           top_p=np.ones(n, np.float32), seed=np.arange(n, dtype=np.uint32))
    tokens = np.asarray(sample(jnp.tile(logits, (n, 1)), params, jnp.zeros(n, jnp.int32)))
    freq = np.bincount(tokens, minlength=5) / n
    expected = np.asarray([0.0, 0.4, 0.1, 0.3, 0.15]) / 0.95
    np.testing.assert_allclose(freq, expected, atol=0.03)


def test_greedy_rows_and_the_same_seed_and_position_repeat():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(B, 100)).astype(np.float32)
    logits[3] = logits[2]
    logits = jnp.asarray(logits)
    params = SamplingBatch(temperature=np.asarray([0.0, 1e-6, 1.0, 1.0], np.float32), top_k=np.zeros(B, np.int32),
                           top_p=np.ones(B, np.float32), seed=np.asarray([0, 0, 7, 7], np.uint32))
    positions = jnp.asarray([3, 3, 5, 5], jnp.int32)
    tokens = np.asarray(sample(logits, params, positions))
    np.testing.assert_array_equal(tokens[:2], np.argmax(logits[:2], axis=-1))
    assert tokens[2] == tokens[3]
    top_k1 = SamplingBatch(params.temperature, np.ones(B, np.int32), params.top_p, params.seed)
    np.testing.assert_array_equal(sample(logits, top_k1, positions), np.argmax(logits, axis=-1))


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("temperature", float("inf")), ("min_tokens", -1),
                                          ("temperature", float("nan")), ("top_k", -2), ("top_k", 1.5),
                                          ("top_k", 2**31), ("top_p", 0.0), ("top_p", float("nan")),
                                          ("top_p", 1.5), ("seed", -1), ("seed", 2**32),
                                          ("stop_token_ids", (1, -3)), ("stop_token_ids", (2**31,)),
                                          ("stop_token_ids", None), ("stop_token_ids", 5),
                                          ("top_p", 1e-46), ("temperature", 1e39)])   # 0 and inf in float32
def test_bad_parameters_are_named(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams: {field} must be"):
        SamplingParams(**{field: value})


def test_token_logprobs_are_the_log_softmax():
    """The chosen tokens' log-probabilities and the top MAX_LOGPROBS, most likely first, equal a
    float64 log-softmax of the same logits (bf16 logits computed in float32); the top ids are
    distinct and their logits the largest."""
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.normal(size=(3, 50)) * 4, jnp.bfloat16)
    tokens = jnp.asarray(rng.integers(0, 50, size=3), jnp.int32)
    chosen, top_ids, top_logprobs = token_logprobs(logits, tokens)
    reference = np.asarray(logits, np.float64)
    reference = reference - np.log(np.sum(np.exp(reference - reference.max(-1, keepdims=True)), -1,
                                          keepdims=True)) - reference.max(-1, keepdims=True)
    np.testing.assert_allclose(chosen, reference[np.arange(3), tokens], atol=1e-5)
    assert top_ids.shape == (3, MAX_LOGPROBS)
    # bf16 logits tie often: the top ids may take either of two equal logits, so compare their values
    top_values = np.sort(np.take_along_axis(reference, np.asarray(top_ids), -1), -1)
    np.testing.assert_array_equal(top_values, np.sort(np.sort(reference, -1)[:, -MAX_LOGPROBS:], -1))
    assert all(len(set(row)) == MAX_LOGPROBS for row in np.asarray(top_ids))
    np.testing.assert_allclose(top_logprobs, np.take_along_axis(reference, np.asarray(top_ids), -1), atol=1e-5)
    assert np.all(np.diff(np.asarray(top_logprobs), axis=-1) <= 0)
    assert token_logprobs(logits[:, :7], jnp.zeros(3, jnp.int32))[1].shape == (3, 7)


def test_rows_under_min_tokens_never_take_their_stop_tokens():
    """A row with fewer outputs than its min_tokens (greedy or sampled) never samples its stop
    tokens, even the most likely; a row past it, or one without stop tokens, samples as before."""
    logits = jnp.asarray(np.tile(np.arange(V, dtype=np.float32) * 2.0, (B, 1)))         # V-1 most likely
    holding = SamplingParams(stop_token_ids=(V - 1, V - 2), min_tokens=3)
    params = [holding, SamplingParams(temperature=1.0, stop_token_ids=(V - 1,), min_tokens=3), holding, None]
    batch = SamplingBatch.from_params(params, [1, 2, 3, 4], generated=[2, 0, 3, 0])
    assert batch.banned.shape == (B, MAX_BANNED)
    for position in range(20):
        tokens = np.asarray(sample(logits, batch, jnp.full(B, position, jnp.int32)))
        assert tokens[0] == V - 3 and tokens[1] != V - 1 and tokens[2] == V - 1 and tokens[3] == V - 1


@pytest.mark.parametrize("vocab", [30, 3000, 128_256])
def test_top_k_in_two_stages_is_exact(vocab):
    """_top_k's blocks (the k blocks of largest maxima hold the k largest values) give lax.top_k's
    values, at ids holding them, ties included."""
    rng = np.random.default_rng()
    x = rng.normal(size=(3, vocab)).astype(np.float32)
    x[1] = np.round(x[1])                                    # many ties
    values, ids = _top_k(jnp.asarray(x), MAX_LOGPROBS)
    np.testing.assert_array_equal(values, jax.lax.top_k(jnp.asarray(x), MAX_LOGPROBS)[0])
    np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(ids), -1), values)
    assert len(set(np.asarray(ids)[1].tolist())) == MAX_LOGPROBS


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True])
def test_logprobs_outside_0_to_20_are_refused(value):
    with pytest.raises(ValueError, match="SamplingParams: logprobs must be None or an int in"):
        SamplingParams(logprobs=value)
