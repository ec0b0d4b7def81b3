"""paged_attention: argument checks (ValueError at trace time), backend dispatch, and every backend
against float64 on random configurations."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import AttentionMetadata, KVCache
from jaxattn import attention as attention_module
from jaxattn import attention_plan, backends, dispatch
from jaxattn.backends.base import Call
from tests.conftest import HAS_GPU
from tests.paged_inputs import (RANDOM_SEEDS, RANDOM_TOLERANCE, XQA_FP8_TOLERANCE, RandomCase, make_problem,
                                random_case, reference, rel_error)


def _inputs(num_q_heads=4, head_dim=64, dtype=jnp.bfloat16, batch=2, tokens=5, pages=3):
    cache = KVCache.create(8, 16, 2, 64, dtype=jnp.bfloat16)
    q = jnp.zeros((tokens, num_q_heads, head_dim), dtype)
    meta = AttentionMetadata(
        cu_q_lens=jnp.asarray([0, 1, 5] + [5] * (batch - 2), jnp.int32),
        kv_lens=jnp.full((batch,), 9, jnp.int32),
        block_tables=jnp.ones((batch, pages), jnp.int32),
        num_decodes=jnp.asarray(1, jnp.int32),
    )
    return q, cache, meta


def _with(meta: AttentionMetadata, **fields) -> AttentionMetadata:
    return dataclasses.replace(meta, **fields)


q0, cache0, meta0 = _inputs()

BAD_CALLS = [
    (dict(q=q0[0]), "q must be \\[T, Hq, D\\] with T >= 1"),
    (dict(q=q0[:0]), "q must be \\[T, Hq, D\\] with T >= 1"),
    (dict(scale=jnp.float32(0.1)), "scale must be a positive finite float"),
    (dict(sliding_window=True), "sliding_window must be None or an int >= 1"),
    (dict(q=q0.astype(jnp.int32)), "q.dtype must be float32, bfloat16 or float16"),
    (dict(q=jnp.zeros((5, 4, 32), jnp.bfloat16)), "q head_dim 32 does not match the cache's head_dim 64"),
    (dict(q=jnp.zeros((5, 3, 64), jnp.bfloat16)), "query heads \\(3\\) must be a multiple of the cache's num_kv_heads \\(2\\)"),
    (dict(q=q0.astype(jnp.float16)), "cache pages are bfloat16 but q is float16"),
    (dict(cache=(cache0.k_pages, cache0.v_pages)), "cache must be a jaxattn.KVCache"),
    (dict(meta={"kv_lens": 1}), "meta must be a jaxattn.AttentionMetadata"),
    (dict(meta=_with(meta0, cu_q_lens=jnp.asarray([0, 5], jnp.int32))), "meta.cu_q_lens must have shape \\[3\\]"),
    (dict(meta=_with(meta0, kv_lens=jnp.zeros((2, 1), jnp.int32))), "meta.kv_lens must have shape"),
    (dict(meta=_with(meta0, num_decodes=jnp.zeros((1,), jnp.int32))), "meta.num_decodes must have shape \\[\\]"),
    (dict(meta=_with(meta0, block_tables=jnp.ones((3, 2), jnp.int32))), "meta.block_tables must be \\[B=2, P\\]"),
    (dict(meta=_with(meta0, kv_lens=jnp.zeros((2,), jnp.int64 if jax.config.x64_enabled else jnp.float32))),
     "meta.kv_lens must be int32"),
    (dict(meta=_with(meta0, max_q_len=0)), "meta.max_q_len must be None or an int >= 1"),
    (dict(meta=_with(meta0, max_prefill_seqs=0)), "meta.max_prefill_seqs must be None or an int >= 1"),
    (dict(scale=-1.0), "scale must be a positive finite float"),
    (dict(scale=float("nan")), "scale must be a positive finite float"),
    (dict(causal=1), "causal must be a bool"),
    (dict(sliding_window=0), "sliding_window must be None or an int >= 1"),
    (dict(sliding_window=2.5), "sliding_window must be None or an int >= 1"),
    (dict(softcap=0.0), "softcap must be None or a positive float"),
    (dict(sinks=jnp.zeros((3,), jnp.float32)), "sinks must be float32\\[4\\]"),
    (dict(sinks=jnp.zeros((4,), jnp.int32)), "sinks must be float32\\[4\\]"),
    (dict(return_status=1), "return_status must be a bool"),
    (dict(backend="flash"), "backend must be one of \\('auto', 'xla', 'cudnn', 'trtllm', 'triton', 'fa4'\\)"),
    (dict(backend="flashinfer"), "backend must be one of \\('auto', 'xla', 'cudnn', 'trtllm', 'triton', 'fa4'\\)"),
    (dict(meta=_with(meta0, page_size=4)),
     "meta was built by a PageTable with page_size=4, but the cache has page_size=16"),
    (dict(meta=_with(meta0, num_pages=16)),
     "meta was built by a PageTable with num_pages=16, but the cache has num_pages=8"),
    # numbers a Python float holds but float32 does not, or no float at all
    (dict(scale=1e39), "scale must be a positive finite float"),
    (dict(scale=1e-50), "scale must be a positive finite float"),
    (dict(scale=10 ** 400), "scale must be a positive finite float"),
    (dict(softcap=1e39), "softcap must be None or a positive float"),
    (dict(softcap=10 ** 400), "softcap must be None or a positive float"),
    (dict(sliding_window=2 ** 31), "sliding_window must be None or an int >= 1"),
    (dict(meta=_with(meta0, max_q_len=2 ** 31)), "meta.max_q_len must be None or an int >= 1"),
    (dict(q=jnp.zeros((5, 0, 64), jnp.bfloat16)), "q must be \\[T, Hq, D\\] with T >= 1 \\(and Hq, D >= 1\\)"),
    (dict(meta=_with(meta0, block_tables=jnp.ones((2, 0), jnp.int32))), "meta.block_tables must be \\[B=2, P\\]"),
    (dict(meta=_with(meta0, cu_q_lens=[0, 1, 5])), "meta.cu_q_lens must be an int32 array, got list"),
    (dict(meta=_with(meta0, page_size="16")), "meta.page_size must be None or an int >= 1, got '16'"),
]


@pytest.mark.parametrize("overrides,match", BAD_CALLS, ids=[m for _, m in BAD_CALLS])
def test_bad_arguments_raise_at_trace_time(overrides, match):
    args = dict(q=q0, cache=cache0, meta=meta0)
    kwargs = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)

    def run(q, cache, meta):
        return jaxattn.paged_attention(q, cache, meta, **kwargs)

    with pytest.raises(ValueError, match=match):
        jax.jit(run).lower(args["q"], args["cache"], args["meta"])


def test_shapes_alone_are_for_plan_not_for_the_op():
    """A ShapeDtypeStruct plans a call (``jaxattn.plan``); the op itself needs arrays."""
    spec = jax.ShapeDtypeStruct(q0.shape, q0.dtype)
    jaxattn.plan(meta0, cache0, spec)
    with pytest.raises(ValueError, match="q must be an array, got ShapeDtypeStruct"):
        jaxattn.paged_attention(spec, cache0, meta0)
    with pytest.raises(ValueError, match="sinks must be an array, got ShapeDtypeStruct"):
        jaxattn.paged_attention(q0, cache0, meta0, sinks=jax.ShapeDtypeStruct((4,), jnp.float32))


@pytest.mark.parametrize("name", ["cudnn", "trtllm", "triton"])
def test_unavailable_backend_names_itself_and_the_reason(name):
    reason = backends.unavailable_reason(name)
    if reason is None:
        pytest.skip(f"{name} is available here")
    with pytest.raises(ValueError, match=f"paged_attention: backend '{name}' cannot take this call: "):
        jaxattn.paged_attention(q0, cache0, meta0, backend=name)


def test_page_table_and_cache_of_different_pools_raise():
    """A PageTable of 4-token pages feeding a cache of 16-token pages is caught at trace time (it
    would read the wrong rows of every page)."""
    table = jaxattn.PageTable.create(num_pages=8, max_seqs=2, max_pages_per_seq=4, page_size=4)
    table, ok = table.extend(jnp.asarray([0], jnp.int32), jnp.asarray([3], jnp.int32))
    meta = table.metadata(jnp.asarray([0], jnp.int32), jnp.asarray([3], jnp.int32))
    with pytest.raises(ValueError, match="page_size=4, but the cache has page_size=16"):
        jaxattn.paged_attention(q0[:3], cache0, meta)


def _only(monkeypatch, *available, checks=None):
    """Backends other than ``available`` are switched off for this test; ``checks`` replaces a
    backend's paged_attention check (its other limits stay)."""
    monkeypatch.setattr(backends, "unavailable_reason",
                        lambda name: None if name in available else f"{name} is switched off for this test")
    monkeypatch.setattr(dispatch, "_logged", set())
    for name, check in (checks or {}).items():
        backend = backends.REGISTRY[name]
        support = dataclasses.replace(backend.ops["paged_attention"], check=check)
        monkeypatch.setitem(backends.REGISTRY, name,
                            dataclasses.replace(backend, ops={**backend.ops, "paged_attention": support}))


