"""Multi-head latent attention (``jaxattn.mla``) on the xla backend: the absorbed form and the
expanded prefill against float64 references and against ``paged_attention`` over expanded K/V;
bad metadata; argument errors."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn.mla import absorb_query, project_values
from tests.mla_inputs import break_metadata, make_mla_problem
from tests.paged_inputs import TOLERANCE, rel_error

# Small DeepSeek-like dims (R 512 / Dr 64 / Dn 128 / Dv 128 at full size).
DIMS = dict(num_q_heads=4, kv_lora_rank=32, rope_dim=16, nope_dim=24, v_dim=16, page_size=8)
DECODE = dict(q_lens=[1, 1, 1, 1], kv_lens=[1, 17, 40, 8], max_q_len=1)
SPEC = dict(q_lens=[3, 1, 4, 2], kv_lens=[9, 30, 24, 2], max_q_len=4)
MIXED = dict(q_lens=[1, 1, 6, 13, 2], kv_lens=[5, 33, 6, 40, 0 + 2], max_q_len=None)


@pytest.mark.parametrize("batch", [DECODE, SPEC, MIXED], ids=["decode", "spec", "mixed"])
def test_absorbed_and_expanded_equal_the_float64_reference(batch):
    problem = make_mla_problem(np.random.default_rng(0), **DIMS, **batch)
    expected = problem.expanded_reference()
    out_latent = jax.jit(lambda *a: jaxattn.mla_paged_attention(*a, scale=problem.scale, backend="xla"))(
        problem.q_latent, problem.q_rope, problem.cache, problem.meta)
    assert rel_error(out_latent, problem.absorbed_reference(problem.q_latent)) < 1e-5
    assert rel_error(project_values(out_latent, problem.w_uv), expected) < 1e-5
    out = jax.jit(lambda *a: jaxattn.mla_prefill(*a, scale=problem.scale, backend="xla"))(
        problem.q_nope, problem.q_rope, problem.cache, problem.meta, problem.w_uk, problem.w_uv)
    assert out.shape == expected.shape and rel_error(out, expected) < 1e-5
    padding = sum(problem.q_lens)
    assert not np.asarray(out[padding:]).any() and not np.asarray(out_latent[padding:]).any()


@pytest.mark.parametrize("batch", [DECODE, MIXED], ids=["decode", "mixed"])
def test_absorbed_equals_paged_attention_over_expanded_kv(batch):
    """The non-absorbed formulation run by ``paged_attention``: latents expanded to Hq KV heads of
    ``Dn + Dr``, values zero-padded to that width."""
    problem = make_mla_problem(np.random.default_rng(1), **DIMS, **batch)
    rank, v_dim = problem.cache.kv_lora_rank, problem.w_uv.shape[2]
    latents = problem.cache.pages                       # unowned pages (NaN) stay NaN in the K/V pools
    c_kv, k_rope = latents[..., :rank], latents[..., rank:]
    k_nope = jnp.einsum("psr,rhn->phsn", c_kv, problem.w_uk)
    k_rope = jnp.broadcast_to(k_rope[:, None], (*k_nope.shape[:3], k_rope.shape[-1]))
    k = jnp.concatenate([k_nope, k_rope], axis=-1)       # HND [pages, Hq, page, Dn + Dr]
    v = jnp.einsum("psr,rhv->phsv", c_kv, problem.w_uv)
    v = jnp.pad(v, ((0, 0),) * 3 + ((0, k.shape[-1] - v_dim),))
    q = jnp.concatenate([problem.q_nope, problem.q_rope], -1)
    expanded = jax.jit(lambda *a: jaxattn.paged_attention(*a, scale=problem.scale, backend="xla"))(
        q, jaxattn.KVCache(k, v), problem.meta)
    absorbed = jax.jit(lambda *a: project_values(jaxattn.mla_paged_attention(*a, scale=problem.scale), problem.w_uv))(
        problem.q_latent, problem.q_rope, problem.cache, problem.meta)
    assert rel_error(absorbed, expanded[..., :v_dim]) < 1e-5


def test_bfloat16():
    problem = make_mla_problem(np.random.default_rng(2), **DIMS, **MIXED, dtype=jnp.bfloat16)
    expected = problem.expanded_reference()
    out_latent = jax.jit(lambda *a: jaxattn.mla_paged_attention(*a, scale=problem.scale))(
        problem.q_latent, problem.q_rope, problem.cache, problem.meta)
    assert out_latent.dtype == jnp.bfloat16
    assert rel_error(out_latent, problem.absorbed_reference(problem.q_latent)) < TOLERANCE[jnp.dtype(jnp.bfloat16)]
    out = jax.jit(lambda *a: jaxattn.mla_prefill(*a, scale=problem.scale))(
        problem.q_nope, problem.q_rope, problem.cache, problem.meta, problem.w_uk, problem.w_uv)
    assert out.dtype == jnp.bfloat16 and rel_error(out, expected) < TOLERANCE[jnp.dtype(jnp.bfloat16)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_pool(dtype):
    """FP8 latents (stored divided by the pool's scale) under float32 or bfloat16 queries."""
    problem = make_mla_problem(np.random.default_rng(8), **DIMS, **MIXED, dtype=dtype, kv_dtype=jnp.float8_e4m3fn)
    tol = TOLERANCE[jnp.dtype(dtype)]
    out_latent = jax.jit(lambda *a: jaxattn.mla_paged_attention(*a, scale=problem.scale))(
        problem.q_latent, problem.q_rope, problem.cache, problem.meta)
    assert out_latent.dtype == dtype and rel_error(out_latent, problem.absorbed_reference(problem.q_latent)) < tol
    out = jax.jit(lambda *a: jaxattn.mla_prefill(*a, scale=problem.scale))(
        problem.q_nope, problem.q_rope, problem.cache, problem.meta, problem.w_uk, problem.w_uv)
    assert rel_error(out, problem.expanded_reference()) < tol


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_prefill_takes_the_query_whole_or_in_parts(kv_dtype):
    """``mla_prefill(q, None, ...)`` with the whole query ``[T, Hq, Dn + Dr]`` gives the rows of
    ``mla_prefill(q_nope, q_rope, ...)`` bit for bit (NaN in the stale slots of owned pages)."""
    problem = make_mla_problem(np.random.default_rng(10), **DIMS, **MIXED, dtype=jnp.bfloat16, kv_dtype=kv_dtype)
    cache = problem.stale_slots_poisoned()
    run = jax.jit(lambda q, q_rope, c: jaxattn.mla_prefill(q, q_rope, c, problem.meta, problem.w_uk, problem.w_uv,
                                                           scale=problem.scale, backend="xla", return_status=True))
    whole, valid = run(problem.q, None, cache)
    parts, _ = run(problem.q_nope, problem.q_rope, cache)
    assert whole.dtype == jnp.bfloat16 and np.asarray(valid[:len(problem.q_lens)]).all()
    np.testing.assert_array_equal(np.asarray(whole.astype(jnp.float32)), np.asarray(parts.astype(jnp.float32)))
    assert rel_error(whole, problem.expanded_reference()) < TOLERANCE[jnp.dtype(jnp.bfloat16)]


def test_non_finite_fp8_scale_flags_every_sequence():
    problem = make_mla_problem(np.random.default_rng(9), **DIMS, **DECODE, kv_dtype=jnp.float8_e4m3fn)
    run = jax.jit(lambda c: jaxattn.mla_paged_attention(problem.q_latent, problem.q_rope, c, problem.meta,
                                                        scale=problem.scale, return_status=True))
    assert np.asarray(run(problem.cache)[1]).all()
    out, valid = run(dataclasses.replace(problem.cache, scale=jnp.float32(jnp.inf)))
    assert not np.asarray(valid).any() and not np.asarray(out).any()


@pytest.mark.parametrize("max_q_len", [1, 3, None])
def test_broken_sequences_are_zero_and_flagged(max_q_len):
    q_lens = [1, 1, 1, 1, 1] if max_q_len == 1 else [1, 1, 4, 2, 3]
    rng = np.random.default_rng(3)
    problem = make_mla_problem(rng, **DIMS, q_lens=q_lens, kv_lens=[9, 20, 17, 4, 30], max_q_len=max_q_len)
    meta, broken = break_metadata(rng, problem, ["page", "none", "short", "long", "none"])
    expected = problem.without(broken)
    for name, run in (
            ("mla_paged_attention", lambda m: jaxattn.mla_paged_attention(
                problem.q_latent, problem.q_rope, problem.cache, m, scale=problem.scale, return_status=True)),
            ("mla_prefill", lambda m: jaxattn.mla_prefill(
                problem.q_nope, problem.q_rope, problem.cache, m, problem.w_uk, problem.w_uv, scale=problem.scale,
                return_status=True))):
        out, valid = jax.jit(run)(meta)
        np.testing.assert_array_equal(valid, ~broken, err_msg=name)
        out = np.asarray(out, np.float64)
        assert not np.isnan(out).any(), f"{name}: a page the sequence does not own reached its output"
        ref = (expected.absorbed_reference(problem.q_latent) if name == "mla_paged_attention"
               else expected.expanded_reference())
        np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4, err_msg=name)


