"""backend="trtllm": XQA decode via XLA FFI against the xla backend and flashinfer's own XQA call.

CPU tests check the build (one nvcc compile per kernel family) and the error paths; GPU tests
(``-m gpu``) check numerics, padding, batch sizes and CUDA-graph capture.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import math
import os
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import backends
from jaxattn.backends import _nvcc, _xqa_build, trtllm
from jaxattn.backends.base import AttentionParams, Call
from tests.conftest import unpacked_flashinfer_data
from tests.xla_dump import run_with_dump, thunk_sequences, top_level_thunks
from tests.paged_inputs import make_problem, rel_error

FP8 = jnp.float8_e4m3fn
# bf16/fp16 match XQA's own accumulation; fp8 pages make XQA quantize q and P to e4m3 as well.
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float8_e4m3fn": 8e-2}


@pytest.fixture(scope="module")
def xqa_sources(tmp_path_factory):
    """XQA sources for the build: the installed flashinfer-python, else its pinned wheel fetched
    from PyPI without dependencies (torch) and unpacked. Skips when neither is possible."""
    try:
        _xqa_build.find_nvcc()
    except _xqa_build.BuildError as err:
        pytest.skip(str(err))
    if importlib.util.find_spec("flashinfer") is not None or os.environ.get("JAXATTN_XQA_SOURCES"):
        yield
        return
    data = unpacked_flashinfer_data(tmp_path_factory, ("csrc/xqa/",))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXATTN_XQA_SOURCES", str(data / "csrc" / "xqa"))
        yield


# ----------------------------------------------------------------------------------------- CPU

def test_compiles_variants_with_nvcc(xqa_sources, tmp_path, monkeypatch):
    """Both kernel families (generic mha.cu, Hopper fp8 mha_sm90.cu) build, load and report
    the constants they were compiled with; the second lookup hits the disk cache."""
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path))
    variants = [_xqa_build.Variant("bfloat16", "bfloat16", 64, 128, 4, False),
                _xqa_build.Variant("float16", "float8_e4m3fn", 16, 64, 8, True),
                _xqa_build.Variant("bfloat16", "float8_e4m3fn", 32, 128, 6, True, spec_dec=True)]
    with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
        paths = list(pool.map(_xqa_build.build, variants))
    for variant, path in zip(variants, paths):
        assert path.is_file() and _xqa_build.build(variant) == path
        kernel = _xqa_build.load(variant)
        assert kernel.variant_info() == {
            "head_dim": variant.head_dim, "group_size": variant.group_size, "page_size": variant.page_size,
            "input_fp16": int(variant.dtype == "float16"), "cache_fp8": int(variant.cache_dtype == "float8_e4m3fn"),
            "sliding_window": int(variant.sliding_window), "hopper_kernel": int(variant.hopper),
            "spec_dec": int(variant.spec_dec)}
        # 132 SMs: one sequence splits its keys over several CTAs (a semaphore per KV head +
        # scratch); 256 x 8 heads fill the GPU with one CTA each and need neither.
        semaphores, scratch = kernel.workspace(132, 1, 8, 64)
        assert semaphores == 8 and scratch > 0
        assert kernel.workspace(132, 256, 8, 64) == (0, 0)
        if variant.spec_dec:
            # 7 tokens x 6 heads = 42 rows: two CTAs of 32 rows per KV head, each its own semaphore.
            semaphores7, scratch7 = kernel.workspace(132, 1, 8, 64, q_seq_len=7)
            assert semaphores7 == 16 and scratch7 > scratch
        else:
            with pytest.raises(ValueError, match="cannot take q_seq_len=2"):
                kernel.workspace(132, 1, 8, 64, q_seq_len=2)


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(_nvcc, "SYSTEM_NVCC", tmp_path / "nvcc")
    with pytest.raises(_xqa_build.BuildError, match="nvcc .* not found.*CUDA_HOME"):
        _xqa_build.find_nvcc()


def test_missing_flashinfer_is_a_clear_error(monkeypatch):
    real_find_spec = _nvcc.importlib.util.find_spec
    monkeypatch.setattr(_nvcc.importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashinfer" else real_find_spec(name, *a))
    monkeypatch.delenv("JAXATTN_XQA_SOURCES", raising=False)
    with pytest.raises(_xqa_build.BuildError, match="flashinfer-python is not installed"):
        _xqa_build.xqa_source_dir()


def _inputs(*, dtype=jnp.bfloat16, kv_dtype=None, num_q_heads=8, num_kv_heads=2, head_dim=128,
            page_size=64, max_q_len=1, tokens=4, batch=None):
    q = jnp.zeros((tokens, num_q_heads, head_dim), dtype)
    cache = jaxattn.KVCache.create(4, page_size, num_kv_heads, head_dim, dtype=kv_dtype or dtype)
    meta = jaxattn.AttentionMetadata(
        cu_q_lens=jnp.arange((batch or tokens) + 1, dtype=jnp.int32), kv_lens=jnp.ones((batch or tokens,), jnp.int32),
        block_tables=jnp.ones((batch or tokens, 2), jnp.int32), num_decodes=jnp.int32(0), max_q_len=max_q_len)
    return q, cache, meta


_PARAMS = AttentionParams(scale=0.1, causal=True, sliding_window=None, softcap=None, has_sinks=False)


_SINKS = AttentionParams(scale=0.1, causal=True, sliding_window=None, softcap=None, has_sinks=True)


@pytest.mark.parametrize("kwargs,params,match", [
    (dict(max_q_len=None), _PARAMS, r"meta.max_q_len=None is not supported: .*at most 16 tokens"),
    (dict(max_q_len=17, tokens=40), _PARAMS, r"meta.max_q_len=17 is not supported"),
    # sinks + spec decode: XQA's sink lookup is wrong when a 32-row block splits a token's heads
    (dict(max_q_len=6, num_q_heads=12, num_kv_heads=2, tokens=12), _SINKS,
     r"sinks with speculative decode need .*Hq // Hkv = 6.* dividing 32"),
    (dict(max_q_len=11, num_q_heads=6, num_kv_heads=2, tokens=20), _SINKS, "sinks with speculative decode"),
    (dict(dtype=jnp.float32), _PARAMS, "float32 queries are not supported"),
    (dict(kv_dtype=jnp.float16), _PARAMS, "float16 pages with bfloat16 queries are not supported"),
    (dict(page_size=8), _PARAMS, r"page_size must be one of \(16, 32, 64, 128\)"),
    (dict(head_dim=96), _PARAMS, r"head_dim must be one of \(64, 128, 256\)"),
    (dict(num_q_heads=64, num_kv_heads=2), _PARAMS, r"must be in 1..16, got 64 // 2 = 32"),
    (dict(), AttentionParams(0.1, True, None, 30.0, False), "softcap not supported"),
])
def test_unsupported_configurations_raise(kwargs, params, match):
    q, cache, meta = _inputs(**kwargs)
    assert re.search(match, backends.takes("trtllm", Call("paged_attention", q, cache, meta, params)))


def test_supported_configuration_passes():
    q, cache, meta = _inputs(kv_dtype=FP8, num_q_heads=16, num_kv_heads=1, head_dim=64, page_size=16)
    assert backends.takes("trtllm", Call("paged_attention", q, cache, meta, _PARAMS)) is None


@pytest.mark.parametrize("kwargs,params", [
    (dict(max_q_len=4, tokens=9, batch=3), _PARAMS),                     # T need not be B * max_q_len
    (dict(max_q_len=16, tokens=20, kv_dtype=FP8), _PARAMS),
    (dict(max_q_len=7, num_q_heads=32, num_kv_heads=2, tokens=8), _SINKS),  # 16 divides 32
    (dict(max_q_len=5, num_q_heads=12, num_kv_heads=2, tokens=8), _SINKS),  # 5 x 6 rows fit one block
    (dict(max_q_len=16, num_q_heads=12, num_kv_heads=2, tokens=5), _SINKS),  # the bound is min(max_q_len, T)
])
def test_speculative_decode_configurations_pass(kwargs, params):
    q, cache, meta = _inputs(**kwargs)
    assert backends.takes("trtllm", Call("paged_attention", q, cache, meta, params)) is None
    assert trtllm.variant(q, cache, params, spec_dec=True).spec_dec


def test_spec_inputs_mask_and_contract():
    """cu_q_lens passes through; mask row t has bits 0..r set for the token's row r in its
    sequence; sequences breaking the contract get no keys and their rows are flagged."""
    # seq 0: 3 tokens, 10 keys | seq 1: empty | seq 2: 2 tokens, 2 keys | seq 3: 4 > max_q_len tokens
    # | seq 4: 2 tokens but 1 key (kv_len < q_len) | seq 5: empty, then 2 padding tokens
    meta = jaxattn.AttentionMetadata(
        cu_q_lens=jnp.asarray([0, 3, 3, 5, 9, 11, 11], jnp.int32), kv_lens=jnp.asarray([10, 0, 2, 3, 1, 0], jnp.int32),
        block_tables=jnp.zeros((6, 1), jnp.int32), num_decodes=jnp.int32(0), max_q_len=3)
    seq_lens, cu, mask, row_valid = trtllm.spec_inputs(meta, 13, 3, 64)
    np.testing.assert_array_equal(seq_lens, [10, 0, 2, 0, 0, 0])
    np.testing.assert_array_equal(cu, meta.cu_q_lens)
    assert mask.dtype == jnp.uint32 and mask.shape == (13, 1)
    np.testing.assert_array_equal(mask[:, 0], [1, 3, 7, 1, 3, 1, 3, 7, 15, 1, 3, 1, 3])
    np.testing.assert_array_equal(row_valid, [1, 1, 1, 1, 1] + [0] * 8)
    _, _, full, _ = trtllm.spec_inputs(meta, 13, 3, 64, causal=False)
    assert (np.asarray(full) == 0xFFFFFFFF).all()
    # A 40-token bound: two words per row; decreasing offsets or offsets past T void the sequences.
    meta = jaxattn.AttentionMetadata(
        cu_q_lens=jnp.asarray([0, 40, 35, 50], jnp.int32), kv_lens=jnp.asarray([50, 50, 50], jnp.int32),
        block_tables=jnp.zeros((3, 1), jnp.int32), num_decodes=jnp.int32(0), max_q_len=40)
    seq_lens, cu, mask, row_valid = trtllm.spec_inputs(meta, 45, 40, 64)
    np.testing.assert_array_equal(seq_lens, [50, 0, 0])
    np.testing.assert_array_equal(cu, [0, 40, 40, 45])
    words = np.asarray(mask)
    assert words.shape == (45, 2)
    np.testing.assert_array_equal(words[[0, 30, 31, 32, 39]], [[1, 0], [0x7FFFFFFF, 0], [0xFFFFFFFF, 0],
                                                               [0xFFFFFFFF, 1], [0xFFFFFFFF, 0xFF]])
    np.testing.assert_array_equal(row_valid, [1] * 40 + [0] * 5)


def _emulate_xqa_spec(problem, params, sinks=None):
    """What XQA's speculative-decode kernel computes from ``spec_inputs`` (its masking rules in
    mha.cu: keys before the last q_len always visible, the last q_len by the mask bits, the
    window per row), in float64 with numpy; rows with row_valid == 0 are zero."""
    meta, q = problem.meta, np.asarray(problem.q.astype(jnp.float32), np.float64)
    num_tokens, num_q_heads, _ = q.shape
    capacity = meta.block_tables.shape[1] * problem.cache.page_size
    causal = params.causal or params.sliding_window is not None
    seq_lens, cu, mask, row_valid = (np.asarray(x) for x in trtllm.spec_inputs(
        meta, num_tokens, min(meta.max_q_len, num_tokens), capacity, causal))
    group = num_q_heads // problem.cache.num_kv_heads
    out = np.zeros_like(q)
    for b in range(meta.batch_size):
        n, length = int(seq_lens[b]), int(cu[b + 1] - cu[b])
        if length == 0 or n == 0:
            continue
        k, v = problem.k_dense[b][:n], problem.v_dense[b][:n]
        for r in range(length):
            t = int(cu[b]) + r
            bits = [(int(mask[t, j // 32]) >> (j % 32)) & 1 for j in range(length)]
            col = np.arange(n)
            visible = (col < n - length) | np.array([bits[c - (n - length)] if c >= n - length else 0 for c in col], bool)
            if params.sliding_window is not None and n > params.sliding_window:
                visible &= col >= n - length + 1 - params.sliding_window + r
            for h in range(num_q_heads):
                s = params.scale * (k[:, h // group] @ q[t, h])
                s = np.where(visible, s, -np.inf)
                m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
                p = np.exp(s - m)
                denom = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
                out[t, h] = p @ v[:, h // group] / denom
    return out * row_valid[:, None, None]


@pytest.mark.parametrize("causal,window,with_sinks", [(True, None, False), (True, 5, True), (False, None, False)])
def test_spec_inputs_give_the_reference_semantics(causal, window, with_sinks):
    """The mask, offsets and lengths handed to XQA, under XQA's own masking rules, give what the
    xla reference computes for a ragged spec-decode step (unequal q and kv lengths, GQA, an
    empty sequence, padding tokens); checked on CPU with an emulation of the kernel's rules."""
    rng = np.random.default_rng(3)
    q_lens, kv_lens = [4, 1, 0, 3, 2], [37, 9, 0, 3, 20]
    problem = make_problem(rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=6, num_kv_heads=2, head_dim=16,
                           page_size=8, dtype=jnp.float32, pad_seqs=1, pad_tokens=3, max_q_len=4)
    sinks = jnp.asarray(rng.normal(size=6), jnp.float32) if with_sinks else None
    params = AttentionParams(scale=0.25, causal=causal, sliding_window=window, softcap=None, has_sinks=with_sinks)
    expected = jaxattn.paged_attention(problem.q, problem.cache, problem.meta, causal=causal, sliding_window=window,
                                       sinks=sinks, backend="xla")
    emulated = _emulate_xqa_spec(problem, dataclasses.replace(params, scale=1 / math.sqrt(16)),
                                 None if sinks is None else np.asarray(sinks))
    np.testing.assert_allclose(emulated, np.asarray(expected), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(bool(jax.devices()[0].platform == "gpu"), reason="checks the CPU-only message")
def test_unavailable_without_gpu():
    q, cache, meta = _inputs()
    with pytest.raises(ValueError, match="backend 'trtllm' cannot take this call: no NVIDIA GPU"):
        jaxattn.paged_attention(q, cache, meta, backend="trtllm")


@pytest.mark.parametrize("cache_dtype, batch, kv, multiple", [
    ("bfloat16", 1, 131072, 1),       # the generic kernel: always the device's count
    (FP8, 1, 4096, 1), (FP8, 1, 16384, 2), (FP8, 1, 131072, 2), (FP8, 2, 1024, 1), (FP8, 2, 4096, 2),
    (FP8, 4, 32768, 2), (FP8, 8, 32768, 2),
    (FP8, 16, 4096, 1), (FP8, 64, 4096, 1)])   # 2x would pass 1.6 CTAs per SM; the count fills every SM
def test_split_sm_count(monkeypatch, cache_dtype, batch, kv, multiple):
    """The SM count XQA's split formula gets (132-SM device, Hkv 8, page 64): the fp8 (Hopper)
    kernel gets 2x where the device's count leaves SMs idle and 2x stays within 1.6 CTAs per SM of
    at least 320 keys each (tune_xqa_splits)."""
    monkeypatch.setattr(trtllm, "sm_count", lambda: 132)
    variant = _xqa_build.Variant(dtype="bfloat16", cache_dtype=np.dtype(cache_dtype).name, page_size=64,
                                 head_dim=128, group_size=4, sliding_window=False)
    assert trtllm.split_sm_count(variant, batch, 8, kv // 64) == multiple * 132


def test_sinks_always_reach_the_generic_kernel():
    """Absent sinks become the floor, given ones are clamped to it; the Hopper kernel gets them as given."""
    floor = trtllm.SINK_FLOOR
    np.testing.assert_array_equal(trtllm._sinks(None, 4, hopper=False), np.full(4, floor, np.float32))
    given = jnp.asarray([0.5, -jnp.inf, -1e6, 2.0], jnp.bfloat16)
    np.testing.assert_array_equal(trtllm._sinks(given, 4, hopper=False), [0.5, floor, floor, 2.0])
    assert trtllm._sinks(None, 4, hopper=True).shape == (0,)
    np.testing.assert_array_equal(trtllm._sinks(given, 4, hopper=True), given.astype(jnp.float32))


# ----------------------------------------------------------------------------------------- GPU

# (dtype, kv dtype, layout, page, head_dim, Hq, Hkv, features): every kernel family, both layouts,
# GQA 1..16, all page sizes and head dims, sliding window and sinks.
GPU_CASES = [
    ("bfloat16", "bfloat16", "HND", 64, 128, 32, 8, {}),
    ("float16", "float16", "NHD", 16, 64, 4, 4, {}),
    ("bfloat16", "bfloat16", "HND", 32, 256, 16, 1, {"sinks": True}),
    ("bfloat16", "bfloat16", "NHD", 128, 128, 16, 2, {"sliding_window": 100, "sinks": True}),
    ("float16", "float16", "HND", 64, 128, 4, 2, {"sliding_window": 7}),
    ("bfloat16", "float8_e4m3fn", "HND", 64, 128, 32, 8, {}),
    ("float16", "float8_e4m3fn", "NHD", 16, 64, 8, 1, {"sinks": True, "sliding_window": 50}),
    ("bfloat16", "float8_e4m3fn", "NHD", 32, 256, 8, 4, {"sinks": True}),
]


def _case_id(case) -> str:
    dtype, kv, layout, page, dim, hq, hkv, features = case
    return f"{dtype}-kv_{kv}-{layout}-p{page}-d{dim}-{hq}x{hkv}-{'-'.join(features) or 'plain'}"


def _variant(case) -> _xqa_build.Variant:
    dtype, kv, _, page, dim, hq, hkv, features = case
    return _xqa_build.Variant(dtype, kv, page, dim, hq // hkv, "sliding_window" in features)


@pytest.fixture(scope="module")
def prebuilt():
    """Compiles every variant of this module in parallel before the tests trace them."""
    variants = sorted({_variant(c) for c in GPU_CASES} | {_spec_variant(c) for c in SPEC_CASES}, key=lambda v: v.name)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(_xqa_build.build, variants))


def _problem(case, rng, kv_lens, *, q_lens=None, pad_seqs=1, pad_tokens=3):
    dtype, kv, layout, page, dim, hq, hkv, _ = case
    q_lens = [1] * len(kv_lens) if q_lens is None else q_lens
    return make_problem(rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=hq, num_kv_heads=hkv,
                        head_dim=dim, page_size=page, layout=layout, dtype=jnp.dtype(dtype),
                        kv_dtype=jnp.dtype(kv), pad_seqs=pad_seqs, pad_tokens=pad_tokens, max_q_len=1)


def _kwargs(case, rng) -> dict:
    features = dict(case[-1])
    if features.pop("sinks", False):
        features["sinks"] = jnp.asarray(rng.normal(size=case[5]), jnp.float32)
    return features


def _run(backend, problem, **kwargs):
    fn = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend=backend, **kwargs))
    return fn(problem.q, problem.cache, problem.meta)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_matches_xla(case, prebuilt):
    """Unequal lengths, a padding sequence (no tokens, no keys) in the middle, a decode with no
    keys, padding sequences and tokens at the end; this small batch runs XQA's multi-CTA split
    (semaphores + scratch)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    q_lens = [1] * 5 + [0] + [1, 1]
    kv_lens = [int(n) for n in rng.integers(1, 700, size=5)] + [0] + [0, 1]
    problem = _problem(case, rng, kv_lens, q_lens=q_lens)
    kwargs = _kwargs(case, rng)
    out = _run("trtllm", problem, **kwargs)
    ref = _run("xla", problem, **kwargs)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    token_kv_lens = [n for n, q in zip(kv_lens, q_lens) if q]           # tokens in sequence order
    rows = np.flatnonzero(np.asarray(token_kv_lens) > 0)
    assert rel_error(out[rows], ref[rows]) < TOLERANCE[case[1]], f"seed {seed}"
    dead = np.setdiff1d(np.arange(out.shape[0]), rows)
    assert not np.asarray(out[dead].astype(jnp.float32)).any(), f"padding rows not zero (seed {seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 64, 256])
def test_batch_sizes(batch, prebuilt):
    case = GPU_CASES[0]
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    kv_lens = [int(n) for n in rng.integers(1, 300 if batch > 64 else 2000, size=batch)]
    problem = _problem(case, rng, kv_lens, pad_seqs=0, pad_tokens=0)
    assert rel_error(_run("trtllm", problem), _run("xla", problem)) < TOLERANCE["bfloat16"], f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_fp8_long_context_with_more_splits(batch, prebuilt):
    """fp8 pages at low batch and long context, where ``split_sm_count`` gives XQA's Hopper kernel
    more than the device's SM count (more CTAs per sequence, a longer merge)."""
    case = next(c for c in GPU_CASES if c[1] == "float8_e4m3fn" and c[2] == "HND")
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    kv_lens = [int(n) for n in rng.integers(20000, 32768, size=batch)]
    problem = _problem(case, rng, kv_lens, pad_seqs=1, pad_tokens=2)
    width = problem.meta.block_tables.shape[1]
    assert trtllm.split_sm_count(_variant(case), problem.q.shape[0], case[6], width) > trtllm.sm_count()
    rows = np.arange(batch)
    out, ref = _run("trtllm", problem), _run("xla", problem)
    assert rel_error(out[rows], ref[rows]) < TOLERANCE[case[1]], f"seed {seed}"
    assert not np.asarray(out[batch:].astype(jnp.float32)).any(), f"padding rows not zero (seed {seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[3], GPU_CASES[5]], ids=_case_id)
