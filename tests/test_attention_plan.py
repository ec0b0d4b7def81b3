"""``jaxattn.plan``: a plan made once gives every call the rows it gives without one, calls that do
not match their plan raise, and a model step's metadata work does not grow with its layers."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxattn
from jaxattn import attention_plan
from jaxattn.serve.engine import Engine
from jaxattn.serve.models.deepseek import PRESETS as DEEPSEEK_PRESETS
from jaxattn.serve.models.deepseek import DeepSeek
from jaxattn.serve.models.llama import PRESETS, Llama
from tests.mla_inputs import make_mla_problem
from tests.paged_inputs import make_problem, reference, rel_error
from tests.serve.test_step import trace_step
from tests.test_sharding import run_on_cpu_devices

FP8 = "float8_e4m3fn"


def _problem(seed: int = 0, **kwargs):
    options = dict(q_lens=[1, 1, 5, 3], kv_lens=[9, 30, 12, 3], num_q_heads=4, num_kv_heads=2, head_dim=32,
                   page_size=8, dtype=jnp.float32, pad_seqs=1, pad_tokens=2, max_q_len=5)
    return make_problem(np.random.default_rng(seed), **(options | kwargs))


def test_a_plan_gives_every_layer_the_rows_of_a_call_without_one():
    """One plan, two "layers" (caches of other contents, FP8 scales included): each call's rows and
    ``valid`` equal the same call's without a plan, under jit, for bf16-like and FP8 pages."""
    problem = _problem(seed=1)
    sinks = jnp.asarray(np.random.default_rng(2).normal(size=4), jnp.float32)
    options = dict(sliding_window=7, softcap=20.0)
    for fp8 in (False, True):
        caches = [_problem(seed=seed, kv_dtype=FP8 if fp8 else None).cache for seed in (1, 3)]

        @jax.jit
        def step(q, caches, meta, sinks):
            plan = jaxattn.plan(meta, caches[0], q, sinks=sinks, **options)
            planned = [jaxattn.paged_attention(q, cache, plan, sinks=sinks, return_status=True) for cache in caches]
            bare = [jaxattn.paged_attention(q, cache, meta, sinks=sinks, return_status=True, **options)
                    for cache in caches]
            return planned, bare

        planned, bare = step(problem.q, caches, problem.meta, sinks)
        for (out, valid), (want, want_valid) in zip(planned, bare):
            np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
            np.testing.assert_array_equal(np.asarray(valid), np.asarray(want_valid))


def test_a_plan_matches_the_reference_and_keeps_the_contract():
    """Through a plan: the float64 reference's rows, and a sequence that breaks the contract gets
    zero rows and ``valid`` False."""
    problem = _problem(seed=5)
    meta = dataclasses.replace(problem.meta, kv_lens=problem.meta.kv_lens.at[1].set(10_000))
    plan = jaxattn.plan(meta, problem.cache, problem.q)
    out, valid = jaxattn.paged_attention(problem.q, problem.cache, plan, return_status=True)
    ref = reference(problem)
    ref[1] = 0.0
    assert rel_error(out, ref) < 1e-5
    assert list(np.asarray(valid)) == [True, False, True, True, True]


def test_fp8_scales_are_checked_per_call():
    """A plan holds no scales: a layer whose FP8 scales are not positive and finite gets zero rows
    and every sequence invalid, the other layers on the same plan are untouched."""
    problem = _problem(seed=6)
    good = _problem(seed=6, kv_dtype=FP8).cache
    plan = jaxattn.plan(problem.meta, good, problem.q)
    for bad_scale in (jnp.nan, 0.0, -1.0, jnp.inf):
        bad = dataclasses.replace(good, v_scale=jnp.asarray(bad_scale, jnp.float32))
        out, valid = jaxattn.paged_attention(problem.q, bad, plan, return_status=True)
        assert not np.asarray(out).any() and not np.asarray(valid).any(), bad_scale
    out, valid = jaxattn.paged_attention(problem.q, good, plan, return_status=True)
    assert np.asarray(out).any() and np.asarray(valid[:4]).all()