@pytest.mark.parametrize("max_prefill_seqs", [None, 1, 2, 3, 8])
def test_prefill_of_a_mixed_batch_runs_decodes_absorbed_and_a_bounded_prefill_part(max_prefill_seqs):
    """``auto`` serves a mixed batch's leading decodes absorbed and the rest expanded, over
    ``meta.max_prefill_seqs`` sequences past the decodes; a sequence with tokens after them breaks
    the bound: zero rows, flagged. The same as the xla backend's whole call on the metadata."""
    batch = dict(q_lens=[1, 1, 1, 6, 13, 2], kv_lens=[5, 33, 9, 6, 40, 2], max_q_len=None)
    problem = make_mla_problem(np.random.default_rng(12), **DIMS, **batch)
    meta = dataclasses.replace(problem.meta, max_prefill_seqs=max_prefill_seqs)
    plan = jaxattn.plan(meta, problem.cache, problem.q, op="mla_prefill", w_uk=problem.w_uk, w_uv=problem.w_uv,
                        scale=problem.scale)
    assert plan.decode is not None and plan.decode.op == "mla_paged_attention" and plan.main.op == "mla_prefill"
    assert plan.main.meta.batch_size == min(max_prefill_seqs or 7, 7)
    kept = np.array([b < 3 + (max_prefill_seqs or 6) for b in range(6)])
    expected = problem.without(~kept).expanded_reference()
    for backend, given in (("auto", meta), ("auto", plan), ("xla", meta)):
        out, valid = jax.jit(lambda m, backend=backend: jaxattn.mla_prefill(
            problem.q_nope, problem.q_rope, problem.cache, m, problem.w_uk, problem.w_uv, scale=problem.scale,
            backend=backend, return_status=True))(given)
        np.testing.assert_array_equal(np.asarray(valid)[:6], kept, err_msg=backend)
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=2e-5, atol=2e-5, err_msg=backend)