def test_padding_rows_one_cta_per_sequence(case, prebuilt):
    """At B=64 XQA runs one CTA per (sequence, KV head) and no zeroing pass follows it for
    bf16/fp16 pages: rows of tokens without keys must still be zero (sinks included)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    kv_lens = [int(n) for n in rng.integers(1, 500, size=64)]
    kv_lens[5] = kv_lens[40] = 0
    problem = _problem(case, rng, kv_lens, pad_seqs=2, pad_tokens=5)
    kwargs = _kwargs(case, rng)
    out = _run("trtllm", problem, **kwargs)
    ref = _run("xla", problem, **kwargs)
    rows = np.flatnonzero(np.asarray(kv_lens) > 0)
    assert rel_error(out[rows], ref[rows]) < TOLERANCE[case[1]], f"seed {seed}"
    dead = np.setdiff1d(np.arange(out.shape[0]), rows)
    assert not np.asarray(out[dead].astype(jnp.float32)).any(), f"padding rows not zero (seed {seed})"


@pytest.mark.gpu
def test_sinks_of_minus_infinity_mean_no_sink(prebuilt):
    """-inf (no sink) and very negative sinks, in a small batch where XQA splits sequences and
    a decode has no keys: the rows with keys match xla, the row without is zero."""
    case = GPU_CASES[2]
    rng = np.random.default_rng(11)
    problem = _problem(case, rng, [700, 0, 1500], pad_seqs=1, pad_tokens=2)
    sinks = jnp.asarray([-np.inf, -1e9, 1.0] + [-np.inf] * (case[5] - 3), jnp.float32)
    out = _run("trtllm", problem, sinks=sinks)
    ref = _run("xla", problem, sinks=sinks)
    assert rel_error(out[np.array([0, 2])], ref[np.array([0, 2])]) < TOLERANCE["bfloat16"]
    assert not np.asarray(out[np.array([1, 3, 4])].astype(jnp.float32)).any()


@pytest.mark.gpu
def test_independent_calls_keep_their_own_semaphores(prebuilt):
    """Calls that XLA may run concurrently (no data dependence, one jit) split sequences over
    CTAs with semaphores that persist across calls: each call site has its own."""
    case = GPU_CASES[0]
    rng = np.random.default_rng(7)
    problem = _problem(case, rng, [int(n) for n in rng.integers(500, 3000, size=2)], pad_seqs=0, pad_tokens=0)
    queries = [problem.q * s for s in (1.0, -0.5, 2.0, 0.25)]
    both = jax.jit(lambda qs, c, m: [jaxattn.paged_attention(q, c, m, backend="trtllm") for q in qs])
    one = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="trtllm"))
    for _ in range(3):
        together = both(queries, problem.cache, problem.meta)
        for q, out in zip(queries, together):
            np.testing.assert_array_equal(np.asarray(out), np.asarray(one(q, problem.cache, problem.meta)))


# ------------------------------------------------------------------ GPU: speculative decode

# (dtype, kv dtype, layout, page, head_dim, Hq, Hkv, features, max_q_len): both layouts, GQA 1..16
# (6: a token's heads straddle XQA's 32-row blocks), fp8 pages (mha.cu), window and sinks, and
# max_q_len * group from 2 to 112 rows (one to four row blocks per KV head).
SPEC_CASES = [
    ("bfloat16", "bfloat16", "HND", 64, 128, 32, 8, {}, 4),
    ("float16", "float16", "NHD", 16, 64, 4, 4, {}, 2),
    ("bfloat16", "bfloat16", "NHD", 32, 128, 16, 2, {"sliding_window": 100, "sinks": True}, 3),
    ("bfloat16", "float8_e4m3fn", "HND", 64, 128, 32, 8, {}, 4),
    ("float16", "float8_e4m3fn", "NHD", 16, 64, 24, 4, {"sliding_window": 50}, 7),
    ("bfloat16", "bfloat16", "HND", 128, 256, 16, 1, {"sinks": True}, 7),
    # the longest drafts, on the variants above (max_q_len is a launch argument, not a build option)
    ("bfloat16", "bfloat16", "HND", 64, 128, 32, 8, {}, 16),
    ("float16", "float8_e4m3fn", "NHD", 16, 64, 24, 4, {"sliding_window": 50}, 12),
    ("bfloat16", "bfloat16", "HND", 128, 256, 16, 1, {"sinks": True}, 16),
]


def _spec_id(case) -> str:
    return f"{_case_id(case[:-1])}-q{case[-1]}"


def _spec_variant(case) -> _xqa_build.Variant:
    return dataclasses.replace(_variant(case[:-1]), spec_dec=True)


@pytest.fixture(scope="module")
def prebuilt_spec(prebuilt):
    """The speculative-decode variants (built with the others by ``prebuilt``)."""


def _spec_problem(case, rng, q_lens, kv_lens, *, pad_seqs=1, pad_tokens=3):
    dtype, kv, layout, page, dim, hq, hkv, _, max_q = case
    return make_problem(rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=hq, num_kv_heads=hkv,
                        head_dim=dim, page_size=page, layout=layout, dtype=jnp.dtype(dtype),
                        kv_dtype=jnp.dtype(kv), pad_seqs=pad_seqs, pad_tokens=pad_tokens, max_q_len=max_q)


def _check_rows(out, ref, live, tolerance, seed):
    """Rows of ``live`` tokens match the reference, the rest are exactly zero."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_error(out[live], ref[live]) < tolerance, f"seed {seed}"
    dead = np.setdiff1d(np.arange(out.shape[0]), live)
    assert not np.asarray(out[dead].astype(jnp.float32)).any(), f"dead rows not zero (seed {seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("case", SPEC_CASES, ids=_spec_id)
