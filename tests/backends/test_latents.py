"""jaxattn.backends.latents: MLA latents expanded to per-head K/V, as K and V page pools of their
own (fa4's ``mla_prefill``) and as one pool a one-head_dim paged kernel runs (cuDNN's). CPU: the
pool through the xla backend's paged attention against the float64 expanded reference, with NaN
in every unowned page and in the stale slots of owned pages, FP8 pools and broken sequences; the
K and V pools page by page. GPU (``-m gpu``): ``mla_prefill(backend="cudnn")`` at DeepSeek dims
against the xla backend."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.backends import xla
from jaxattn.backends.base import AttentionParams
from jaxattn.backends.latents import attend_expanded, expand_latents, expanded_pages, expanded_pool
from tests.mla_inputs import (break_metadata, check_deepseek_prefill, check_deepseek_prefill_broken_sequences,
                               make_mla_problem)
from tests.paged_inputs import rel_error

DIMS = dict(num_q_heads=4, kv_lora_rank=32, rope_dim=16, nope_dim=24, v_dim=16, page_size=8)
MIXED = dict(q_lens=[1, 1, 6, 13, 2], kv_lens=[5, 33, 6, 40, 2], max_q_len=None)


def _pool_attention(problem, meta: jaxattn.AttentionMetadata) -> jax.Array:
    """MLA prefill as the cuDNN backend runs it (``attend_expanded``), with the xla backend's paged attention."""
    meta, _ = meta.sanitize(problem.q_nope.shape[0], problem.cache.num_pages, problem.cache.page_size)
    params = AttentionParams(scale=problem.scale, causal=True, sliding_window=None, softcap=None, has_sinks=False)
    return attend_expanded(xla.attention, problem.q, problem.cache, meta, problem.w_uk, problem.w_uv, params)


@pytest.mark.parametrize("kv_dtype", [None, jnp.float8_e4m3fn])
def test_expanded_pool_equals_the_float64_reference(kv_dtype):
    problem = make_mla_problem(np.random.default_rng(0), **DIMS, **MIXED, kv_dtype=kv_dtype)
    out = _pool_attention(problem, problem.meta)
    assert rel_error(out, problem.expanded_reference()) < 1e-5
    assert not np.asarray(out[sum(problem.q_lens):]).any()


def test_stale_slots_of_owned_pages_never_reach_the_output():
    """NaN in every slot past each sequence's keys (its last page's tail) leaves the output finite."""
    problem = make_mla_problem(np.random.default_rng(1), **DIMS, **MIXED)
    poisoned = dataclasses.replace(problem, cache=problem.stale_slots_poisoned())
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


@pytest.mark.parametrize("dtype, kv_dtype, dims", [
    (jnp.float32, None, DIMS), (jnp.bfloat16, None, DIMS), (jnp.bfloat16, jnp.float8_e4m3fn, DIMS),
    (jnp.float32, None, dict(DIMS, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128)),
], ids=["f32", "bf16", "bf16-fp8", "f32-deepseek-dims"])
def test_expanded_keys_equal_the_concatenated_formula_exactly(dtype, kv_dtype, dims):
    """K from one GEMM of the whole latent with ``[[W_UK, 0], [0, I]]`` is bit for bit
    ``[c_kv W_UK[:, h], k_rope]`` (the no-RoPE GEMM, the RoPE part broadcast to every head), with
    NaN in the stale slots of owned pages."""
    problem = make_mla_problem(np.random.default_rng(8), **dims, **MIXED, dtype=dtype, kv_dtype=kv_dtype)
    cache = problem.stale_slots_poisoned()
    meta, _ = problem.meta.sanitize(problem.q.shape[0], cache.num_pages, cache.page_size)
    k, _ = jax.jit(expand_latents, static_argnums=4)(cache, meta, problem.w_uk, problem.w_uv, jnp.dtype(dtype))

    def concatenated(cache, meta, w_uk):     # the formula before K came from one GEMM
        latents = cache.pages[meta.block_tables]
        if cache.scale is not None:
            latents = latents.astype(jnp.float32) * cache.scale
        slot = jnp.arange(latents.shape[1] * latents.shape[2]).reshape(latents.shape[1:3])
        latents = jnp.where((slot[None] < meta.kv_lens[:, None, None])[..., None], latents.astype(dtype), 0)
        c_kv, k_rope = latents[..., :cache.kv_lora_rank], latents[..., cache.kv_lora_rank:]
        k_nope = jnp.einsum("bpsr,rhn->bpshn", c_kv, w_uk.astype(dtype), preferred_element_type=dtype)
        return jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[..., None, :], (*k_nope.shape[:4], k_rope.shape[-1]))],
                               axis=-1)

    expected = jax.jit(concatenated)(cache, meta, problem.w_uk)
    assert k.dtype == expected.dtype == dtype and not np.isnan(np.asarray(k.astype(jnp.float32))).any()
    np.testing.assert_array_equal(np.asarray(k.astype(jnp.float32)), np.asarray(expected.astype(jnp.float32)))