def _as_if_on_a_gpu(monkeypatch):
    """The fallback logs of a GPU machine: a GPU is visible (backends are faked by each test)."""
    monkeypatch.setattr(dispatch, "gpu_devices", lambda: ["a GPU"])


def test_auto_falls_back_with_one_warning_line(caplog, monkeypatch):
    _as_if_on_a_gpu(monkeypatch)
    _only(monkeypatch, "xla")
    with caplog.at_level(logging.WARNING, logger="jaxattn"):
        for _ in range(3):
            assert attention_module.backend_for(q0, cache0, meta0) == dispatch.Route("xla")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(set(lines)) == 2, lines          # prefill and decode choice, once each
    assert "cudnn skipped (cudnn is switched off for this test)" in lines[0]
    assert "trtllm skipped (trtllm is switched off for this test)" in lines[1]


def test_auto_without_a_gpu_logs_one_info_line(caplog, monkeypatch):
    if HAS_GPU:
        pytest.skip("a GPU is visible")
    monkeypatch.setattr(dispatch, "_logged", set())
    with caplog.at_level(logging.DEBUG, logger="jaxattn"):
        for max_q_len in (None, 1, 4, None):
            assert attention_module.backend_for(q0, cache0, _with(meta0, max_q_len=max_q_len)).main == "xla"
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "jaxattn auto (paged_attention): running the xla backend: no NVIDIA GPU is visible to JAX "
                       "(jax.devices('gpu') is empty)")]