def test_calls_that_do_not_match_their_plan_raise():
    problem = _problem()
    q, cache, meta = problem.q, problem.cache, problem.meta
    plan = jaxattn.plan(meta, cache, q, sliding_window=4)
    cases = [
        (lambda: jaxattn.paged_attention(q[:-1], cache, plan), "the query: planned float32"),
        (lambda: jaxattn.paged_attention(q.astype(jnp.bfloat16), cache, plan), "q is bfloat16"),
        (lambda: jaxattn.paged_attention(q, cache, plan, sliding_window=8),
         "sliding_window=8, but the plan was made with sliding_window=4"),
        (lambda: jaxattn.paged_attention(q, cache, plan, sinks=jnp.zeros(4)), "the plan was made without sinks"),
        (lambda: jaxattn.paged_attention(q, cache, plan, backend="xla"),
         "backend='xla', but the plan was made for backend='auto'"),
        (lambda: jaxattn.paged_attention(q, _problem(page_size=4).cache, plan), "does not match the plan"),
        (lambda: jaxattn.plan(meta, cache, q, op="attention"), "op must be one of"),
        (lambda: jaxattn.plan(meta, cache, q, q_rope=q), "q_rope is an MLA argument"),
        (lambda: jaxattn.plan(meta, cache, q, scale=-1.0), "paged_attention: scale must be a positive finite"),
        (lambda: jaxattn.plan(meta, cache, q[0]), "paged_attention: q must be [T, Hq, D]"),
        (lambda: jaxattn.plan(meta, cache, q.astype(jnp.int32)), "paged_attention: q.dtype must be"),
        (lambda: jaxattn.plan(meta, cache, q[:, :3]), "must be a multiple of the cache's num_kv_heads"),
        (lambda: jaxattn.plan(meta, cache, q, sinks=jnp.zeros(3)), "sinks must be float32[4]"),
        (lambda: jaxattn.plan(meta, cache, q, backend="nope"), "backend must be one of"),
        (lambda: jaxattn.plan(meta, cache, q, op="mla_prefill", sliding_window=4),
         "sliding_window is a paged_attention option"),
        (lambda: jaxattn.plan(meta, cache, q, op="mla_paged_attention", scale=0.1),
         "mla_paged_attention: cache must be a jaxattn.MLACache"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
    # Options left at their defaults are the plan's: this call runs with the window.
    np.testing.assert_array_equal(np.asarray(jaxattn.paged_attention(q, cache, plan)),
                                  np.asarray(jaxattn.paged_attention(q, cache, meta, sliding_window=4)))


def test_mla_plans():
    """Both MLA ops through a plan give the rows they give without one; a plan of one op is refused
    by the other."""
    problem = make_mla_problem(np.random.default_rng(7), q_lens=[1, 4, 2], kv_lens=[20, 9, 2], num_q_heads=4,
                               kv_lora_rank=32, rope_dim=16, nope_dim=16, v_dim=16, page_size=8, dtype=jnp.float32)
    q_latent = jaxattn.mla.absorb_query(problem.q_nope, problem.w_uk)
    scale = 0.2
    absorbed = jaxattn.plan(problem.meta, problem.cache, q_latent, op="mla_paged_attention", q_rope=problem.q_rope,
                            scale=scale)
    np.testing.assert_array_equal(
        np.asarray(jaxattn.mla_paged_attention(q_latent, problem.q_rope, problem.cache, absorbed, scale=scale)),
        np.asarray(jaxattn.mla_paged_attention(q_latent, problem.q_rope, problem.cache, problem.meta, scale=scale)))
    prefill = jaxattn.plan(problem.meta, problem.cache, problem.q_nope, op="mla_prefill", q_rope=problem.q_rope,
                           w_uk=problem.w_uk, w_uv=problem.w_uv, scale=scale)
    args = (problem.q_nope, problem.q_rope, problem.cache)
    np.testing.assert_array_equal(
        np.asarray(jaxattn.mla_prefill(*args, prefill, problem.w_uk, problem.w_uv, scale=scale)),
        np.asarray(jaxattn.mla_prefill(*args, problem.meta, problem.w_uk, problem.w_uv, scale=scale)))
    with pytest.raises(ValueError, match="the plan was made for mla_prefill, not mla_paged_attention"):
        jaxattn.mla_paged_attention(q_latent, problem.q_rope, problem.cache, prefill, scale=scale)
    with pytest.raises(ValueError, match="scale=0.3, but the plan was made with scale=0.2"):
        jaxattn.mla_prefill(*args, prefill, problem.w_uk, problem.w_uv, scale=0.3)


def test_mla_prefill_plans_serve_either_query_form():
    """mla_prefill's plan holds the whole query's shape: a plan made from the parts serves a call
    given the whole query and the reverse (``q_rope=None``, an array or a ShapeDtypeStruct), all with
    the same rows; a whole query of another width does not match."""
    problem = make_mla_problem(np.random.default_rng(8), q_lens=[1, 4, 2], kv_lens=[20, 9, 2], num_q_heads=4,
                               kv_lora_rank=32, rope_dim=16, nope_dim=16, v_dim=16, page_size=8, dtype=jnp.float32)
    weights = dict(w_uk=problem.w_uk, w_uv=problem.w_uv)
    from_parts = jaxattn.plan(problem.meta, problem.cache, problem.q_nope, op="mla_prefill", q_rope=problem.q_rope,
                              scale=0.2, **weights)
    from_whole = jaxattn.plan(problem.meta, problem.cache, jax.ShapeDtypeStruct(problem.q.shape, problem.q.dtype),
                              op="mla_prefill", q_rope=None, scale=0.2, **weights)
    assert from_parts.signature == from_whole.signature
    rest = (problem.w_uk, problem.w_uv)
    expected = np.asarray(jaxattn.mla_prefill(problem.q_nope, problem.q_rope, problem.cache, problem.meta, *rest,
                                              scale=0.2))
    for plan in (from_parts, from_whole):
        for q, q_rope in ((problem.q, None), (problem.q_nope, problem.q_rope)):
            out = jax.jit(lambda q, q_rope, plan: jaxattn.mla_prefill(q, q_rope, problem.cache, plan, *rest, scale=0.2))
            np.testing.assert_array_equal(np.asarray(out(q, q_rope, plan)), expected)
    # A pool of wider RoPE parts (Dr 24) takes a wider whole query, which the plan was not made for.
    wider = dataclasses.replace(problem.cache, pages=jnp.pad(problem.cache.pages, ((0, 0), (0, 0), (0, 8))))
    tokens = problem.q.shape[0]
    with pytest.raises(ValueError, match=re.escape(f"the query: planned float32[{tokens}, 4, 32], "
                                                   f"got float32[{tokens}, 4, 40]")):
        jaxattn.mla_prefill(jnp.pad(problem.q, ((0, 0), (0, 0), (0, 8))), None, wider, from_whole, *rest, scale=0.2)


def test_plan_is_a_pytree():
    problem = _problem()
    plan = jaxattn.plan(problem.meta, problem.cache, jax.ShapeDtypeStruct(problem.q.shape, problem.q.dtype))
    leaves, treedef = jax.tree.flatten(plan)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    again = jax.tree.unflatten(treedef, leaves)
    assert again.route == plan.route and again.params == plan.params
    out = jax.jit(lambda q, cache, plan: jaxattn.paged_attention(q, cache, plan))(problem.q, problem.cache, plan)
    assert rel_error(out, reference(problem)) < 1e-5


# ------------------------------------------------------------- a model step's metadata work per layer

def metadata_instructions(model, kv_dtype: str | None, mixed: bool, mesh=None) -> int:
    """How many instructions of the compiled engine step's entry computation (CPU, the xla
    backend) produce integer or boolean arrays (not scalars): the metadata work XLA left apart,
    once per step when the layers share it. (Each FP8 layer adds one scalar, its scales' check.)"""
    engine = Engine(model, max_seqs=4, max_seq_len=64, page_size=8, max_step_tokens=16, backend="xla",
                    kv_dtype=kv_dtype, mesh=mesh)
    shape = engine.buckets.shapes[-1] if mixed else engine.buckets.shapes[0]
    text = trace_step(engine, shape).lower().compile().as_text()
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    kinds = re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = \(?(\w+)\[([\d,]*)\]", entry, re.MULTILINE)
    return sum(1 for dtype, dims in kinds if dims and re.fullmatch(r"s32|u32|s64|pred", dtype))


def _llama(layers: int):
    return Llama(PRESETS["tiny"].replace(num_layers=layers), nnx.Rngs(0))


def _deepseek(layers: int):
    return DeepSeek(DEEPSEEK_PRESETS["tiny"].replace(num_layers=layers), nnx.Rngs(0))


def check_metadata_work_per_layer(make_model, mesh=None, kv_dtypes=(None, FP8)) -> None:
    """At 2 and 4 layers (decode and mixed steps, caches of each of ``kv_dtypes``: None is the
    model's dtype) the step has the same metadata instructions: none per layer. (From 1 layer to 2,
    XLA stops fusing the step's shared index arrays into their one consumer: a constant, once per
    step.)"""
    for kv_dtype in kv_dtypes:
        for mixed in (False, True):
            counts = [metadata_instructions(make_model(layers), kv_dtype, mixed, mesh) for layers in (2, 4)]
            assert counts[0] == counts[1], (kv_dtype, mixed, counts)


@pytest.mark.parametrize("make_model", [_llama, _deepseek], ids=["llama", "deepseek"])
def test_a_model_step_pays_its_metadata_work_once(make_model):
    check_metadata_work_per_layer(make_model)


def check_sharded_step_pays_its_metadata_work_once() -> None:
    from jaxattn import sharding

    mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    # FP8 caches only: the case where each layer's own scales made the work differ per layer
    # (bf16 caches take the same plan path, checked unsharded above).
    check_metadata_work_per_layer(_llama, mesh, kv_dtypes=(FP8,))
    # One custom_partitioning call built per step shape, shared by the step's layers (3: a model
    # not traced above, whose step jax has not cached).
    sharding._head_partitioned.cache_clear()
    metadata_instructions(_llama(3), None, False, mesh)
    info = sharding._head_partitioned.cache_info()
    assert (info.misses, info.hits) == (1, 2), info


def test_a_sharded_model_step_pays_its_metadata_work_once():
    """As above with tensor parallelism over 2 CPU devices (each layer's attention a
    ``custom_partitioning`` call that takes the plan's arrays as replicated operands)."""
    run_on_cpu_devices(2, "from tests.test_attention_plan import check_sharded_step_pays_its_metadata_work_once; "
                          "check_sharded_step_pays_its_metadata_work_once()")


def test_sanitize_is_the_metadata_reference():
    problem = _problem()
    meta, valid = attention_plan.sanitize(problem.q.shape[0], problem.cache, problem.meta)
    want, want_valid = problem.meta.sanitize(problem.q.shape[0], problem.cache.num_pages, problem.cache.page_size)
    for got, expected in zip(jax.tree.leaves((meta, valid)), jax.tree.leaves((want, want_valid))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("max_q_len", [1, 4, None], ids=["decode", "spec", "mixed"])
@pytest.mark.parametrize("backend", ["auto", "triton", "trtllm", "fa4", "cudnn"])
def test_gpu_a_plan_gives_the_rows_of_a_call_without_one(backend, max_q_len, kv_dtype):
    """On the GPU backends (their prepared operands made once by the plan): two layers' calls on one
    plan give exactly the rows and ``valid`` of the same calls without one, and the reference's."""
    from jaxattn import backends
    from jaxattn.backends.base import Call

    q_lens = [1, 1, 1, 3, 4] if max_q_len is not None else [1, 1, 1, 300, 77]
    problems = [make_problem(np.random.default_rng(seed), q_lens=q_lens, kv_lens=[700, 90, 3, 1200, 77],
                             num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64, dtype=jnp.bfloat16,
                             kv_dtype=kv_dtype, max_q_len=max_q_len if max_q_len != 1 else None)
                for seed in (8, 9)]
    problem = problems[0]
    meta = problem.meta
    q = problem.q
    if max_q_len == 1:           # decode-only: the decodes alone, one token each
        q = q[:3]
        meta = dataclasses.replace(meta, cu_q_lens=jnp.minimum(meta.cu_q_lens, 3), max_q_len=1,
                                   kv_lens=meta.kv_lens.at[3:].set(0))
    if backend != "auto":
        params = attention_plan.check_attention_args(q, problem.cache, meta)
        reason = backends.check(backend, Call("paged_attention", q, problem.cache, meta, params))
        if reason is not None:
            pytest.skip(reason)

    @jax.jit
    def step(q, caches, meta):
        plan = jaxattn.plan(meta, caches[0], q, backend=backend)
        planned = [jaxattn.paged_attention(q, cache, plan, return_status=True) for cache in caches]
        bare = [jaxattn.paged_attention(q, cache, meta, backend=backend, return_status=True) for cache in caches]
        return planned, bare

    planned, bare = step(q, [p.cache for p in problems], meta)
    for (out, valid), (want, want_valid) in zip(planned, bare):
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
        np.testing.assert_array_equal(np.asarray(valid), np.asarray(want_valid))
    if max_q_len != 1:
        assert rel_error(planned[0][0], reference(problem)) < 3e-2