def test_spec_decode_matches_xla(case, prebuilt_spec):
    """Ragged speculative decode: full-length, shorter and single-token sequences, an empty
    padding sequence in the middle, padding sequences and tokens at the end, unequal KV lengths
    (one exactly q_len: its first row sees one key); the small batch splits keys over CTAs."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    max_q = case[-1]
    q_lens = [max_q, 1, max_q, 0, max(max_q - 1, 1), max_q]
    kv_lens = [int(n) for n in rng.integers(max_q, 900, size=len(q_lens))]
    kv_lens[3], kv_lens[5] = 0, max_q
    problem = _spec_problem(case, rng, q_lens, kv_lens)
    kwargs = _kwargs(case[:-1], rng)
    out = _run("trtllm", problem, **kwargs)
    ref = _run("xla", problem, **kwargs)
    _check_rows(out, ref, np.arange(sum(q_lens)), TOLERANCE[case[1]], seed)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64, 200])
def test_spec_decode_batch_sizes(batch, prebuilt_spec):
    """Uniform lengths (T = B * max_q_len, no padding), from XQA's multi-CTA split to one CTA
    per (sequence, KV head, row block)."""
    case = SPEC_CASES[0]
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    kv_lens = [int(n) for n in rng.integers(case[-1], 300 if batch > 64 else 2000, size=batch)]
    problem = _spec_problem(case, rng, [case[-1]] * batch, kv_lens, pad_seqs=0, pad_tokens=0)
    assert rel_error(_run("trtllm", problem), _run("xla", problem)) < TOLERANCE["bfloat16"], f"seed {seed}"


@pytest.mark.gpu
def test_spec_decode_not_causal(prebuilt_spec):
    case = SPEC_CASES[0]
    rng = np.random.default_rng(5)
    problem = _spec_problem(case, rng, [4, 2, 3], [300, 40, 1000])
    out = _run("trtllm", problem, causal=False)
    ref = _run("xla", problem, causal=False)
    _check_rows(out, ref, np.arange(9), TOLERANCE["bfloat16"], 5)


@pytest.mark.gpu
def test_spec_decode_contract_violations_give_zero_rows(prebuilt_spec):
    """A sequence longer than max_q_len and one with fewer keys than query tokens get zero rows;
    the others are unaffected."""
    case = SPEC_CASES[2]
    rng = np.random.default_rng(9)
    q_lens, kv_lens = [3, 5, 2, 3, 1], [400, 600, 1, 250, 30]       # max_q_len is 3
    problem = _spec_problem(case, rng, q_lens, kv_lens)
    kwargs = _kwargs(case[:-1], rng)
    out = _run("trtllm", problem, **kwargs)
    ref = _run("xla", problem, **kwargs)
    live = np.r_[0:3, 10:14]                                        # sequences 0, 3 and 4
    _check_rows(out, ref, live, TOLERANCE["bfloat16"], 9)


def _flashinfer_decode(problem, case, kwargs):
    """flashinfer's trtllm_batch_decode_with_kv_cache(backend="xqa") in torch on the same buffers."""
    torch = pytest.importorskip("torch")
    flashinfer = pytest.importorskip("flashinfer")
    cache, meta = problem.cache, problem.meta
    as_torch = lambda x: torch.from_dlpack(x)                                    # noqa: E731
    if cache.is_fp8:  # through uint8: dlpack's fp8 codes are not universal yet
        k, v = (as_torch(jax.lax.bitcast_convert_type(p, jnp.uint8)).view(torch.float8_e4m3fn)
                for p in (cache.k_pages, cache.v_pages))
    else:
        k, v = as_torch(cache.k_pages), as_torch(cache.v_pages)
    scale = 1 / math.sqrt(problem.q.shape[2])
    bmm1, bmm2 = scale, 1.0
    if cache.is_fp8:
        bmm1, bmm2 = scale * float(cache.k_scale), float(cache.v_scale)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    window = kwargs.get("sliding_window")
    sinks = kwargs.get("sinks")
    out = flashinfer.decode.trtllm_batch_decode_with_kv_cache(
        as_torch(problem.q), (k, v), workspace, as_torch(meta.block_tables), as_torch(meta.kv_lens),
        int(np.max(np.asarray(meta.kv_lens))), bmm1_scale=bmm1, bmm2_scale=bmm2,
        window_left=-1 if window is None else window - 1,
        sinks=None if sinks is None else as_torch(sinks), kv_layout=case[2], backend="xqa")
    torch.cuda.synchronize()
    return jnp.asarray(np.asarray(out.float().cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[3], GPU_CASES[5]], ids=_case_id)
