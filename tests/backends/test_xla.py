"""The xla reference backend against dense float64 and jax.nn.dot_product_attention references."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from tests.paged_inputs import TOLERANCE, dot_product_attention_reference, make_problem, reference, rel_error

MODES = ("decode", "prefill", "chunked", "mixed")


def _lengths(rng: np.random.Generator, mode: str, batch: int, max_kv: int) -> tuple[list[int], list[int]]:
    kv = [int(x) for x in rng.integers(1, max_kv, size=batch)]
    if mode == "decode":
        return [1] * batch, kv
    if mode == "prefill":
        return kv, kv
    if mode == "chunked":
        return [int(rng.integers(1, n + 1)) for n in kv], kv
    decodes = batch // 2
    q = [1] * decodes + [int(rng.integers(1, n + 1)) for n in kv[decodes:]]
    # an empty sequence (0 new tokens, nothing cached) in the middle of the prefill part
    return q[:-1] + [0], kv[:-1] + [0]


def _cases():
    rng = np.random.default_rng(1234)
    combos = list(itertools.product(MODES, ("HND", "NHD"), (16, 64)))
    for i, (mode, layout, page_size) in enumerate(combos):
        group = (1, 2, 4, 8)[i % 4]
        head_dim = (64, 128, 256)[i % 3]
        features = [{}, {"sliding_window": int(rng.integers(1, 40))}, {"softcap": 5.0},
                    {"sinks": True}, {"scale": 0.3, "causal": False}][i % 5]
        dtype = (jnp.float32, jnp.bfloat16, jnp.float16)[i % 3]
        yield pytest.param(mode, layout, page_size, group, head_dim, dtype, features,
                           id=f"{mode}-{layout}-p{page_size}-g{group}-d{head_dim}-{jnp.dtype(dtype).name}-"
                              f"{'-'.join(features) or 'plain'}")


@pytest.mark.parametrize("mode,layout,page_size,group,head_dim,dtype,features", list(_cases()))
def test_matches_reference(mode, layout, page_size, group, head_dim, dtype, features):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    num_kv_heads = 2 if head_dim <= 128 else 1
    q_lens, kv_lens = _lengths(rng, mode, batch=4, max_kv=150)
    problem = make_problem(rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=num_kv_heads * group,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                           layout=layout, dtype=dtype)
    kwargs = dict(features)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = jnp.asarray(rng.normal(size=num_kv_heads * group), jnp.float32)
    out = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="xla", **kwargs))(
        problem.q, problem.cache, problem.meta)
    assert out.shape == problem.q.shape and out.dtype == problem.q.dtype
    ref = reference(problem, **kwargs)
    tol = TOLERANCE[jnp.dtype(dtype)]
    assert rel_error(out, ref) < tol, f"seed={seed}"
    if kwargs.get("causal", True) and "softcap" not in kwargs:
        dpa = dot_product_attention_reference(problem, scale=kwargs.get("scale"),
                                              sliding_window=kwargs.get("sliding_window"), sinks=kwargs.get("sinks"))
        assert rel_error(out, dpa) < tol, f"seed={seed}"
    padding = slice(sum(q_lens), None)
    np.testing.assert_array_equal(np.asarray(out[padding], np.float32), 0)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_fp8_pages_with_scales(layout):
    rng = np.random.default_rng()
    problem = make_problem(rng, q_lens=[1, 1, 7], kv_lens=[33, 70, 20], num_q_heads=8, num_kv_heads=2,
                           head_dim=64, page_size=16, layout=layout, dtype=jnp.bfloat16,
                           kv_dtype=jnp.float8_e4m3fn)
    assert problem.cache.is_fp8
    out = jaxattn.paged_attention(problem.q, problem.cache, problem.meta, backend="xla")
    assert rel_error(out, reference(problem)) < TOLERANCE[jnp.dtype(jnp.bfloat16)]


def test_max_q_len_hint_chunks_queries_without_changing_results():
    rng = np.random.default_rng()
    kwargs = dict(q_lens=[1, 1, 40, 9], kv_lens=[10, 50, 60, 9], num_q_heads=4, num_kv_heads=2,
                  head_dim=64, page_size=16)
    problem = make_problem(rng, **kwargs, max_q_len=40)
    out = jaxattn.paged_attention(problem.q, problem.cache, problem.meta, backend="xla")
    assert rel_error(out, reference(problem)) < 1e-5


def test_logits_budget_splits_long_prefill(monkeypatch):
    """A small logits budget forces several query chunks (lax.map) with identical results."""
    from jaxattn.backends import xla
    monkeypatch.setattr(xla, "_LOGITS_BUDGET", 4 * 4 * 2 * 128 * 7)
    rng = np.random.default_rng()
    problem = make_problem(rng, q_lens=[1, 30, 17], kv_lens=[5, 100, 17], num_q_heads=2, num_kv_heads=2,
                           head_dim=64, page_size=16)
    out = jaxattn.paged_attention(problem.q, problem.cache, problem.meta, backend="xla")
    assert rel_error(out, reference(problem)) < 1e-5


@pytest.mark.parametrize("poison", [np.nan, 1e4])
def test_pages_a_sequence_does_not_own_never_change_its_output(poison):
    rng = np.random.default_rng()
    problem = make_problem(rng, q_lens=[1, 5, 12], kv_lens=[20, 37, 12], num_q_heads=4, num_kv_heads=2,
                           head_dim=64, page_size=16, layout="NHD")
    clean = jaxattn.paged_attention(problem.q, problem.cache, problem.meta, backend="xla")
    # Unowned pages (the null page included) and every slot past each sequence's kv_len.
    k, v = np.array(problem.cache.k_pages), np.array(problem.cache.v_pages)
    k[~problem.owned] = poison
    v[~problem.owned] = poison
    tables = np.asarray(problem.meta.block_tables)
    for b, n in enumerate(problem.kv_lens):
        last = tables[b, (n - 1) // 16]
        k[last, n % 16 or 16:] = poison
        v[last, n % 16 or 16:] = poison
    cache = jaxattn.KVCache(jnp.asarray(k), jnp.asarray(v), layout="NHD")
    poisoned = jaxattn.paged_attention(problem.q, cache, problem.meta, backend="xla")
    np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(clean))


def test_out_of_range_page_ids_and_lengths_stay_in_the_pool():
    """Garbage tables and lengths from callers read the null page, never outside the pool."""
    rng = np.random.default_rng()
    problem = make_problem(rng, q_lens=[1, 3], kv_lens=[10, 20], num_q_heads=2, num_kv_heads=1,
                           head_dim=64, page_size=16)
    bad = jaxattn.AttentionMetadata(
        cu_q_lens=problem.meta.cu_q_lens,
        kv_lens=jnp.asarray([10, 10**6, 0], jnp.int32),
        block_tables=problem.meta.block_tables.at[0, 0].set(10**6).at[1, 1].set(-5),
        num_decodes=problem.meta.num_decodes,
    )
    out = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="xla"))(problem.q, problem.cache, bad)
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.gpu
def test_gpu_matches_reference():
    rng = np.random.default_rng()
    problem = make_problem(rng, q_lens=[1, 1, 1, 200, 37], kv_lens=[300, 1000, 64, 200, 500], num_q_heads=32,
                           num_kv_heads=8, head_dim=128, page_size=64, dtype=jnp.bfloat16)
    gpu = jax.devices("gpu")[0]
    q, cache, meta = jax.device_put((problem.q, problem.cache, problem.meta), gpu)
    out = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="xla", sliding_window=128))(q, cache, meta)
    assert rel_error(out, reference(problem, sliding_window=128)) < TOLERANCE[jnp.dtype(jnp.bfloat16)]
