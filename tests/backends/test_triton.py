"""The triton backend against the float64 reference and the xla backend.

Without a GPU the kernels run under Triton's interpreter (same launch plans, small tiles), so CI
checks their numerics; GPU tests cover realistic shapes, every feature, and CUDA-graph capture.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import attention_plan, backends
from jaxattn.backends import xla
from jaxattn.backends.base import AttentionParams, Call
from tests.conftest import HAS_GPU
from tests.paged_inputs import (RANDOM_SEEDS, RANDOM_TOLERANCE, TOLERANCE, make_problem, random_case, reference,
                                rel_error)
from tests.xla_dump import run_with_dump, thunk_sequences, top_level_thunks

pytest.importorskip("triton", reason="the triton backend's tests need the triton package")
from jaxattn.backends import triton as tb  # noqa: E402

BF16, FP8 = jnp.bfloat16, jnp.float8_e4m3fn


def _params(head_dim, *, causal=True, sliding_window=None, softcap=None, sinks=None, scale=None):
    return AttentionParams(scale=scale or 1 / np.sqrt(head_dim), causal=causal, sliding_window=sliding_window,
                           softcap=softcap, has_sinks=sinks is not None)


def _run(problem, *, launch="split", decode=None, prefill=None, sinks=None, **kw):
    params = _params(problem.q.shape[2], sinks=sinks, **kw)
    fn = jax.jit(lambda q, c, m, s: tb.attention(q, c, m, params, s, launch=launch, decode=decode, prefill=prefill))
    return fn(problem.q, problem.cache, problem.meta, sinks)


def _check(problem, out, *, sinks=None, tol=None, **kw):
    ref = reference(problem, sinks=sinks, **kw)
    tol = tol or TOLERANCE[jnp.dtype(problem.q.dtype)]
    err = rel_error(out, ref)
    assert err < tol, err
    params = _params(problem.q.shape[2], sinks=sinks, **kw)
    ours = np.asarray(jnp.asarray(out, jnp.float32))
    theirs = np.asarray(xla.attention(problem.q, problem.cache, problem.meta, params, sinks).astype(jnp.float32))
    assert rel_error(ours, theirs) < 2 * tol
    # Padding tokens and empty sequences are exact zeros.
    n = sum(problem.q_lens)
    assert not ours[n:].any()


# --- kernel numerics (interpreter on CPU, the GPU kernels on a GPU) ------------------------------

MIXED = dict(q_lens=[1, 1, 1, 5, 3, 1], kv_lens=[7, 40, 0, 37, 3, 20])       # 3 decodes, then the rest
SPEC = dict(q_lens=[1, 1, 3, 2, 4], kv_lens=[9, 30, 24, 33, 4])              # multi-token decodes


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_configurations(seed):
    """``paged_inputs.random_case`` (decode, speculative, prefill, chunked, mixed; both layouts,
    pages 16-64, window/softcap/sinks, FP8 pages, a contract-breaking sequence) through the
    kernels on sanitized metadata, as paged_attention runs them, against float64."""
    case = random_case(seed)
    p = case.problem
    params = _params(p.q.shape[2], sinks=case.sinks, **case.options)
    reason = backends.takes("triton", Call("paged_attention", p.q, p.cache, p.meta, params))
    if reason is not None:
        pytest.skip(reason)
    meta, valid = attention_plan.sanitize(p.q.shape[0], p.cache, p.meta)
    out = jax.jit(lambda q, c, m, s: tb.attention(q, c, m, params, s))(p.q, p.cache, meta, case.sinks)
    case.check(out, valid, RANDOM_TOLERANCE[p.q.dtype.name], "triton")


@pytest.mark.parametrize("launch", tb.LAUNCHES)
@pytest.mark.parametrize("shape", [MIXED, SPEC, dict(q_lens=[1, 1, 1, 1], kv_lens=[5, 1, 0, 47], max_q_len=1)],
                         ids=["mixed", "spec_decode", "decode_only"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_batches_and_layouts(launch, shape, layout):
    problem = make_problem(np.random.default_rng(0), num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8,
                           layout=layout, **shape)
    _check(problem, _run(problem, launch=launch))


@pytest.mark.parametrize("launch", tb.LAUNCHES)
@pytest.mark.parametrize("shape", [MIXED, dict(q_lens=[1, 1, 1, 1], kv_lens=[5, 1, 0, 47], max_q_len=1)],
                         ids=["mixed", "decode_only"])
def test_fp8_scales_are_checked_in_the_kernels(launch, shape):
    """FP8 pages whose scales are not positive and finite (pages holding NaN, as a write with such
    a scale leaves them): every row is an exact zero, with sinks too; good scales still attend
    (the op adds no select after these kernels: ``checks_fp8_scales``)."""
    problem = make_problem(np.random.default_rng(3), num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8,
                           kv_dtype=FP8, **shape)
    nan_pages = jnp.full(problem.cache.k_pages.shape, jnp.nan, jnp.float32).astype(FP8)
    sinks = jnp.ones((4,), jnp.float32)
    for bad in (jnp.nan, 0.0, -2.0, jnp.inf):
        cache = dataclasses.replace(problem.cache, v_pages=nan_pages, v_scale=jnp.asarray(bad, jnp.float32))
        for k_scale in (problem.cache.k_scale, jnp.asarray(bad, jnp.float32)):
            bad_problem = dataclasses.replace(problem, cache=dataclasses.replace(cache, k_scale=k_scale))
            out = np.asarray(_run(bad_problem, launch=launch, sinks=sinks), np.float32)
            assert not out.any() and not np.isnan(out).any(), (bad, launch)
    assert np.asarray(_run(problem, launch=launch), np.float32)[:sum(problem.q_lens)].any()


@pytest.mark.parametrize("feature", [
    dict(sliding_window=5), dict(softcap=2.0), dict(sinks=True), dict(causal=False),
    dict(sliding_window=9, softcap=3.0, sinks=True), dict(scale=0.3)], ids=str)
def test_features(feature):
    feature = dict(feature)
    problem = make_problem(np.random.default_rng(1), num_q_heads=6, num_kv_heads=2, head_dim=24, page_size=4,
                           **MIXED)
    if feature.pop("sinks", False):
        feature["sinks"] = jnp.asarray(np.random.default_rng(2).normal(size=6), jnp.float32)
    _check(problem, _run(problem, **feature), **feature)


@pytest.mark.parametrize("launch", tb.LAUNCHES)
@pytest.mark.parametrize("dtype, kv_dtype", [(BF16, BF16), (jnp.float16, jnp.float16), (BF16, FP8),
                                             (jnp.float32, FP8)], ids=str)
def test_dtypes_and_fp8(launch, dtype, kv_dtype):
    problem = make_problem(np.random.default_rng(3), num_q_heads=4, num_kv_heads=4, head_dim=32, page_size=16,
                           dtype=dtype, kv_dtype=kv_dtype, **SPEC)
    tol = 2e-2 if dtype != jnp.float32 else 1e-5
    _check(problem, _run(problem, launch=launch, sinks=None), tol=tol)


def test_tokens_before_first_offset_and_bad_counts():
    """cu_q_lens[0] > 0 leaves leading tokens to padding; a num_decodes larger than the leading
    run of one-token sequences is capped; bad page ids read the null page."""
    problem = make_problem(np.random.default_rng(4), q_lens=[1, 2, 1], kv_lens=[6, 11, 3], num_q_heads=2,
                           num_kv_heads=1, head_dim=16, page_size=4, pad_tokens=2)
    meta = problem.meta
    shifted = dataclasses.replace(meta, cu_q_lens=meta.cu_q_lens + 2, num_decodes=jnp.int32(3))
    q = jnp.roll(problem.q, 2, axis=0)
    params = _params(16)
    for launch in tb.LAUNCHES:
        out = jax.jit(lambda q, c, m: tb.attention(q, c, m, params, None, launch=launch))(q, problem.cache, shifted)
        ref = np.roll(reference(problem), 2, axis=0)
        assert rel_error(out, ref) < 1e-5
        assert not np.asarray(out[:2]).any()


@pytest.mark.parametrize("launch", tb.LAUNCHES)
def test_many_q_blocks_per_sequence(launch):
    """Sequences of several q-blocks at unaligned offsets (the 2D kernel runs them last first)."""
    problem = make_problem(np.random.default_rng(8), q_lens=[1, 1, 20, 37, 5], kv_lens=[5, 9, 30, 40, 5],
                           num_q_heads=2, num_kv_heads=2, head_dim=16, page_size=8)
    _check(problem, _run(problem, launch=launch))


def test_explicit_configs():
    problem = make_problem(np.random.default_rng(5), num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=8,
                           **MIXED)
    out = _run(problem, decode=tb.DecodeConfig(block_n=32, num_segments=1, num_warps=4, num_stages=1),
               prefill=tb.PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1))
    _check(problem, out)


def test_short_query_tiles(monkeypatch):
    """Steps whose queries all fit one tile of <= 64 rows get the short-query tiles; others and
    steps without a static bound keep the prefill tiles."""
    monkeypatch.setattr(tb, "_interpreting", lambda: False)
    short = lambda max_q_len, group=4, batch=64, dtype=BF16, head_dim=128: tb.short_query_config(  # noqa: E731
        head_dim, dtype, max_q_len, group, batch, 8)
    assert short(4) == tb.PrefillConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
    assert short(16) == tb.PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    assert short(4, batch=8).block_n == 128                      # few (sequence, KV head) pairs
    assert short(4, batch=8, dtype=jnp.float32, head_dim=256).block_n == 32
    assert short(1, group=16).block_m == 16
    assert short(None) is None and short(17) is None and short(8, group=16) is None


def test_decode_tiles_for_few_pairs(monkeypatch):
    """Up to 32 (sequence, KV head) pairs at D 65..128: up to 32 KV segments of at least 16 keys,
    tiles as long as a segment's share; larger batches and other head dims keep the earlier rule."""
    monkeypatch.setattr(tb, "_interpreting", lambda: False)
    config = lambda batch, kv, head_dim=128: tb.decode_config(head_dim, batch, 8, kv)  # noqa: E731
    assert config(1, 512) == tb.DecodeConfig(block_n=16, num_segments=32, num_warps=4, num_stages=2)
    assert config(1, 4096) == tb.DecodeConfig(block_n=32, num_segments=32, num_warps=4, num_stages=3)
    assert config(4, 4096) == tb.DecodeConfig(block_n=32, num_segments=32, num_warps=4, num_stages=3)
    assert config(1, 16384) == tb.DecodeConfig(block_n=64, num_segments=32, num_warps=4, num_stages=3)
    assert config(2, 16384) == tb.DecodeConfig(block_n=64, num_segments=32, num_warps=4, num_stages=2)
    assert config(1, 64).num_segments == 4 and config(1, 8).num_segments == 1
    assert config(8, 4096) == tb.DecodeConfig(block_n=64, num_segments=8, num_warps=4, num_stages=3)
    assert config(64, 4096).num_segments == 2 and config(1, 4096, head_dim=64).block_n == 64