@pytest.mark.parametrize("batch", [2, 64])
def test_matches_flashinfer_xqa(case, batch, prebuilt):
    """Same kernel, same split: agreement to rounding of the final output."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    problem = _problem(case, rng, [int(n) for n in rng.integers(1, 3000, size=batch)], pad_seqs=0, pad_tokens=0)
    kwargs = _kwargs(case, rng)
    expected = _flashinfer_decode(problem, case, kwargs)
    assert rel_error(_run("trtllm", problem, **kwargs), expected) < 2e-3, f"seed {seed}"


_GRAPH_SCRIPT = textwrap.dedent("""
    import ctypes
    import jax, jax.numpy as jnp, numpy as np
    import jaxattn
    from jaxattn.backends import _xqa_build
    from tests.paged_inputs import make_problem

    rng = np.random.default_rng(0)
    q_len = {q_len}
    problem = make_problem(rng, q_lens=[q_len] * 8, kv_lens=[int(n) for n in rng.integers(q_len, 500, 8)],
                           num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64, dtype=jnp.bfloat16,
                           pad_seqs=0, pad_tokens=0, max_q_len=q_len)

    layers = 3

    @jax.jit
    def step(q, cache, meta):                     # a toy decode step: 3 layers sharing the cache
        for _ in range(layers):
            q = jaxattn.paged_attention(jnp.tanh(q) * 2, cache, meta, backend="trtllm")
        return jnp.sin(q * 3 + 1).sum(axis=-1)

    calls = 6
    for _ in range(calls):
        step(problem.q, problem.cache, problem.meta).block_until_ready()
    lib = _xqa_build.load(_xqa_build.Variant("bfloat16", "bfloat16", 64, 128, 4, False, spec_dec=q_len > 1)).library
    lib.jaxattn_xqa_host_executions.restype = ctypes.c_int64
    print("HOST_EXECUTIONS", lib.jaxattn_xqa_host_executions(), "CALLS", calls * layers)
