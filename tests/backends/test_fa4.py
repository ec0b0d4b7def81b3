"""backend="fa4": FlashAttention-4's SM90 kernel via cutlass_call against float64 and the xla backend.

CPU tests check the registry's judgement (capabilities, limits, why it is unavailable); GPU tests
(``-m gpu``, compute capability 9.x with ``jaxattn[fa4]`` installed, else skipped) check numerics
over decode, speculative-decode, prefill, chunked and mixed batches, both layouts, page sizes
16-128 (cp.async gather and TMA), GQA, window, softcap and sinks, padding and contract-breaking
sequences (zero rows), that one compiled step serves other lengths and tables, and
``mla_prefill`` at DeepSeek dims (keys 192 wide, values 128) over bf16 and FP8 latents.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import backends
from jaxattn.backends import fa4
from jaxattn.backends.base import AttentionParams, Call
from tests.mla_inputs import check_deepseek_prefill, check_deepseek_prefill_broken_sequences
from tests.paged_inputs import TOLERANCE, make_problem, reference, rel_error, same_shape_problems

BF16, F16 = jnp.bfloat16, jnp.float16
# GPU tests need the [fa4] extra; without it they are skipped with the reason.
needs_fa4 = pytest.mark.skipif(fa4.requirements() is not None, reason=str(fa4.requirements()))


def _params(**kw) -> AttentionParams:
    return AttentionParams(**{"scale": 0.125, "causal": True, "sliding_window": None, "softcap": None,
                              "has_sinks": False, **kw})


def _abstract_call(dtype=BF16, kv_dtype=None, head_dim=128, layout="HND", **params) -> Call:
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    shape = (9, 2, 64, head_dim) if layout == "HND" else (9, 64, 2, head_dim)
    pages = jax.ShapeDtypeStruct(shape, kv_dtype)
    scale = jnp.float32(1.0) if jnp.dtype(kv_dtype) == jnp.float8_e4m3fn else None
    cache = jaxattn.KVCache(pages, pages, scale, scale, layout)
    meta = jaxattn.AttentionMetadata(cu_q_lens=jnp.zeros(3, jnp.int32), kv_lens=jnp.zeros(2, jnp.int32),
                                     block_tables=jnp.zeros((2, 4), jnp.int32), num_decodes=jnp.zeros((), jnp.int32))
    return Call("paged_attention", jax.ShapeDtypeStruct((32, 8, head_dim), dtype), cache, meta, _params(**params))


# ----------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("case, message", [
    (dict(dtype=jnp.float32), "float32 queries are not supported; supported: .*bfloat16"),
    (dict(kv_dtype=jnp.float8_e4m3fn), "float8_e4m3fn pages are not supported"),
    (dict(head_dim=72), "head_dim=72 is not supported; supported: multiples of 16 up to 256"),
    (dict(head_dim=320), "head_dim=320 is not supported"),
])
def test_unsupported_configurations_are_refused(case, message):
    assert re.search(message, backends.takes("fa4", _abstract_call(**case)))


@pytest.mark.parametrize("case", [dict(), dict(layout="NHD", dtype=F16, head_dim=64),
                                  dict(sliding_window=8, softcap=30.0, has_sinks=True, causal=False)], ids=str)
def test_supported_configurations_pass_checks(case):
    assert backends.takes("fa4", _abstract_call(**case)) is None


def _abstract_mla_call(dtype=BF16, kv_dtype=BF16, nope_dim=128, v_dim=128) -> Call:
    pages = jax.ShapeDtypeStruct((9, 64, 512 + 64), kv_dtype)
    cache = jaxattn.MLACache(pages, jnp.float32(1.0) if kv_dtype == jnp.float8_e4m3fn else None)
    meta = _abstract_call().meta
    return Call("mla_prefill", jax.ShapeDtypeStruct((32, 16, nope_dim + 64), dtype), cache, meta, _params(),
                w_uv=jax.ShapeDtypeStruct((512, 16, v_dim), dtype))


@pytest.mark.parametrize("case, message", [
    (dict(dtype=jnp.float32, kv_dtype=jnp.float32), "float32 queries are not supported"),
    (dict(nope_dim=100), r"Dn \+ Dr=164 is not supported; supported: multiples of 16 up to 256"),
    (dict(v_dim=72), "Dv=72 is not supported"),
    (dict(v_dim=512), "Dv=512 is not supported"),
])
def test_unsupported_mla_prefill_configurations_are_refused(case, message):
    assert re.search(message, backends.takes("fa4", _abstract_mla_call(**case)))


@pytest.mark.parametrize("kv_dtype", [BF16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_mla_prefill_takes_deepseek_dims(kv_dtype):
    assert backends.takes("fa4", _abstract_mla_call(kv_dtype=kv_dtype)) is None


@pytest.mark.skipif(bool(jax.devices()[0].platform == "gpu"), reason="checks the CPU-only message")
def test_unavailable_without_gpu_says_why():
    assert "GPU" in backends.unavailable_reason("fa4")
    q, cache = jnp.zeros((4, 2, 64), BF16), jaxattn.KVCache.create(3, 16, 2, 64, BF16)
    meta = jaxattn.AttentionMetadata(jnp.array([0, 4], jnp.int32), jnp.array([4], jnp.int32),
                                     jnp.array([[1]], jnp.int32), jnp.zeros((), jnp.int32))
    with pytest.raises(ValueError, match="backend 'fa4' cannot take this call: no NVIDIA GPU"):
        jaxattn.paged_attention(q, cache, meta, backend="fa4")


# ----------------------------------------------------------------------------------------- GPU

def _run(problem, sinks=None, **kw):
    return jax.jit(lambda q, c, m, s: jaxattn.paged_attention(q, c, m, sinks=s, backend="fa4", **kw))(
        problem.q, problem.cache, problem.meta, sinks)


def _check(problem, out, **kw):
    """Against float64; rows of padding tokens must be exactly zero."""
    ref = reference(problem, **kw)
    n = sum(problem.q_lens)
    assert rel_error(out[:n], ref[:n]) < TOLERANCE[jnp.dtype(problem.q.dtype)]
    assert not np.asarray(out[n:].astype(jnp.float32)).any(), "padding rows are not zero"


CASES = {
    # name: (q_lens, kv_lens, Hq, Hkv, D, page, layout, dtype, max_q_len)
    "decode_gqa4_p64_hnd": ([1] * 9, [37, 300, 5, 1, 64, 65, 900, 128, 2], 32, 8, 128, 64, "HND", BF16, 1),
    "spec_decode_gqa8_p16_nhd": ([4, 4, 3, 4], [40, 4, 300, 129], 32, 4, 128, 16, "NHD", BF16, 4),
    "prefill_mha_p128_nhd_tma": ([37, 300, 5], [37, 300, 5], 8, 8, 128, 128, "NHD", BF16, None),
    "chunked_gqa4_d64_p32_hnd": ([64, 33, 96], [500, 33, 1100], 16, 4, 64, 32, "HND", BF16, None),
    "mixed_gqa4_p64_hnd": ([1, 1, 1, 250, 17], [700, 3, 64, 250, 400], 32, 8, 128, 64, "HND", BF16, None),
    "prefill_fp16_p16_nhd_d256": ([120, 9, 60], [300, 9, 61], 8, 2, 256, 16, "NHD", F16, None),
}


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_and_xla_backend(name):
    q_lens, kv_lens, hq, hkv, d, page, layout, dtype, max_q_len = CASES[name]
    problem = make_problem(np.random.default_rng(len(name)), q_lens=q_lens, kv_lens=kv_lens, num_q_heads=hq,
                           num_kv_heads=hkv, head_dim=d, page_size=page, layout=layout, dtype=dtype,
                           pad_seqs=1, pad_tokens=5, max_q_len=max_q_len)
    out = _run(problem)
    _check(problem, out)
    xla = jaxattn.paged_attention(problem.q, problem.cache, problem.meta, backend="xla")
    assert rel_error(out, np.asarray(xla.astype(jnp.float32))) < TOLERANCE[jnp.dtype(dtype)]


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("seed", range(6))
def test_random_configurations(seed):
    """Random shapes, layouts, page sizes and options against float64 (bf16 rel. error <= 2e-2)."""
    rng = np.random.default_rng(100 + seed)
    batch = int(rng.integers(1, 6))
    q_lens = [int(rng.choice([1, rng.integers(1, 200)])) for _ in range(batch)]
    kv_lens = [q + int(rng.integers(0, 600)) for q in q_lens]
    hkv = int(rng.choice([1, 2, 4]))
    options = dict(sliding_window=[None, int(rng.integers(1, 300))][int(rng.integers(2))],
                   softcap=[None, 20.0][int(rng.integers(2))], causal=bool(rng.integers(4) > 0))
    if options["sliding_window"] is not None:
        options["causal"] = True
    problem = make_problem(rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=hkv * int(rng.choice([1, 4, 8])),
                           num_kv_heads=hkv, head_dim=int(rng.choice([64, 128])),
                           page_size=int(rng.choice([16, 32, 64, 128])), layout=str(rng.choice(["HND", "NHD"])),
                           dtype=BF16, pad_seqs=int(rng.integers(0, 3)), pad_tokens=int(rng.integers(0, 9)))
    sinks = jnp.asarray(rng.normal(size=problem.q.shape[1]), jnp.float32) if rng.integers(2) else None
    out = _run(problem, sinks, **options)
    _check(problem, out, sinks=None if sinks is None else np.asarray(sinks), **options)


@pytest.mark.gpu
@needs_fa4
def test_contract_breaking_sequences_get_zero_rows():
    """A page id outside the pool and a KV length past the table's width: zero rows, valid=False;
    the other sequences are unaffected."""
    problem = make_problem(np.random.default_rng(9), q_lens=[20, 1, 30], kv_lens=[90, 50, 30], num_q_heads=8,
                           num_kv_heads=2, head_dim=128, page_size=16, layout="HND", dtype=BF16, pad_tokens=3)
    tables = problem.meta.block_tables.at[0, 1].set(problem.cache.num_pages + 7)
    kv_lens = problem.meta.kv_lens.at[2].set(10_000)
    meta = jaxattn.AttentionMetadata(problem.meta.cu_q_lens, kv_lens, tables, problem.meta.num_decodes)
    out, valid = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="fa4", return_status=True))(
        problem.q, problem.cache, meta)
    assert np.asarray(valid).tolist()[:3] == [False, True, False]
    out = np.asarray(out.astype(jnp.float32))
    assert not out[:20].any() and not out[21:].any()
    ref = reference(problem)
    assert rel_error(out[20:21], ref[20:21]) < TOLERANCE[jnp.dtype(BF16)]


@pytest.mark.gpu
@needs_fa4
def test_one_compiled_step_serves_other_lengths_and_tables():
    first, second = same_shape_problems()
    step = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="fa4"))
    for problem in (first, second):
        _check(problem, step(problem.q, problem.cache, problem.meta))
    assert step._cache_size() == 1


@pytest.mark.gpu
@needs_fa4
@pytest.mark.parametrize("num_q_heads, page_size, causal", [(16, 64, True), (128, 64, True), (16, 16, False),
                                                            (16, 128, True)])
def test_mla_prefill_matches_float64_and_xla_backend(num_q_heads, page_size, causal):
    check_deepseek_prefill("fa4", num_q_heads, page_size, causal)


@pytest.mark.gpu
@needs_fa4
def test_mla_prefill_over_fp8_latents():
    check_deepseek_prefill("fa4", 16, kv_dtype=jnp.float8_e4m3fn)


@pytest.mark.gpu
@needs_fa4
def test_mla_prefill_flags_broken_sequences():
    check_deepseek_prefill_broken_sequences("fa4")
