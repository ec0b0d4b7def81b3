"""The flashinfer backend (FlashInfer's SM90 MLA kernel through XLA FFI).

On CPU: the device-side schedule (``flashinfer.plan``) run through a float64 emulation of what
the kernel does with it (works per CTA, partial rows, the merge after the grid sync), against the
absorbed reference, counting how often each output row is written; the handler's build; the
checks. On the GPU: the kernel against the xla backend and the reference at DeepSeek's shapes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import backends
from jaxattn.backends import _mla_build, _nvcc
from jaxattn.backends import flashinfer as fb
from jaxattn.backends.base import AttentionParams, Call
from tests.conftest import unpacked_flashinfer_data
from tests.mla_inputs import (break_metadata, check_captured_in_command_buffer, check_deepseek_broken_sequences,
                               check_deepseek_decode, check_deepseek_fp8_pool, make_mla_problem)

SMALL = dict(kv_lora_rank=32, rope_dim=16, nope_dim=16, v_dim=16, page_size=8)


def _params(problem, causal=True) -> AttentionParams:
    return AttentionParams(scale=problem.scale, causal=causal, sliding_window=None, softcap=None, has_sinks=False)


def _emulate(schedule: fb.Plan, q_latent, q_rope, pages, tables, scale: float, causal: bool):
    """What the kernel computes from ``schedule``, in float64: ``(out [T, H, R], writes [T, H])``."""
    ql = np.asarray(q_latent.astype(jnp.float32), np.float64)
    qr = np.asarray(q_rope.astype(jnp.float32), np.float64)
    pool = np.asarray(pages.astype(jnp.float32), np.float64)
    flat = np.asarray(tables).reshape(-1)
    num_tokens, heads, rank = ql.shape
    page = pool.shape[1]
    works, indptr, merge = (np.asarray(a) for a in (schedule.works, schedule.work_indptr, schedule.merge))
    out = np.full((num_tokens, heads, rank), np.nan)
    writes = np.zeros((num_tokens, heads), int)
    partial_o = np.full((schedule.partial_rows, rank), np.nan)
    partial_lse = np.full(schedule.partial_rows, np.nan)
    assert np.all(np.diff(indptr) >= 0) and indptr[0] == 0 and indptr[-1] <= works.shape[1]
    for y in range(schedule.clusters):
        for w in range(indptr[y], indptr[y + 1]):
            q_start, kv_page, part, q_len, kv_len, packed_start, kv_start, kv_end = works[:, w]
            for x in range(schedule.cluster):
                p = packed_start + x * fb.CTA_TILE_Q + np.arange(fb.CTA_TILE_Q)
                p = p[p < q_len * heads]
                if not p.size:
                    continue
                tok, head = q_start + p // heads, p % heads
                keys = np.arange(kv_start, kv_end)
                lat = pool[flat[kv_page + keys // page], keys % page] if keys.size else np.zeros((0, pool.shape[2]))
                s = scale * (ql[tok, head] @ lat[:, :rank].T + qr[tok, head] @ lat[:, rank:].T)
                visible = np.repeat((keys < kv_len)[None], p.size, axis=0)
                if causal:
                    visible &= keys[None, :] <= (kv_len - q_len + p // heads)[:, None]
                s = np.where(visible, s, -np.inf)
                m = s.max(axis=1, initial=-np.inf)
                e = np.where(visible, np.exp(s - np.where(np.isfinite(m), m, 0)[:, None]), 0)
                d = e.sum(axis=1)
                o = (e @ lat[:, :rank]) / np.where(d > 0, d, 1)[:, None]
                if part < 0:
                    out[tok, head] = o
                    writes[tok, head] += 1
                else:
                    rows = part + p - packed_start
                    assert rows.max() < schedule.partial_rows
                    partial_o[rows] = o
                    partial_lse[rows] = np.where(d > 0, np.log(np.where(d > 0, d, 1)) + m, -np.inf)
    for start, end, part_start, part_end, stride in merge.T:
        for offset in range(end - start):
            lse = partial_lse[part_start + offset:part_end:stride]
            o = partial_o[part_start + offset:part_end:stride]
            assert not np.isnan(lse).any(), "the merge read a partial row no work wrote"
            top = lse.max()
            weight = np.exp(lse - top) if np.isfinite(top) else np.zeros_like(lse)
            tok, head = divmod(start + offset, heads)
            out[tok, head] = weight @ o / max(weight.sum(), 1e-300) if weight.sum() else 0
            writes[tok, head] += 1
    return out, writes


def _check_schedule(problem, meta, *, sm_count: int, causal: bool = True, expected=None):
    meta, _ = meta.sanitize(problem.q_latent.shape[0], problem.cache.num_pages, problem.cache.page_size)
    num_tokens, heads, _ = problem.q_latent.shape
    schedule = jax.jit(fb.plan, static_argnums=(2, 3, 4, 5, 6, 7))(
        meta.cu_q_lens, meta.kv_lens, meta.max_pages_per_seq, num_tokens, heads, sm_count, meta.max_q_len, causal)
    out, writes = _emulate(schedule, problem.q_latent, problem.q_rope, problem.cache.pages, meta.block_tables,
                           problem.scale, causal)
    np.testing.assert_array_equal(writes, 1, err_msg="every output row is written exactly once")
    if expected is None:
        expected = problem.absorbed_reference(problem.q_latent, causal)
    np.testing.assert_allclose(out, expected, rtol=1e-9, atol=1e-9)
    return schedule


# --- CPU: the schedule -------------------------------------------------------------------------

@pytest.mark.parametrize("num_q_heads, sm_count", [(4, 8), (16, 132), (128, 16), (128, 132)])
@pytest.mark.parametrize("causal", [True, False])
def test_decode_schedule(num_q_heads, sm_count, causal):
    """Decode of sequences of very different lengths, an empty one and padding tokens; few SMs
    split the long sequences into many chunks."""
    rng = np.random.default_rng(num_q_heads + sm_count)
    problem = make_mla_problem(rng, q_lens=[1] * 6, kv_lens=[1, 70, 300, 5, 0, 129], num_q_heads=num_q_heads,
                               max_q_len=1, **SMALL)
    schedule = _check_schedule(problem, problem.meta, sm_count=sm_count, causal=causal)
    assert schedule.cluster == (2 if num_q_heads > 64 else 1)


@pytest.mark.parametrize("num_q_heads, sm_count", [(4, 8), (16, 16), (128, 132)])
def test_ragged_queries_schedule(num_q_heads, sm_count):
    """Speculative-decode and prefill-length queries: several query tiles per sequence, causal."""
    rng = np.random.default_rng(7)
    problem = make_mla_problem(rng, q_lens=[3, 1, 17, 4, 40], kv_lens=[50, 1, 17, 200, 41], num_q_heads=num_q_heads,
                               **SMALL)
    _check_schedule(problem, problem.meta, sm_count=sm_count)
    _check_schedule(problem, problem.meta, sm_count=sm_count, causal=False)


def test_leading_padding_tokens_are_zero():
    """Tokens before cu_q_lens[0] belong to no sequence: zeros, written by a request without keys."""
    rng = np.random.default_rng(8)
    problem = make_mla_problem(rng, q_lens=[2, 1], kv_lens=[30, 9], num_q_heads=16, **SMALL)
    lead = 3
    shift = lambda x: jnp.concatenate([jnp.asarray(rng.normal(size=(lead,) + x.shape[1:]), x.dtype), x])  # noqa: E731
    shifted = dataclasses.replace(problem, q_nope=shift(problem.q_nope), q_rope=shift(problem.q_rope),
                                  meta=dataclasses.replace(problem.meta, cu_q_lens=problem.meta.cu_q_lens + lead))
    expected = np.concatenate([np.zeros((lead,) + problem.q_latent.shape[1:]),
                               problem.absorbed_reference(problem.q_latent)])
    _check_schedule(shifted, shifted.meta, sm_count=8, expected=expected)


def test_broken_sequences_schedule():
    """Sanitized broken sequences (no keys, queries kept) get zero rows."""
    rng = np.random.default_rng(9)
    problem = make_mla_problem(rng, q_lens=[1, 2, 3, 1, 2], kv_lens=[9, 20, 17, 4, 30], num_q_heads=16, max_q_len=2,
                               **SMALL)
    meta, broken = break_metadata(rng, problem, ["page", "none", "short", "long", "none"])
    _check_schedule(problem, meta, sm_count=8, expected=problem.without(broken).absorbed_reference(problem.q_latent))


def test_check_supported():
    problem = make_mla_problem(np.random.default_rng(4), q_lens=[1], kv_lens=[4], num_q_heads=4,
                               dtype=jnp.bfloat16, **SMALL)

    def takes(q, cache):
        call = Call("mla_paged_attention", q, cache, problem.meta, _params(problem), q_rope=problem.q_rope)
        return backends.takes("flashinfer", call)

    assert takes(problem.q_latent, problem.cache) == ("the cache's (kv_lora_rank, rope_dim) must be (512, 64), "
                                                      "got (32, 16)")
    assert "float32 queries are not supported" in takes(problem.q_latent.astype(jnp.float32), problem.cache)
    f16 = jaxattn.MLACache.create(4, 8, 512, 64, dtype=jnp.float16)
    assert "float16 pages with bfloat16 queries are not supported" in takes(problem.q_latent, f16)


def test_unknown_to_paged_attention():
    """flashinfer runs MLA only: paged_attention does not take it."""
    q = jnp.zeros((1, 4, 64), jnp.bfloat16)
    cache = jaxattn.KVCache.create(4, 16, 1, 64, dtype=jnp.bfloat16)
    meta = jaxattn.AttentionMetadata(cu_q_lens=jnp.array([0, 1]), kv_lens=jnp.array([1]),
                                     block_tables=jnp.array([[1]]), num_decodes=jnp.array(1))
    with pytest.raises(ValueError, match="backend must be one of"):
        jaxattn.paged_attention(q, cache, meta, scale=0.1, backend="flashinfer")


def test_compiles_with_nvcc(tmp_path_factory, tmp_path, monkeypatch):
    """The handler compiles against flashinfer-python's headers (the installed package, else
    the pinned wheel's) with no GPU."""
    try:
        _nvcc.find_nvcc()
    except _nvcc.BuildError as err:
        pytest.skip(str(err))
    if importlib.util.find_spec("flashinfer") is None:
        monkeypatch.setenv("JAXATTN_FLASHINFER_DATA",
                           str(unpacked_flashinfer_data(tmp_path_factory, ("include/", "cutlass/include/", "cccl/"))))
    monkeypatch.setenv("JAXATTN_CACHE_DIR", str(tmp_path))
    for variant in (_mla_build.Variant("bfloat16", "bfloat16", 512, 64),
                    _mla_build.Variant("bfloat16", "float8_e4m3fn", 512, 64)):
        path = _mla_build.build(variant, quiet=True)
        assert path.is_file() and _mla_build.build(variant) == path
        assert ctypes.CDLL(str(path)).JaxattnMlaExecute     # the handler symbol is exported


# --- GPU: DeepSeek shapes in bfloat16 ----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kv_len", [1024, 4096, 16384])
@pytest.mark.parametrize("num_q_heads", [16, 128])
def test_gpu_deepseek_decode(num_q_heads, kv_len):
    check_deepseek_decode("flashinfer", num_q_heads, kv_len)


@pytest.mark.gpu
@pytest.mark.parametrize("max_q_len", [1, 4])
@pytest.mark.parametrize("num_q_heads", [16, 128])
def test_gpu_deepseek_fp8_pool(num_q_heads, max_q_len):
    check_deepseek_fp8_pool("flashinfer", num_q_heads, max_q_len)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_q_heads", [16, 128])
def test_gpu_deepseek_ragged_and_broken_sequences(num_q_heads, causal):
    """Queries of 1 to 40 tokens, every fault, NaN in every unowned page."""
    check_deepseek_broken_sequences("flashinfer", num_q_heads, [1, 4, 2, 40, 1, 4, 1, 2], causal)


@pytest.mark.gpu
def test_gpu_launch_captured_in_command_buffer(tmp_path):
    """The cooperative launch and the schedule's ops run inside one kCommandBuffer."""
    check_captured_in_command_buffer(tmp_path, "flashinfer", 128)
