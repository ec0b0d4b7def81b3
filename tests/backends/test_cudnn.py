"""backend="cudnn": cuDNN paged prefill via XLA FFI against float64, the xla backend and
``jax.nn.dot_product_attention`` with an explicit bottom-right mask.

CPU tests check the build (the handler library compiled wherever its headers are installed) and
the error paths; GPU tests (``-m gpu``) check numerics over layouts, GQA, head dims, page sizes,
chunked prefill, padding, masks and sinks, and that a jitted step captures the call into a
command buffer (XLA dump) whose replays do not run the handler's host code.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import _ffi_cudnn, backends
from jaxattn.backends import cudnn
from jaxattn.backends.base import AttentionParams, Call
from tests.xla_dump import REPO, run_with_dump, thunk_sequences, top_level_thunks
from tests.paged_inputs import (TOLERANCE, dot_product_attention_reference, make_problem, reference,
                                rel_error, same_shape_problems)

BF16, F16 = jnp.bfloat16, jnp.float16


def _headers_installed() -> bool:
    """Whether this environment has everything the build needs (then the library must exist)."""
    found = subprocess.run([sys.executable, os.path.join(REPO, "ffi", "cudnn", "find_deps.py")],
                           capture_output=True, text=True, check=True).stdout
    names = {line.split("=", 1)[0] for line in found.splitlines()}
    nvcc = shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")
    return bool(nvcc) and {"xla_ffi_include", "cudnn_include", "cudnn_frontend_include"} <= names


def _params(**kw) -> AttentionParams:
    return AttentionParams(**{"scale": 0.125, "causal": True, "sliding_window": None, "softcap": None,
                              "has_sinks": False, **kw})


def _abstract_case(dtype=BF16, kv_dtype=None, head_dim=64, page_size=16, num_tokens=32, num_q_heads=8):
    """Shapes only (no device memory): q, cache, meta for the registry's checks."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    pages = jax.ShapeDtypeStruct((9, 2, page_size, head_dim), kv_dtype)
    scale = jnp.float32(1.0) if jnp.dtype(kv_dtype) == jnp.float8_e4m3fn else None
    cache = jaxattn.KVCache(pages, pages, scale, scale, "HND")
    meta = jaxattn.AttentionMetadata(cu_q_lens=jnp.zeros(3, jnp.int32), kv_lens=jnp.zeros(2, jnp.int32),
                                     block_tables=jnp.zeros((2, 4), jnp.int32),
                                     num_decodes=jnp.zeros((), jnp.int32))
    return jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype), cache, meta


# ----------------------------------------------------------------------------------------- CPU

def test_library_is_built_where_its_headers_are():
    """The pip build compiles the handler when nvcc and the cuDNN/frontend/XLA headers exist;
    without them the package still imports and the backend says why it is unavailable."""
    if not _headers_installed():
        pytest.skip("CUDA/cuDNN/cudnn-frontend headers are not installed here")
    build = importlib.import_module("jaxattn._cudnn_build")
    assert build.BUILT, build.REASON
    lib, reason = _ffi_cudnn.import_library()
    assert lib is not None, reason
    assert set(lib.handlers()) == {"instantiate", "initialize", "execute"}
    assert set(lib.state_type()) == {"type_id", "type_info"}
    assert lib.compiled_version() >= _ffi_cudnn.MIN_CUDNN_VERSION
    assert lib.frontend_version() >= 13200     # cudnn-frontend 1.32


def test_library_validates_its_configuration():
    lib, reason = _ffi_cudnn.import_library()
    if lib is None:
        pytest.skip(reason)
    config = dict(dtype=0, batch=2, num_tokens=64, num_q_heads=8, num_kv_heads=2, head_dim=128,
                  num_pages=9, page_size=16, pages_per_seq=4, layout=1, max_q_len=32,
                  scale=np.float32(0.1), causal=True, sliding_window=0, has_sinks=False, return_lse=False)
    assert lib.check_config(config) == ""
    assert "power of 2" in lib.check_config({**config, "page_size": 24})
    assert "multiple of num_kv_heads" in lib.check_config({**config, "num_kv_heads": 3})
    assert "max_q_len" in lib.check_config({**config, "max_q_len": 65})