def test_every_op_has_the_reference_backend_and_a_known_ranking():
    """The registry is data: every backend declares ops it runs; xla implements every op and is
    auto's last resort, whatever else ranks a call."""
    for op in backends.OPS:
        assert "xla" in backends.names(op)
    for name, backend in backends.REGISTRY.items():
        assert backend.name == name and set(backend.ops) <= set(backends.OPS) and backend.archs
    call = backends.Call("paged_attention", q0, cache0, meta0, attention_plan.check_attention_args(q0, cache0, meta0))
    assert dispatch.ranking(call) == ["cudnn", "triton", "fa4", "xla"]
    assert dispatch.ranking(dataclasses.replace(call, meta=_with(meta0, max_q_len=1))) == ["trtllm", "triton", "fa4", "xla"]
    assert dispatch.ranking(dataclasses.replace(call, meta=_with(meta0, max_q_len=4))) == [
        "trtllm", "triton", "cudnn", "fa4", "xla"]


def test_a_new_backend_is_one_registry_entry(monkeypatch):
    """A trial backend registered with one entry is chosen by auto by its rank, and an explicit
    backend that cannot take a call names itself and the reason."""
    from jaxattn.backends.base import Backend, Capabilities, OpSupport, constant_rank
    calls = []

    def attention(q, cache, meta, params, sinks):
        calls.append(meta.max_q_len)
        return jnp.zeros_like(q)

    trial = Backend(name="trial", kernel="zeros", archs=("cpu", "gpu"), ops={
        "paged_attention": OpSupport(run=attention, capabilities=Capabilities(dtypes=("bfloat16",), max_q_len=1),
                                     rank=constant_rank(-1))})
    monkeypatch.setitem(backends.REGISTRY, "trial", trial)
    monkeypatch.setattr(dispatch, "_logged", set())
    decode = _with(meta0, cu_q_lens=jnp.asarray([0, 1, 2], jnp.int32), max_q_len=1)
    jaxattn.paged_attention(q0[:2], cache0, decode)
    assert calls == [1]
    with pytest.raises(ValueError, match="backend 'trial' cannot take this call: meta.max_q_len=None is not supported"):
        jaxattn.paged_attention(q0, cache0, meta0, backend="trial")