# --- errors and availability --------------------------------------------------------------------

@pytest.mark.parametrize("launch, q_lens", [("split", [1, 1, 1]), ("single", [1, 3, 2])])
def test_calls_trace_to_the_kernels_alone(launch, q_lens):
    """A decode-only call (split launch) and a single launch add no XLA work: the jaxpr holds only
    the kernels, and the operands they do not read are one-element constants, which XLA keeps as
    literals (a splat of two or more elements would become a broadcast kernel on every call)."""
    problem = make_problem(np.random.default_rng(0), q_lens=q_lens, kv_lens=[7, 40, 3], num_q_heads=4,
                           num_kv_heads=2, head_dim=16, page_size=8, dtype=BF16,
                           max_q_len=1 if launch == "split" else None)
    params = _params(16)
    jaxpr = jax.make_jaxpr(lambda q, c, m: tb.attention(q, c, m, params, None, launch=launch))(
        problem.q, problem.cache, problem.meta)
    assert {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns} == {"jaxattn_triton_call"}
    assert jaxpr.consts and all(np.size(const) == 1 for const in jaxpr.consts)


@pytest.mark.parametrize("options", [{}, dict(sliding_window=5), dict(softcap=4.0), dict(causal=False),
                                     dict(sinks=True)], ids=str)