@pytest.mark.skipif(bool(jax.devices()[0].platform == "gpu"), reason="checks the CPU-only message")
def test_unavailable_without_gpu_says_why():
    reason = backends.unavailable_reason("cudnn")
    assert reason and ("GPU" in reason or "not built" in reason)
    q, cache, meta = (jnp.zeros((4, 2, 8), BF16), jaxattn.KVCache.create(3, 16, 2, 8, BF16),
                      jaxattn.AttentionMetadata(jnp.array([0, 4], jnp.int32), jnp.array([4], jnp.int32),
                                                jnp.array([[1]], jnp.int32), jnp.zeros((), jnp.int32)))
    with pytest.raises(ValueError, match="backend 'cudnn' cannot take this call: no NVIDIA GPU"):
        jaxattn.paged_attention(q, cache, meta, backend="cudnn")


def _takes(q, cache, meta, params, **call) -> str | None:
    return backends.takes("cudnn", Call("paged_attention", q, cache, meta, params, **call))


@pytest.mark.parametrize("case, message", [
    (dict(dtype=jnp.float32), "float32 queries are not supported; supported: .*bfloat16"),
    (dict(kv_dtype=jnp.float8_e4m3fn), "float8_e4m3fn pages are not supported"),
    (dict(head_dim=12), "head_dim=12 is not supported; supported: multiples of 8 up to 256"),
    (dict(head_dim=512), "head_dim=512 is not supported"),
    (dict(page_size=24), "page_size=24 is not supported; supported: powers of 2"),
    (dict(num_tokens=2**20, num_q_heads=64, head_dim=64), "int32 ragged offsets"),
])
def test_unsupported_configurations_raise(case, message):
    q, cache, meta = _abstract_case(**case)
    assert re.search(message, _takes(q, cache, meta, _params()))


def test_softcap_is_rejected_with_the_reason():
    q, cache, meta = _abstract_case()
    assert re.search("softcap not supported; supported options: .*sinks", _takes(q, cache, meta, _params(softcap=30.0)))


@pytest.mark.parametrize("case, message", [
    (dict(dtype=jnp.float32), "float32 queries are not supported"),
    (dict(nope_dim=100), r"max\(Dn \+ Dr, Dv\)=164 is not supported; supported: multiples of 8 up to 256"),
    (dict(v_dim=512), r"max\(Dn \+ Dr, Dv\)=512 is not supported"),
    (dict(page_size=24), "page_size=24 is not supported; supported: powers of 2"),
    (dict(num_tokens=2**17, num_q_heads=128), "int32 ragged offsets"),
])
def test_unsupported_mla_prefill_configurations_raise(case, message):
    shape = dict(dtype=BF16, nope_dim=128, v_dim=128, page_size=64, num_tokens=32, num_q_heads=16) | case
    tokens, heads, dtype = shape["num_tokens"], shape["num_q_heads"], shape["dtype"]
    cache = jaxattn.MLACache(jax.ShapeDtypeStruct((9, shape["page_size"], 512 + 64), BF16))
    call = Call("mla_prefill", jax.ShapeDtypeStruct((tokens, heads, shape["nope_dim"] + 64), dtype), cache,
                _abstract_case()[2], _params(), w_uv=jax.ShapeDtypeStruct((512, heads, shape["v_dim"]), dtype))
    assert re.search(message, backends.takes("cudnn", call))


def test_supported_configuration_passes_checks():
    for layout_case in (dict(), dict(dtype=F16, head_dim=256, page_size=64)):
        q, cache, meta = _abstract_case(**layout_case)
        assert _takes(q, cache, meta, _params(sliding_window=8)) is None


# ----------------------------------------------------------------------------------------- GPU

def _run(problem, **kw):
    return jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="cudnn", **kw))(
        problem.q, problem.cache, problem.meta)


def _check(problem, out, *, tol=None, **kw):
    """Against float64; rows of padding tokens must be exactly zero."""
    ref = reference(problem, **kw)
    n = sum(problem.q_lens)
    assert rel_error(out[:n], ref[:n]) < (tol or TOLERANCE[jnp.dtype(problem.q.dtype)])
    assert not np.asarray(out[n:].astype(jnp.float32)).any(), "padding rows are not zero"