def test_expanded_pages_hold_each_sequence_in_its_table_order():
    """K and V pools of their own widths (no padding, no null page): sequence b's page j of the
    expansion is pool page ``tables[b, j]``."""
    problem = make_mla_problem(np.random.default_rng(5), **DIMS, **MIXED)
    meta, _ = problem.meta.sanitize(problem.q_nope.shape[0], problem.cache.num_pages, problem.cache.page_size)
    k, v = expand_latents(problem.cache, meta, problem.w_uk, problem.w_uv, jnp.float32)
    k_pages, v_pages, pages_meta = expanded_pages(problem.cache, meta, problem.w_uk, problem.w_uv, jnp.float32)
    batch, pages = meta.block_tables.shape
    assert k_pages.shape == (batch * pages, 8, 4, 24 + 16) and v_pages.shape == (batch * pages, 8, 4, 16)
    np.testing.assert_array_equal(k_pages[pages_meta.block_tables], k)
    np.testing.assert_array_equal(v_pages[pages_meta.block_tables], v)
    assert sorted(np.asarray(pages_meta.block_tables).ravel().tolist()) == list(range(batch * pages))
    for field in ("cu_q_lens", "kv_lens", "num_decodes"):
        np.testing.assert_array_equal(getattr(pages_meta, field), getattr(meta, field))
    assert (pages_meta.page_size, pages_meta.num_pages) == (8, batch * pages)


def test_expanded_pool_is_the_expansion_behind_a_null_page_written_by_its_gemms():
    """The one-head_dim pool: page 0 zero, then sequence b's page j at ``1 + b P + j``, K and V
    zero-padded to the wider (K here); the expansion's GEMMs write it: no pad or concatenation of
    an array of the pool's shape in the lowered step (the copies the mixed steps' profile showed)."""
    problem = make_mla_problem(np.random.default_rng(8), **DIMS, **MIXED)
    meta, _ = problem.meta.sanitize(problem.q_nope.shape[0], problem.cache.num_pages, problem.cache.page_size)
    k, v = expand_latents(problem.cache, meta, problem.w_uk, problem.w_uv, jnp.float32)
    args = (problem.cache, meta, problem.w_uk, problem.w_uv)
    pool, pool_meta = expanded_pool(*args, jnp.float32)
    batch, pages, width = *meta.block_tables.shape, 24 + 16
    assert pool.k_pages.shape == pool.v_pages.shape == (1 + batch * pages, 8, 4, width)
    assert not np.asarray(pool.k_pages[0]).any() and not np.asarray(pool.v_pages[0]).any()
    np.testing.assert_array_equal(pool_meta.block_tables, 1 + np.arange(batch * pages).reshape(batch, pages))
    assert pool_meta.num_pages == 1 + batch * pages
    np.testing.assert_allclose(pool.k_pages[pool_meta.block_tables], k, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pool.v_pages[pool_meta.block_tables][..., :16], v, rtol=1e-6, atol=1e-6)
    assert not np.asarray(pool.v_pages[..., 16:]).any()
    lowered = jax.jit(expanded_pool, static_argnums=4).lower(*args, jnp.dtype(jnp.float32)).as_text()
    pool_type = f"tensor<{1 + batch * pages}x8x4x{width}xf32>"
    assert not [line for line in lowered.splitlines()
                if pool_type in line.split("->")[-1] and ("pad" in line or "concatenate" in line)]


@pytest.mark.parametrize("page_size", [16, 4])
def test_expanded_pages_regroup_each_sequences_slots(page_size):
    """Pages of another size hold each sequence's expanded slots in order (its keys are contiguous)."""
    problem = make_mla_problem(np.random.default_rng(6), **DIMS, **MIXED)
    meta, _ = problem.meta.sanitize(problem.q_nope.shape[0], problem.cache.num_pages, problem.cache.page_size)
    k, v = expand_latents(problem.cache, meta, problem.w_uk, problem.w_uv, jnp.float32)
    k_pages, v_pages, pages_meta = expanded_pages(problem.cache, meta, problem.w_uk, problem.w_uv, jnp.float32,
                                                  page_size=page_size)
    batch, slots = k.shape[0], k.shape[1] * k.shape[2]
    assert pages_meta.block_tables.shape == (batch, slots // page_size) and pages_meta.page_size == page_size
    np.testing.assert_array_equal(k_pages[pages_meta.block_tables].reshape(k.shape), k)
    np.testing.assert_array_equal(v_pages[pages_meta.block_tables].reshape(v.shape), v)


def test_expanded_pages_refuse_a_page_size_that_splits_slots():
    problem = make_mla_problem(np.random.default_rng(7), **DIMS, **MIXED)
    slots = problem.meta.block_tables.shape[1] * problem.cache.page_size
    with pytest.raises(ValueError, match=f"page_size {slots + 8} does not divide a sequence's {slots} slots"):
        expanded_pages(problem.cache, problem.meta, problem.w_uk, problem.w_uv, jnp.float32, page_size=slots + 8)


# ----------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads", [16, 128])
def test_gpu_cudnn_mla_prefill_matches_xla(num_q_heads):
    check_deepseek_prefill("cudnn", num_q_heads)


@pytest.mark.gpu
def test_gpu_auto_mla_prefill_flags_broken_sequences():
    """auto (cudnn on the GPU)."""
    check_deepseek_prefill_broken_sequences("auto")