def test_non_causal():
    problem = make_mla_problem(np.random.default_rng(4), **DIMS, **SPEC)
    out = jax.jit(lambda *a: jaxattn.mla_paged_attention(*a, scale=problem.scale, causal=False))(
        problem.q_latent, problem.q_rope, problem.cache, problem.meta)
    assert rel_error(out, problem.absorbed_reference(problem.q_latent, causal=False)) < 1e-5


def test_absorb_query_and_project_values_shapes():
    problem = make_mla_problem(np.random.default_rng(5), **DIMS, **DECODE)
    q_latent = absorb_query(problem.q_nope, problem.w_uk)
    assert q_latent.shape == (problem.q_nope.shape[0], DIMS["num_q_heads"], DIMS["kv_lora_rank"])
    assert project_values(q_latent, problem.w_uv).shape == (q_latent.shape[0], DIMS["num_q_heads"], DIMS["v_dim"])


@pytest.mark.parametrize("change, message", [
    (dict(cache="kv"), "cache must be a jaxattn.MLACache"),
    (dict(q_latent=lambda p: p.q_latent[..., :-1]), "q_latent must have the cache's kv_lora_rank"),
    (dict(q_rope=lambda p: p.q_rope[:, :2]), "q_rope must be \\[T="),
    (dict(q_rope=lambda p: p.q_rope.astype(jnp.bfloat16)), "q_rope.dtype must be the cache's float32"),
    (dict(q_latent=lambda p: p.q_latent.astype(jnp.int32)), "q_latent.dtype must be float32, bfloat16 or float16"),
    (dict(scale=None), "scale must be a positive finite float"),
    (dict(causal=1), "causal must be a bool"),
    (dict(backend="cudnn"), "backend must be one of \\('auto', 'xla', 'triton', 'flashinfer'\\)"),
    (dict(return_status="yes"), "return_status must be a bool"),
    (dict(scale=1e39), "scale must be a positive finite float"),
    (dict(q_latent=lambda p: p.q_latent[:, :0]), "q_latent must be \\[T, Hq, D\\] with T >= 1 \\(and Hq, D >= 1\\)"),
    (dict(q_latent=lambda p: jax.ShapeDtypeStruct(p.q_latent.shape, p.q_latent.dtype)),
     "q_latent must be an array, got ShapeDtypeStruct"),
])
def test_bad_arguments_raise(change, message):
    problem = make_mla_problem(np.random.default_rng(6), **DIMS, **DECODE)
    args = dict(q_latent=problem.q_latent, q_rope=problem.q_rope, cache=problem.cache, meta=problem.meta,
                scale=problem.scale)
    for key, value in change.items():
        args[key] = value(problem) if callable(value) else value
    if args["cache"] == "kv":
        args["cache"] = jaxattn.KVCache.create(4, 8, 1, 48, dtype=jnp.float32)
    with pytest.raises(ValueError, match=message):
        jaxattn.mla_paged_attention(**args)