CASES = {
    # name: (q_lens, kv_lens, Hq, Hkv, D, page, layout, dtype)
    "mha_d128_p16_hnd": ([37, 128, 5], [37, 128, 5], 8, 8, 128, 16, "HND", BF16),
    "gqa4_d64_p64_nhd": ([70, 1, 200], [70, 300, 200], 16, 4, 64, 64, "NHD", BF16),
    "gqa8_d128_p64_hnd_chunked": ([64, 33, 96], [500, 33, 1100], 32, 4, 128, 64, "HND", BF16),
    "gqa8_d64_p16_nhd_chunked": ([17, 250], [400, 260], 16, 2, 64, 16, "NHD", BF16),
    "gqa4_d128_p16_nhd_fp16": ([120, 9, 60], [300, 9, 61], 8, 2, 128, 16, "NHD", F16),
    "mha_d64_p64_hnd_fp16": ([3, 90], [700, 90], 4, 4, 64, 64, "HND", F16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_float64_and_xla_backend(name):
    q_lens, kv_lens, hq, hkv, d, page, layout, dtype = CASES[name]
    problem = make_problem(np.random.default_rng(len(name)), q_lens=q_lens, kv_lens=kv_lens, num_q_heads=hq,
                           num_kv_heads=hkv, head_dim=d, page_size=page, layout=layout, dtype=dtype,
                           pad_seqs=1, pad_tokens=5)
    out = _run(problem)
    _check(problem, out)
    xla = jaxattn.paged_attention(problem.q, problem.cache, problem.meta, backend="xla")
    assert rel_error(out, np.asarray(xla.astype(jnp.float32))) < TOLERANCE[jnp.dtype(dtype)]


@pytest.mark.gpu
def test_matches_dot_product_attention_with_bottom_right_mask():
    problem = make_problem(np.random.default_rng(7), q_lens=[48, 130], kv_lens=[300, 130], num_q_heads=16,
                           num_kv_heads=4, head_dim=128, page_size=16, layout="NHD", dtype=BF16)
    out = _run(problem)
    ref = dot_product_attention_reference(problem)
    n = sum(problem.q_lens)
    assert rel_error(out[:n], ref[:n]) < TOLERANCE[jnp.dtype(BF16)]


@pytest.mark.gpu
def test_one_compiled_step_serves_other_lengths_and_tables():
    """Lengths, offsets and page tables are device data: the same executable (and cuDNN plan)
    is right for a second batch with different values."""
    first, second = same_shape_problems()
    step = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="cudnn"))
    for problem in (first, second):
        _check(problem, step(problem.q, problem.cache, problem.meta))
    assert step._cache_size() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [dict(sliding_window=50), dict(causal=False), dict(scale=0.05),
                                dict(sliding_window=1)], ids=str)
def test_masks_and_scale(kw):
    problem = make_problem(np.random.default_rng(3), q_lens=[80, 31], kv_lens=[200, 31], num_q_heads=8,
                           num_kv_heads=2, head_dim=128, page_size=64, layout="NHD", dtype=BF16)
    _check(problem, _run(problem, **kw), **kw)


@pytest.mark.gpu
def test_sinks():
    problem = make_problem(np.random.default_rng(4), q_lens=[70, 20], kv_lens=[150, 20], num_q_heads=8,
                           num_kv_heads=2, head_dim=64, page_size=16, layout="HND", dtype=BF16)
    sinks = jnp.asarray(np.random.default_rng(5).normal(size=8) * 2, jnp.float32)
    out = jax.jit(lambda q, c, m, s: jaxattn.paged_attention(q, c, m, sinks=s, backend="cudnn"))(
        problem.q, problem.cache, problem.meta, sinks)
    _check(problem, out, sinks=np.asarray(sinks))


@pytest.mark.gpu
def test_max_q_len_bounds_queries_like_the_reference():
    """Tokens past meta.max_q_len get zeros and the rest align as in the xla backend."""
    problem = make_problem(np.random.default_rng(6), q_lens=[40, 10], kv_lens=[90, 10], num_q_heads=4,
                           num_kv_heads=4, head_dim=64, page_size=16, dtype=BF16, max_q_len=16)
    out = _run(problem)
    xla = jaxattn.paged_attention(problem.q, problem.cache, problem.meta, backend="xla")
    assert rel_error(out, np.asarray(xla.astype(jnp.float32))) < TOLERANCE[jnp.dtype(BF16)]
    assert not np.asarray(out[16:40].astype(jnp.float32)).any()