def test_auto_matches_xla():
    rng = np.random.default_rng()
    q = jnp.asarray(rng.normal(size=q0.shape), jnp.bfloat16)
    cache = KVCache(*(jnp.asarray(rng.normal(size=cache0.k_pages.shape), jnp.bfloat16) for _ in range(2)))
    auto = jaxattn.paged_attention(q, cache, meta0)
    if attention_module.backend_for(q, cache, meta0) == dispatch.Route("xla"):
        np.testing.assert_array_equal(np.asarray(auto, np.float32),
                                      np.asarray(jaxattn.paged_attention(q, cache, meta0, backend="xla"), np.float32))


def test_metadata_is_a_pytree_with_static_hint():
    meta = _with(meta0, max_q_len=4)
    leaves, treedef = jax.tree.flatten(meta)
    assert len(leaves) == 4
    assert jax.tree.unflatten(treedef, leaves).max_q_len == 4
    np.testing.assert_array_equal(meta.q_lens, [1, 4])
    np.testing.assert_array_equal(meta.token_to_seq(7), [0, 1, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(meta.positions(7), [8, 5, 6, 7, 8, 0, 0])


@pytest.mark.parametrize("claimed_decodes", [0, 2, 3, 5])
def test_split_of_a_mixed_batch_matches_a_single_call(monkeypatch, claimed_decodes):
    """The auto split (decodes to one backend, the rest to another), run with xla on both sides,
    equals one xla call; a wrong num_decodes from the caller cannot break it."""
    rng = np.random.default_rng()
    problem = make_problem(rng, q_lens=[1, 1, 1, 6, 1, 9], kv_lens=[40, 3, 77, 20, 5, 30], num_q_heads=4,
                           num_kv_heads=2, head_dim=64, page_size=16, max_q_len=9)
    meta = _with(problem.meta, num_decodes=jnp.asarray(claimed_decodes, jnp.int32))
    monkeypatch.setattr(dispatch, "route", lambda *a, **k: dispatch.Route("xla", "xla"))
    out = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, sliding_window=25))(problem.q, problem.cache, meta)
    assert rel_error(out, reference(problem, sliding_window=25)) < 1e-5


def _decode_only(call):
    return None if call.meta.max_q_len == 1 else "decode only"


def test_auto_plans_a_split_when_decode_and_prefill_backends_differ(monkeypatch):
    _only(monkeypatch, "xla", "trtllm", checks={"trtllm": _decode_only})
    mixed = attention_module.backend_for(q0, cache0, meta0)
    assert mixed == dispatch.Route("xla", "trtllm") and str(mixed) == "trtllm (decodes) + xla (the rest)"
    # A speculative-decode step goes whole to a backend that also runs decodes.
    assert attention_module.backend_for(q0, cache0, _with(meta0, max_q_len=4)) == dispatch.Route("xla")
    assert attention_module.backend_for(q0[:2], cache0, _with(meta0, max_q_len=1)) == dispatch.Route("trtllm")