def test_short_query_steps_run_whole_in_the_split_kernels(options):
    """A speculative step (every q_len <= max_q_len, its tokens x the group's heads one M tile):
    the split-KV kernel and its reduction alone, each query token masked at its own position;
    padding tokens and the empty sequence exact zeros."""
    rng = np.random.default_rng(11)
    problem = make_problem(rng, q_lens=[3, 1, 4, 0, 2], kv_lens=[30, 9, 17, 0, 2], num_q_heads=8, num_kv_heads=2,
                           head_dim=32, page_size=8, dtype=BF16, max_q_len=4)
    assert tb.split_query_tokens(4, group=4) == 4 and tb.split_query_tokens(16, group=8) is None
    options = dict(options)
    jaxpr = jax.make_jaxpr(lambda q, c, m: tb.attention(q, c, m, _params(32), None))(
        problem.q, problem.cache, problem.meta)
    assert [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns] == ["jaxattn_triton_call"] * 2
    if options.pop("sinks", False):
        options["sinks"] = jnp.asarray(rng.normal(size=8), jnp.float32)
    _check(problem, _run(problem, **options), **options)


def test_unsupported_configurations_raise():
    problem = make_problem(np.random.default_rng(6), q_lens=[2], kv_lens=[4], num_q_heads=2, num_kv_heads=2,
                           head_dim=8, page_size=4)
    call = Call("paged_attention", problem.q, problem.cache, problem.meta, _params(8))
    assert backends.takes("triton", call) == "head_dim must be in 16..256, got 8"
    problem = make_problem(np.random.default_rng(6), q_lens=[2], kv_lens=[4], num_q_heads=2, num_kv_heads=2,
                           head_dim=16, page_size=4, dtype=BF16)
    assert backends.takes("triton", Call("paged_attention", problem.q, problem.cache, problem.meta, _params(16))) is None
    with pytest.raises(ValueError, match="launch must be one of"):
        tb.attention(problem.q, problem.cache, problem.meta, _params(16), None, launch="both")