@pytest.mark.gpu
def test_log_sum_exp():
    problem = make_problem(np.random.default_rng(8), q_lens=[33, 12], kv_lens=[100, 12], num_q_heads=8,
                           num_kv_heads=2, head_dim=64, page_size=16, dtype=BF16, pad_seqs=1)
    params = _params(scale=0.125)
    out, lse = jax.jit(lambda q, c, m: cudnn.attention_with_lse(q, c, m, params))(
        problem.q, problem.cache, problem.meta)
    _check(problem, out, scale=0.125)
    q = np.asarray(problem.q.astype(jnp.float32), np.float64)
    start = 0
    for b, (ql, kl) in enumerate(zip(problem.q_lens, problem.kv_lens)):
        k = np.repeat(problem.k_dense[b], 4, axis=1)
        s = np.einsum("thd,shd->hts", q[start:start + ql], k) * 0.125
        s = np.where(np.arange(kl)[None, None] <= (np.arange(ql)[:, None] + kl - ql)[None], s, -np.inf)
        expected = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
        np.testing.assert_allclose(np.asarray(lse[b, :, :ql]), expected, atol=2e-2)
        assert np.all(np.isneginf(np.asarray(lse[b, :, ql:])))
        start += ql
    assert np.all(np.isneginf(np.asarray(lse[-1])))      # the padding sequence


@pytest.mark.gpu
@pytest.mark.parametrize("kw, message", [(dict(softcap=20.0), "softcap"), (dict(), "float32 queries are not supported")])
def test_unsupported_raise_at_trace_time(kw, message):
    dtype = BF16 if kw else jnp.float32
    problem = make_problem(np.random.default_rng(9), q_lens=[8], kv_lens=[8], num_q_heads=2, num_kv_heads=2,
                           head_dim=64, page_size=16, dtype=dtype)
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend="cudnn", **kw)).lower(
            problem.q, problem.cache, problem.meta)


_CAPTURE_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    import jaxattn
    from jaxattn import _ffi_cudnn
    from tests.paged_inputs import make_problem, reference, rel_error

    problem = make_problem(np.random.default_rng(0), q_lens=[100, 60], kv_lens=[300, 60], num_q_heads=8,
                           num_kv_heads=2, head_dim=128, page_size=64, layout="NHD", dtype=jnp.bfloat16)
    # As a serving step does: the result lands in a donated buffer that is fed back, so every
    # buffer address repeats and XLA can replay the recorded graph without re-recording it.
    step = jax.jit(lambda q, c, m, acc: jaxattn.paged_attention(q, c, m, backend="cudnn") * 2,
                   donate_argnums=3)
    lib = _ffi_cudnn.library()
    acc = step(problem.q, problem.cache, problem.meta, jnp.zeros_like(problem.q))
    outs = [np.asarray(acc.astype(jnp.float32))]
    after_first = lib.execute_count()
    for _ in range(5):
        acc = step(problem.q, problem.cache, problem.meta, acc)
        outs.append(np.asarray(acc.astype(jnp.float32)))
    after_six = lib.execute_count()
    ref = reference(problem) * 2
    n = sum(problem.q_lens)
    errors = [rel_error(o[:n], ref[:n]) for o in outs]
    print(json.dumps(dict(after_first=after_first, after_six=after_six, errors=errors)))
""")


@pytest.mark.gpu
def test_captured_in_command_buffer_and_replayed(tmp_path):
    """A jitted step puts the custom call inside a kCommandBuffer thunk, and replays of the
    recorded graph do not run the execute handler's host code."""
    run = run_with_dump(_CAPTURE_SCRIPT, tmp_path, timeout=300)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert max(result["errors"]) < TOLERANCE[jnp.dtype(BF16)], result["errors"]
    for name, thunks in thunk_sequences(tmp_path, "jit__lambda").items():
        top = top_level_thunks(thunks)
        assert "kCommandBuffer" in top and "kCustomCall" not in top, (name, thunks[-3000:])
    # Replays of the recorded graph run no host code, so six calls run it fewer than six times.
    # XLA re-records when an address in the graph changes (a fresh buffer), so it may be above 1;
    # in the benchmark's steady state it ran 0 times in 70 calls (benchmarks/RESULTS.md).
    assert result["after_six"] < 6, result