def test_auto_sends_speculative_decode_steps_to_trtllm_whole(monkeypatch, caplog):
    """2 <= max_q_len <= 16: one trtllm call when it takes the step; otherwise the prefill plan,
    with the reason logged. Longer steps never ask trtllm for the whole batch."""
    _as_if_on_a_gpu(monkeypatch)
    asked = []

    def check(call):
        asked.append(call.meta.max_q_len)
        return None

    _only(monkeypatch, "xla", "trtllm", checks={"trtllm": check})
    for max_q_len in (2, 4, 16):
        plan = attention_module.backend_for(q0, cache0, _with(meta0, max_q_len=max_q_len))
        assert plan == dispatch.Route("trtllm")
    asked.clear()
    plan = attention_module.backend_for(q0, cache0, _with(meta0, max_q_len=17))
    assert plan == dispatch.Route("xla", "trtllm")
    assert asked == [1], "a step longer than speculative decode only sends its decodes to trtllm"
    with caplog.at_level(logging.WARNING, logger="jaxattn"):
        plan = attention_module.backend_for(q0, cache0, _with(meta0, max_q_len=4), softcap=30.0)
    assert plan == dispatch.Route("xla")
    assert any("trtllm skipped (softcap not supported" in r.getMessage() for r in caplog.records)


def test_auto_sends_long_drafts_to_triton_first(monkeypatch):
    """Above one XQA tile (max_q_len * group > 32 rows) triton goes before trtllm."""
    _only(monkeypatch, "xla", "trtllm", "triton")
    q = jnp.zeros((5, 8, 64), jnp.bfloat16)                          # group 4
    plan = lambda max_q_len: attention_module.backend_for(q, cache0, _with(meta0, max_q_len=max_q_len))  # noqa: E731
    assert plan(8) == dispatch.Route("trtllm")                # 32 rows
    assert plan(9) == dispatch.Route("triton") == plan(16)


def test_numpy_scalars_are_accepted_as_static_options():
    out = jaxattn.paged_attention(q0, cache0, meta0, scale=np.float32(0.2), sliding_window=np.int64(4),
                                  softcap=np.float64(30.0), backend="xla")
    assert out.shape == q0.shape


@pytest.mark.gpu
@pytest.mark.parametrize("max_q_len", [4, 16])
def test_gpu_auto_speculative_decode_steps(max_q_len):
    """A draft-verification step (up to max_q_len tokens per sequence, one sequence padding)
    through ``auto`` is one call of one backend, the one ``dispatch`` chooses (the measured table's
    for its bucket, where this GPU has one), and gives the xla backend's rows."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    q_lens = [max_q_len, 1, 3, 0, max_q_len, 2]
    problem = make_problem(rng, q_lens=q_lens, kv_lens=[700, 90, 3, 0, 2500, 4], num_q_heads=32, num_kv_heads=8,
                           head_dim=128, page_size=64, dtype=jnp.bfloat16, pad_seqs=0, pad_tokens=0,
                           max_q_len=max_q_len)
    for name in ("trtllm", "triton"):
        if backends.unavailable_reason(name) is not None:
            pytest.skip(backends.unavailable_reason(name))
    plan = attention_module.backend_for(problem.q, problem.cache, problem.meta)
    params = attention_plan.check_attention_args(problem.q, problem.cache, problem.meta)
    call = Call("paged_attention", problem.q, problem.cache, problem.meta, params)
    assert plan == dispatch.Route(dispatch.choose(call, "auto"))
    run = jax.jit(jaxattn.paged_attention, static_argnames="backend")
    out = run(problem.q, problem.cache, problem.meta)
    ref = run(problem.q, problem.cache, problem.meta, backend="xla")
    assert rel_error(out, ref) < 1e-2, f"seed {seed}"


def test_a_split_plan_gives_the_rows_of_one_backend():
    """A plan with the leading decodes on a second backend: the rows of one backend over the whole
    batch, to float32 rounding (decodes, a chunked prefill, a contract-breaking decode and padding
    tokens, whose rows stay zero)."""
    problem = make_problem(np.random.default_rng(11), q_lens=[1, 1, 1, 30, 7], kv_lens=[40, 9, 70, 50, 7],
                           num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=16, dtype=jnp.float32,
                           pad_seqs=2, pad_tokens=4)
    meta = dataclasses.replace(problem.meta, kv_lens=problem.meta.kv_lens.at[1].set(10_000))
    params = attention_plan.check_attention_args(problem.q, problem.cache, meta)
    run = functools.partial(_run_route, q=problem.q, cache=problem.cache, meta=meta, params=params)
    whole, split = run(dispatch.Route("xla")), run(dispatch.Route("xla", "xla"))
    np.testing.assert_allclose(np.asarray(split), np.asarray(whole), rtol=1e-4, atol=1e-5)
    assert not np.asarray(split[1]).any() and not np.asarray(split[-4:]).any()
    assert not np.asarray(whole[1]).any(), "the contract-breaking decode's row is not zero"


def _run_route(route, q, cache, meta, params):
    """paged_attention's kernels on ``route``'s backends (a plan made for it)."""
    plan = attention_plan.build(Call("paged_attention", q, cache, meta, params), "auto", route=route)
    return attention_module.run(q, cache, plan, None)


@pytest.mark.gpu
@pytest.mark.parametrize("decode, main", [("trtllm", "cudnn"), ("triton", "cudnn"), ("trtllm", "fa4"),
                                          ("triton", "fa4"), ("fa4", "triton"), ("trtllm", "triton")])
def test_gpu_split_plans_match_float64(decode, main):
    """A mixed batch through a split plan on the GPU backends (decodes, a chunked prefill, a
    contract-breaking decode, padding tokens) compiles and gives the float64 reference's rows."""
    for name in (decode, main):
        if backends.unavailable_reason(name) is not None:
            pytest.skip(backends.unavailable_reason(name))
    seed = int(np.random.SeedSequence().entropy % 2**32)
    problem = make_problem(np.random.default_rng(seed), q_lens=[1, 1, 1, 300, 77], kv_lens=[700, 90, 3, 1200, 77],
                           num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64, dtype=jnp.bfloat16)
    meta = dataclasses.replace(problem.meta, kv_lens=problem.meta.kv_lens.at[1].set(10_000))
    params = attention_plan.check_attention_args(problem.q, problem.cache, meta)

    run = jax.jit(lambda q, cache, meta: _run_route(dispatch.Route(main, decode), q, cache, meta, params))
    out = run(problem.q, problem.cache, meta)
    ref = reference(problem)
    ref[1] = 0.0                                                     # the contract-breaking decode
    assert rel_error(out, ref) < 2e-2, f"seed {seed}"
    assert not np.asarray(out[1].astype(jnp.float32)).any() and not np.asarray(out[-3:].astype(jnp.float32)).any()