@pytest.mark.skipif(HAS_GPU, reason="checks the reason given on a machine without a GPU")
def test_unavailable_without_gpu():
    reason = backends.unavailable_reason("triton")
    assert reason is not None and "GPU" in reason
    with pytest.raises(ValueError, match="backend 'triton' cannot take this call: no NVIDIA GPU"):
        problem = make_problem(np.random.default_rng(7), q_lens=[1], kv_lens=[3], num_q_heads=2, num_kv_heads=2,
                               head_dim=16, page_size=4)
        jaxattn.paged_attention(problem.q, problem.cache, problem.meta, backend="triton")


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("launch", tb.LAUNCHES)
@pytest.mark.parametrize("layout, page_size", [("HND", 64), ("NHD", 16)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_mixed_batches(launch, layout, page_size, head_dim):
    rng = np.random.default_rng(head_dim + page_size)
    decodes = [1] * 12
    problem = make_problem(rng, q_lens=decodes + [2, 3, 300, 1, 77], num_q_heads=32, num_kv_heads=8,
                           kv_lens=list(rng.integers(1, 900, 12)) + [40, 3, 700, 1, 77], head_dim=head_dim,
                           page_size=page_size, layout=layout, dtype=BF16, pad_tokens=5)
    _check(problem, _run(problem, launch=launch))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2, 4])
@pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=str)
def test_gpu_small_decode_batches(batch, kv_dtype):
    """The few-pairs decode tiles (16-key tiles at B=1, 32-key tiles in tables 5120 keys wide
    otherwise; 32 segments) on ragged lengths, from one key to most of the table."""
    rng = np.random.default_rng(batch)
    kv_lens = [1, 17, 4096, 700][:batch] if batch > 1 else [int(rng.integers(300, 500))]
    problem = make_problem(rng, q_lens=[1] * batch, kv_lens=kv_lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                           page_size=64, dtype=BF16, kv_dtype=kv_dtype, pad_seqs=0,
                           pages_per_seq=None if batch == 1 else 80)
    _check(problem, _run(problem))