""")


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 4], ids=["decode", "spec-decode"])
def test_command_buffer_capture(tmp_path, prebuilt, q_len):
    """XLA records the custom call into a CUDA graph (kCommandBuffer in the thunk dump) and
    replays it: the handler's host code runs only when XLA (re)records, not on every call."""
    result = run_with_dump(_GRAPH_SCRIPT.format(q_len=q_len), tmp_path)
    line = next(l for l in result.stdout.splitlines() if l.startswith("HOST_EXECUTIONS"))
    executions, calls = int(line.split()[1]), int(line.split()[3])
    for name, thunks in thunk_sequences(tmp_path, "jit_step").items():
        top = top_level_thunks(thunks)
        assert "kCommandBuffer" in top and "kCustomCall" not in top, (name, thunks[-3000:])
    assert 0 < executions < calls, f"host execute ran {executions} times for {calls} calls"


def _flashinfer_spec_decode(problem, case, mask):
    """flashinfer's trtllm_batch_decode_with_kv_cache(backend="xqa", q_len_per_req=...) on
    uniform lengths, with our causal bit mask as its uint16 [B, q_len, 2] mask."""
    torch = pytest.importorskip("torch")
    flashinfer = pytest.importorskip("flashinfer")
    cache, meta = problem.cache, problem.meta
    batch, max_q = meta.batch_size, case[-1]
    as_torch = lambda x: torch.from_dlpack(x)                                    # noqa: E731
    mask16 = jax.lax.bitcast_convert_type(mask, jnp.uint16).reshape(batch, max_q, -1)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    out = flashinfer.decode.trtllm_batch_decode_with_kv_cache(
        as_torch(problem.q), (as_torch(cache.k_pages), as_torch(cache.v_pages)), workspace,
        as_torch(meta.block_tables), as_torch(meta.kv_lens), int(np.max(np.asarray(meta.kv_lens))),
        bmm1_scale=1 / math.sqrt(problem.q.shape[2]), bmm2_scale=1.0, kv_layout=case[2], backend="xqa",
        q_len_per_req=max_q, mask=torch.from_dlpack(jax.lax.bitcast_convert_type(mask16, jnp.int16)).view(torch.uint16))
    torch.cuda.synchronize()
    return jnp.asarray(np.asarray(out.float().cpu()))


@pytest.mark.gpu
def test_spec_decode_matches_flashinfer_xqa(prebuilt_spec):
    """Same kernel (mha.cu, SPEC_DEC), same split and mask: agreement to output rounding."""
    case = SPEC_CASES[0]
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    batch, max_q = 8, case[-1]
    problem = _spec_problem(case, rng, [max_q] * batch, [int(n) for n in rng.integers(max_q, 3000, size=batch)],
                            pad_seqs=0, pad_tokens=0)
    _, _, mask, _ = trtllm.spec_inputs(problem.meta, batch * max_q, max_q, 1 << 20)
    expected = _flashinfer_spec_decode(problem, case, mask)
    assert rel_error(_run("trtllm", problem), expected) < 2e-3, f"seed {seed}"