# ------------------------------------------------- every backend on random configurations

def check_random_case(case: RandomCase, name: str) -> str | None:
    """Runs ``case`` on backend ``name`` (jitted, with its status) and checks it against float64:
    relative error within tolerance, padding and broken rows exactly zero, ``valid`` False only for
    the broken sequence. Returns why the backend does not take the call (nothing run), else None."""
    p = case.problem
    try:
        plan = attention_module.backend_for(p.q, p.cache, p.meta, backend=name, sinks=case.sinks, **case.options)
    except ValueError as err:
        return str(err)
    tolerance = RANDOM_TOLERANCE[p.q.dtype.name]
    if p.cache.is_fp8 and "trtllm" in (plan.main, plan.decode):
        tolerance = XQA_FP8_TOLERANCE
    run = jax.jit(lambda q, c, m, s: jaxattn.paged_attention(q, c, m, sinks=s, backend=name, return_status=True,
                                                             **case.options))
    out, valid = run(p.q, p.cache, p.meta, case.sinks)
    case.check(out, valid, tolerance, f"{name} ({plan})")
    return None


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_reference_backend_on_random_configurations(seed):
    """The harness of the GPU test below, on the reference backend (CPU)."""
    assert check_random_case(random_case(seed), "xla") is None


@pytest.mark.gpu
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_gpu_backends_on_random_configurations(seed):
    """Every GPU backend that runs here and takes the call, and auto, on one random configuration
    (decode, speculative, prefill, chunked or mixed; HND/NHD; window/softcap/sinks; pages 16-64;
    FP8 pages; a contract-breaking sequence) against float64."""
    case = random_case(seed)
    ran = [name for name in ("auto",) + tuple(n for n in backends.names("paged_attention") if n != "xla")
           if check_random_case(case, name) is None]
    assert len(ran) > 1, f"only {ran} took {case}"