@pytest.mark.gpu
@pytest.mark.parametrize("launch", tb.LAUNCHES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_other_dtypes(launch, dtype, head_dim):
    """float32 (its own, smaller prefill tiles) and float16 through both launch plans."""
    rng = np.random.default_rng(head_dim)
    problem = make_problem(rng, q_lens=[1] * 5 + [3, 260], kv_lens=list(rng.integers(1, 700, 5)) + [9, 500],
                           num_q_heads=16, num_kv_heads=4, head_dim=head_dim, page_size=32, dtype=dtype)
    # float32: the xla backend's GPU dots may use TF32.
    _check(problem, _run(problem, launch=launch), tol=5e-4 if dtype == jnp.float32 else None)


@pytest.mark.gpu
@pytest.mark.parametrize("feature", [
    dict(sliding_window=100), dict(softcap=30.0), dict(sinks=True), dict(causal=False),
    dict(sliding_window=64, softcap=20.0, sinks=True)], ids=str)
@pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=str)
def test_gpu_features(feature, kv_dtype):
    feature = dict(feature)
    rng = np.random.default_rng(11)
    problem = make_problem(rng, q_lens=[1] * 9 + [4, 130], kv_lens=list(rng.integers(0, 600, 9)) + [300, 400],
                           num_q_heads=16, num_kv_heads=2, head_dim=128, page_size=32, dtype=BF16, kv_dtype=kv_dtype)
    if feature.pop("sinks", False):
        feature["sinks"] = jnp.asarray(rng.normal(size=16), jnp.float32)
    _check(problem, _run(problem, **feature), **feature)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", tb.LAUNCHES)
@pytest.mark.parametrize("max_q_len, head_dim, dtype, kv_dtype", [
    (4, 128, BF16, BF16), (16, 64, BF16, BF16), (8, 256, BF16, FP8), (3, 128, jnp.float32, jnp.float32),
    (2, 256, jnp.float32, jnp.float32)], ids=str)
def test_gpu_short_query_steps(launch, max_q_len, head_dim, dtype, kv_dtype):
    """Speculative-decode-like steps (every q_len <= max_q_len, the short-query tiles), with
    decodes first, a padding sequence in the middle, sinks and a sliding window; B=8 and B=64
    (the two key-tile widths)."""
    for batch in (8, 64):
        rng = np.random.default_rng(max_q_len * batch + head_dim)
        q_lens = [1, 1] + [int(n) for n in rng.integers(1, max_q_len + 1, batch - 2)]
        q_lens[4] = 0
        kv_lens = [int(k) + q for k, q in zip(rng.integers(0, 900, batch), q_lens)]
        kv_lens[4] = 0
        problem = make_problem(rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=16, num_kv_heads=4,
                               head_dim=head_dim, page_size=32, dtype=dtype, kv_dtype=kv_dtype, max_q_len=max_q_len)
        sinks = jnp.asarray(rng.normal(size=16), jnp.float32)
        _check(problem, _run(problem, launch=launch, sinks=sinks, sliding_window=200), sinks=sinks,
               sliding_window=200, tol=5e-4 if dtype == jnp.float32 else None)


@pytest.mark.gpu
def test_gpu_decode_only_through_paged_attention():
    rng = np.random.default_rng(12)
    problem = make_problem(rng, q_lens=[1] * 40, kv_lens=list(rng.integers(0, 3000, 40)), num_q_heads=32,
                           num_kv_heads=8, head_dim=128, page_size=64, dtype=BF16, max_q_len=1, pad_tokens=8)
    out = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="triton"))(
        problem.q, problem.cache, problem.meta)
    _check(problem, out)


_CAPTURE_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    import jaxattn
    from tests.paged_inputs import make_problem, reference, rel_error

    problem = make_problem(np.random.default_rng(0), q_lens=[1] * 6 + [3, 50], kv_lens=[40] * 6 + [90, 60],
                           num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=64, dtype=jnp.bfloat16)
    step = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="triton") * 2)
    outs = [step(problem.q, problem.cache, problem.meta).block_until_ready() for _ in range(3)]
    errors = [rel_error(o, reference(problem) * 2) for o in outs]
    print(json.dumps(dict(errors=errors)))
""")


@pytest.mark.gpu
def test_gpu_launches_captured_in_command_buffer(tmp_path):
    """The split step's three Triton launches (decode, reduce, 2D) run inside one kCommandBuffer."""
    run = run_with_dump(_CAPTURE_SCRIPT, tmp_path, timeout=300)
    errors = json.loads(run.stdout.strip().splitlines()[-1])["errors"]
    assert max(errors) < TOLERANCE[jnp.dtype(BF16)], errors
    for name, thunks in thunk_sequences(tmp_path, "jit__lambda").items():
        top = top_level_thunks(thunks)
        assert "kCommandBuffer" in top and "kCustomCall" not in top, (name, thunks[-3000:])
        # The command buffer's commands are listed, indented, under it in the first block.
        assert thunks.split("\n\n")[0].count(": kCustomCall") >= 3, (name, thunks[-3000:])