@pytest.mark.parametrize("weight, shape, message", [
    ("w_uk", (32, 4, 23), "w_uk must be \\[kv_lora_rank=32, Hq=4, Dn=24\\]"),
    ("w_uv", (32, 3, 16), "w_uv must be \\[kv_lora_rank=32, Hq=4, Dv\\]"),
    ("w_uv", (32, 4, 0), "w_uv must be \\[kv_lora_rank=32, Hq=4, Dv\\]"),
])
def test_prefill_bad_weights_raise(weight, shape, message):
    problem = make_mla_problem(np.random.default_rng(7), **DIMS, **MIXED)
    weights = dict(w_uk=problem.w_uk, w_uv=problem.w_uv)
    weights[weight] = jnp.zeros(shape, jnp.float32)
    with pytest.raises(ValueError, match=message):
        jaxattn.mla_prefill(problem.q_nope, problem.q_rope, problem.cache, problem.meta, scale=problem.scale,
                            **weights)
    with pytest.raises(ValueError, match="backend must be one of \\('auto', 'xla', 'cudnn', 'triton', 'fa4'\\)"):
        jaxattn.mla_prefill(problem.q_nope, problem.q_rope, problem.cache, problem.meta, problem.w_uk, problem.w_uv,
                            scale=problem.scale, backend="flashinfer")


def test_whole_query_arguments_raise():
    """The whole query must be ``w_uk``'s Dn plus the cache's rope_dim wide (its weights checked as
    the parts' are) and comes without q_rope; the absorbed op has no whole form, so its q_rope is
    required."""
    problem = make_mla_problem(np.random.default_rng(11), **DIMS, **MIXED)
    rest = (problem.cache, problem.meta, problem.w_uk, problem.w_uv)
    for q in (problem.q_nope, problem.q[..., :-1], jnp.pad(problem.q, ((0, 0), (0, 0), (0, 1)))):
        with pytest.raises(ValueError, match=re.escape(
                f"mla_prefill: q must be the whole query [T, Hq, Dn + Dr] (no-RoPE part first), Dn + Dr = 24 + 16 "
                f"(w_uk's Dn, the cache's rope_dim), got shape {tuple(q.shape)}")):
            jaxattn.mla_prefill(q, None, *rest, scale=problem.scale)
    with pytest.raises(ValueError, match=re.escape("mla_prefill: w_uv must be [kv_lora_rank=32, Hq=4, Dv]")):
        jaxattn.mla_prefill(problem.q, None, *rest[:3], problem.w_uv[:, :3], scale=problem.scale)
    with pytest.raises(ValueError, match=re.escape("mla_prefill: w_uk.dtype must be float32 (like q)")):
        jaxattn.mla_prefill(problem.q, None, *rest[:2], problem.w_uk.astype(jnp.bfloat16), problem.w_uv,
                            scale=problem.scale)
    with pytest.raises(ValueError, match=re.escape("mla_prefill: q_nope is 40 wide, the whole query's Dn + Dr = 24 + "
                                                   "16, and q_rope was given too: pass the whole query")):
        jaxattn.mla_prefill(problem.q, problem.q_rope, *rest, scale=problem.scale)
    with pytest.raises(ValueError, match=re.escape("mla_paged_attention: q_rope must be [T=")):
        jaxattn.mla_paged_attention(problem.q_latent, None, problem.cache, problem.meta, scale=problem.scale)
