"""jaxattn.backends.latents: MLA latents expanded to per-head K/V, and to a page pool of their own
that a one-head_dim paged kernel runs (cuDNN's ``mla_prefill``). CPU: the pool through the xla
backend's paged attention against the float64 expanded reference, with NaN in every unowned page
and in the stale slots of owned pages, FP8 pools and broken sequences. GPU (``-m gpu``):
``mla_prefill(backend="cudnn")`` at DeepSeek dims against the xla backend."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backends import xla
from jaxattn.backends.base import AttentionParams
from jaxattn.backends.latents import attend_expanded, expand_latents
from tests.mla_inputs import break_metadata, make_mla_problem
from tests.paged_inputs import rel_error

DIMS = dict(num_q_heads=4, kv_lora_rank=32, rope_dim=16, nope_dim=24, v_dim=16, page_size=8)
MIXED = dict(q_lens=[1, 1, 6, 13, 2], kv_lens=[5, 33, 6, 40, 2], max_q_len=None)
DEEPSEEK = dict(kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128, page_size=64)


def _pool_attention(problem, meta: jaxattn.AttentionMetadata) -> jax.Array:
    """MLA prefill as the cuDNN backend runs it (``attend_expanded``), with the xla backend's paged attention."""
    meta, _ = meta.sanitize(problem.q_nope.shape[0], problem.cache.num_pages, problem.cache.page_size)
    params = AttentionParams(scale=problem.scale, causal=True, sliding_window=None, softcap=None, has_sinks=False)
    return attend_expanded(xla.attention, problem.q_nope, problem.q_rope, problem.cache, meta, problem.w_uk,
                           problem.w_uv, params)


@pytest.mark.parametrize("kv_dtype", [None, jnp.float8_e4m3fn])
def test_expanded_pool_equals_the_float64_reference(kv_dtype):
    problem = make_mla_problem(np.random.default_rng(0), **DIMS, **MIXED, kv_dtype=kv_dtype)
    out = _pool_attention(problem, problem.meta)
    assert rel_error(out, problem.expanded_reference()) < 1e-5
    assert not np.asarray(out[sum(problem.q_lens):]).any()


def test_stale_slots_of_owned_pages_never_reach_the_output():
    """NaN in every slot past each sequence's keys (its last page's tail) leaves the output finite."""
    problem = make_mla_problem(np.random.default_rng(1), **DIMS, **MIXED)
    pages = np.array(problem.cache.pages)
    for b, n in enumerate(problem.kv_lens):
        last, used = divmod(n, problem.cache.page_size)
        if used:
            pages[problem.tables[b, last], used:] = np.nan
    poisoned = dataclasses.replace(problem, cache=dataclasses.replace(problem.cache, pages=jnp.asarray(pages)))
    assert rel_error(_pool_attention(poisoned, poisoned.meta), problem.expanded_reference()) < 1e-5


def test_broken_sequences_are_zero():
    problem = make_mla_problem(np.random.default_rng(2), **DIMS, **MIXED)
    meta, broken = break_metadata(np.random.default_rng(3), problem, ["page", "none", "short", "long", "none"])
    out = _pool_attention(problem, meta)
    assert rel_error(out, problem.without(broken).expanded_reference()) < 1e-5


def test_expand_latents_shapes_and_zero_tail():
    problem = make_mla_problem(np.random.default_rng(4), **DIMS, **MIXED)
    meta, _ = problem.meta.sanitize(problem.q_nope.shape[0], problem.cache.num_pages, problem.cache.page_size)
    k, v = expand_latents(problem.cache, meta, problem.w_uk, problem.w_uv, jnp.float32)
    batch, pages = meta.block_tables.shape
    assert k.shape == (batch, pages, 8, 4, 24 + 16) and v.shape == (batch, pages, 8, 4, 16)
    slots = np.arange(pages * 8).reshape(pages, 8)
    for b, n in enumerate(np.asarray(meta.kv_lens)):
        assert not np.asarray(k[b])[slots >= n].any() and not np.asarray(v[b])[slots >= n].any()


# ----------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads", [16, 128])
def test_gpu_cudnn_mla_prefill_matches_xla(num_q_heads):
    """DeepSeek dims (Dn 128 + Dr 64 keys, Dv 128 values), bf16, chunked prefill over cached
    context, a decode, padding, and NaN in every unowned page."""
    rng = np.random.default_rng(num_q_heads)
    problem = make_mla_problem(rng, num_q_heads=num_q_heads, q_lens=[1, 200, 64, 9], kv_lens=[700, 200, 1000, 9],
                               dtype=jnp.bfloat16, **DEEPSEEK)
    args = (problem.q_nope, problem.q_rope, problem.cache, problem.meta, problem.w_uk, problem.w_uv)
    run = {name: jax.jit(lambda *a, name=name: jaxattn.mla_prefill(*a, scale=problem.scale, backend=name))
           for name in ("cudnn", "xla")}
    out = run["cudnn"](*args)
    assert rel_error(out, run["xla"](*args)) < 2e-2
    assert rel_error(out, problem.expanded_reference()) < 2e-2
    assert not np.asarray(out[sum(problem.q_lens):].astype(jnp.float32)).any()


@pytest.mark.gpu
def test_gpu_auto_mla_prefill_flags_broken_sequences():
    """auto (cudnn on the GPU) with every fault at DeepSeek dims: broken sequences get zero rows
    and a False flag, the others match the float64 reference, no unowned page reaches an output."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    q_lens = [1, 150, 64, 9, 40, 1]
    kv_lens = [700, 300, 1000, 9, 40, 65]
    problem = make_mla_problem(rng, num_q_heads=16, q_lens=q_lens, kv_lens=kv_lens, max_q_len=150,
                               dtype=jnp.bfloat16, **DEEPSEEK)
    meta, broken = break_metadata(rng, problem, ["page", "none", "short", "none", "long", "none"])
    run = jax.jit(lambda *a: jaxattn.mla_prefill(*a, scale=problem.scale, return_status=True))
    out, valid = run(problem.q_nope, problem.q_rope, problem.cache, meta, problem.w_uk, problem.w_uv)
    np.testing.assert_array_equal(valid, ~broken, err_msg=f"seed {seed}")
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert not np.isnan(out).any(), f"a page the sequence does not own reached its output (seed {seed})"
    assert rel_error(out, problem.without(broken).expanded_reference()) < 2e-2, f"seed {seed}"
