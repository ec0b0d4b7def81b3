"""The triton backend's MLA kernels (``mla_attention``) against the float64 absorbed reference and
the xla backend.

Without a GPU the kernels run under Triton's interpreter on small shapes (R 32, Dr 16); the GPU
tests take DeepSeek's shapes (R 512, Dr 64, page 64) in bfloat16.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import logging
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import backends, dispatch
from jaxattn.backends import xla
from jaxattn.backends.base import AttentionParams, Call, gpu_devices
from tests.mla_inputs import (break_metadata, check_captured_in_command_buffer, check_deepseek_broken_sequences,
                               check_deepseek_decode, check_deepseek_fp8_pool, check_deepseek_prefill,
                               check_deepseek_prefill_broken_sequences, make_mla_problem)
from tests.paged_inputs import TOLERANCE, rel_error
from tests.xla_dump import REPO

triton = pytest.importorskip("triton", reason="the triton backend's tests need the triton package")
from jaxattn.backends import triton as tb  # noqa: E402

SMALL = dict(kv_lora_rank=32, rope_dim=16, nope_dim=16, v_dim=16, page_size=8)


def _params(problem, causal=True) -> AttentionParams:
    return AttentionParams(scale=problem.scale, causal=causal, sliding_window=None, softcap=None, has_sinks=False)


def _run(problem, config=None, causal=True):
    params = _params(problem, causal)
    fn = jax.jit(lambda ql, qr, c, m: tb.mla_attention(ql, qr, c, m, params, config=config))
    return fn(problem.q_latent, problem.q_rope, problem.cache, problem.meta)


def _xla(problem, causal=True):
    return xla.mla_attention(problem.q_latent, problem.q_rope, problem.cache, problem.meta, _params(problem, causal))


@pytest.fixture
def triton_runs_here(monkeypatch):
    """On CPU the triton kernels run under Triton's interpreter (tests only)."""
    real = backends.unavailable_reason
    monkeypatch.setattr(backends, "unavailable_reason", lambda name: None if name == "triton" else real(name))


# --- kernel numerics (interpreter on CPU, the GPU kernels on a GPU) ------------------------------

@pytest.mark.parametrize("segments", [1, 2])
def test_decode_split_kv(segments):
    """Decodes, 20 heads over two head blocks of 16, one segment (direct) or two plus the reduction."""
    problem = make_mla_problem(np.random.default_rng(0), q_lens=[1, 1, 1], kv_lens=[3, 40, 17], num_q_heads=20,
                               max_q_len=1, **SMALL)
    config = tb.MLAConfig(tokens=1, block_h=16, block_n=16, num_segments=segments, num_warps=4, num_stages=1)
    out = _run(problem, config)
    assert rel_error(out, problem.absorbed_reference(problem.q_latent)) < 1e-5
    assert rel_error(out, _xla(problem)) < 1e-5
    assert not np.asarray(out[3:]).any(), "padding tokens are zeros"


@pytest.mark.parametrize("tokens, segments, causal", [(1, 2, True), (4, 2, True), (4, 1, False), (2, 2, False)])
def test_any_query_length(tokens, segments, causal):
    """Speculative decode and chunked prefill queries, bottom-right causal: one program per token,
    or per group of up to ``tokens`` tokens of a sequence (a group's rows see different keys)."""
    problem = make_mla_problem(np.random.default_rng(1), q_lens=[1, 4, 3, 0, 6], kv_lens=[9, 30, 3, 5, 20],
                               num_q_heads=4, **SMALL)
    config = tb.MLAConfig(tokens=tokens, block_h=16 // tokens, block_n=16, num_segments=segments, num_warps=4,
                          num_stages=1)
    out = _run(problem, config, causal=causal)
    assert rel_error(out, problem.absorbed_reference(problem.q_latent, causal=causal)) < 1e-5
    assert not np.asarray(out[sum(problem.q_lens):]).any(), "padding tokens are zeros"


def test_bfloat16():
    problem = make_mla_problem(np.random.default_rng(2), q_lens=[1, 1, 2], kv_lens=[20, 33, 7], num_q_heads=4,
                               dtype=jnp.bfloat16, **SMALL)
    out = _run(problem)
    assert out.dtype == jnp.bfloat16
    assert rel_error(out, problem.absorbed_reference(problem.q_latent)) < TOLERANCE[jnp.dtype(jnp.bfloat16)]


@pytest.mark.parametrize("segments, f16_dots", [(1, False), (2, False), (1, True), (2, True)])
def test_fp8_pool(segments, f16_dots):
    """bf16 queries over FP8 latents (scale 0.5), the dots in bf16 or (``f16_dots``) in f16 with
    the queries pre-scaled."""
    problem = make_mla_problem(np.random.default_rng(7), q_lens=[1, 1, 3], kv_lens=[20, 33, 7], num_q_heads=4,
                               dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn, **SMALL)
    config = tb.MLAConfig(tokens=1, block_h=16, block_n=16, num_segments=segments, num_warps=4, num_stages=1,
                          f16_dots=f16_dots)
    out = _run(problem, config)
    assert rel_error(out, problem.absorbed_reference(problem.q_latent)) < TOLERANCE[jnp.dtype(jnp.bfloat16)]
    assert rel_error(out, _xla(problem)) < TOLERANCE[jnp.dtype(jnp.bfloat16)]


@pytest.mark.parametrize("max_q_len", [1, 2])
def test_broken_sequences_are_zero_and_flagged(triton_runs_here, max_q_len):
    """Bad page ids, kv_lens too short and too long, and (max_q_len 2) a query past max_q_len;
    every page no sequence owns, page 0 included, holds NaN."""
    rng = np.random.default_rng(3)
    q_lens = [1, 1, 1, 1, 1] if max_q_len == 1 else [1, 2, 3, 1, 2]
    problem = make_mla_problem(rng, q_lens=q_lens, kv_lens=[9, 20, 17, 4, 30], num_q_heads=4, max_q_len=max_q_len,
                               **SMALL)
    meta, broken = break_metadata(rng, problem, ["page", "none", "short", "long", "none"])
    run = jax.jit(lambda ql, qr, c, m: jaxattn.mla_paged_attention(ql, qr, c, m, scale=problem.scale,
                                                                   backend="triton", return_status=True))
    out, valid = run(problem.q_latent, problem.q_rope, problem.cache, meta)
    np.testing.assert_array_equal(valid, ~broken)
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), "a page the sequence does not own reached its output"
    np.testing.assert_allclose(out, problem.without(broken).absorbed_reference(problem.q_latent), rtol=2e-4,
                               atol=2e-4)


# --- mla_prefill: the paged kernels over the expanded latents --------------------------------------

PREFILL_BATCH = dict(q_lens=[1, 1, 6, 13, 2], kv_lens=[5, 33, 6, 40, 2], max_q_len=None)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_dtype", [None, jnp.float8_e4m3fn], ids=["f32", "fp8"])
def test_prefill_over_the_expanded_latents(triton_runs_here, causal, kv_dtype):
    """Decodes, chunked prefills over cached context and padding (keys 32 wide, values 16: V
    zero-padded in the pool) against the float64 expanded reference and the xla backend; padding
    rows are zero."""
    problem = make_mla_problem(np.random.default_rng(), num_q_heads=4, kv_dtype=kv_dtype, **SMALL, **PREFILL_BATCH)
    rest = (problem.cache, problem.meta, problem.w_uk, problem.w_uv)
    run = {name: jax.jit(lambda *a, name=name: jaxattn.mla_prefill(*a, scale=problem.scale, causal=causal,
                                                                   backend=name))
           for name in ("triton", "xla")}
    out = run["triton"](problem.q, None, *rest)
    assert out.shape == (problem.q.shape[0], 4, 16)
    assert rel_error(out, problem.expanded_reference(causal)) < 1e-5
    assert rel_error(out, run["xla"](problem.q, None, *rest)) < 1e-5
    assert not np.asarray(out[sum(problem.q_lens):]).any(), "padding tokens are zeros"


def test_prefill_flags_broken_sequences(triton_runs_here):
    """Bad page ids, kv_lens too short and too long: zero rows and a False flag; the others exact."""
    rng = np.random.default_rng()
    problem = make_mla_problem(rng, num_q_heads=4, **SMALL, **PREFILL_BATCH)
    meta, broken = break_metadata(rng, problem, ["none", "page", "short", "long", "none"])
    out, valid = jax.jit(lambda *a: jaxattn.mla_prefill(*a, scale=problem.scale, backend="triton",
                                                        return_status=True))(
        problem.q, None, problem.cache, meta, problem.w_uk, problem.w_uv)
    np.testing.assert_array_equal(valid, ~broken)
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), "a page the sequence does not own reached its output"
    np.testing.assert_allclose(out, problem.without(broken).expanded_reference(), rtol=2e-5, atol=2e-5)


def test_prefill_ranks_after_cudnn_and_fa4_and_before_xla():
    """auto without a measured entry: cudnn, then fa4, then triton, then xla; a pool wider than
    the kernels' 256 columns is refused by name."""
    problem = make_mla_problem(np.random.default_rng(9), num_q_heads=4, **SMALL, **PREFILL_BATCH)
    call = Call("mla_prefill", problem.q, problem.cache, problem.meta, _params(problem), w_uv=problem.w_uv)
    assert dispatch.rank_order(call) == ["cudnn", "fa4", "triton", "xla"]
    wide = dataclasses.replace(call, q=jax.ShapeDtypeStruct((32, 4, 264), jnp.float32))
    assert backends.takes("triton", wide) == "max(Dn + Dr, Dv) must be in 16..256, got 264"


def test_check_supported():
    problem = make_mla_problem(np.random.default_rng(4), q_lens=[1], kv_lens=[4], num_q_heads=4,
                               **dict(SMALL, kv_lora_rank=24))
    call = Call("mla_paged_attention", problem.q_latent, problem.cache, problem.meta, _params(problem),
                q_rope=problem.q_rope)
    assert backends.takes("triton", call) == "the cache's kv_lora_rank must be a power of 2 >= 16, got 24"


def _record_backend_calls(monkeypatch) -> list[str]:
    calls = []
    for name in ("xla", "triton"):
        backend = backends.REGISTRY[name]
        support = backend.ops["mla_paged_attention"]
        recorded = dataclasses.replace(support, run=lambda *a, _n=name, _r=support.run: calls.append(_n) or _r(*a))
        monkeypatch.setitem(backends.REGISTRY, name,
                            dataclasses.replace(backend, ops={**backend.ops, "mla_paged_attention": recorded}))
    return calls


def test_auto_uses_triton_where_it_runs_else_xla_with_a_log_line(monkeypatch, caplog):
    calls = _record_backend_calls(monkeypatch)
    # 4 tokens (2 of them padding) x a 1024-page table of 8 keys: past MLA_XLA_MAX_DECODE_KEYS.
    problem = make_mla_problem(np.random.default_rng(5), q_lens=[1, 1], kv_lens=[4, 9], num_q_heads=4, max_q_len=1,
                               pages_per_seq=1024, **SMALL)
    monkeypatch.setattr(dispatch, "_logged", set())
    caplog.set_level(logging.INFO, logger="jaxattn")
    jax.jit(lambda *a: jaxattn.mla_paged_attention(*a, scale=problem.scale))(
        problem.q_latent, problem.q_rope, problem.cache, problem.meta)
    reason = backends.unavailable_reason("triton")
    assert calls == ["xla" if reason else "triton"]
    warned = f"using 'xla'; triton skipped ({reason})" in caplog.text
    informed = "running the xla backend: no NVIDIA GPU" in caplog.text   # CPU: nothing to fix, one INFO line
    assert (warned, informed) == ((bool(reason), False) if gpu_devices() else (False, True))


def test_auto_runs_tiny_decode_steps_on_xla(monkeypatch):
    """T times the table's width in keys at most MLA_XLA_MAX_DECODE_KEYS: xla, wherever triton runs."""
    calls = _record_backend_calls(monkeypatch)
    problem = make_mla_problem(np.random.default_rng(5), q_lens=[1, 1], kv_lens=[4, 9], num_q_heads=4, max_q_len=1,
                               **SMALL)
    assert problem.q_latent.shape[0] * problem.meta.max_pages_per_seq * 8 <= tb.MLA_XLA_MAX_DECODE_KEYS
    jax.jit(lambda *a: jaxattn.mla_paged_attention(*a, scale=problem.scale))(
        problem.q_latent, problem.q_rope, problem.cache, problem.meta)
    assert calls == ["xla"]


_COMPILE_SCRIPT = textwrap.dedent("""
    import json, subprocess, sys, tempfile
    import jax, jax.numpy as jnp, numpy as np
    from jaxattn.backends import triton as tb
    from jaxattn.backends.base import AttentionParams
    from tests.mla_inputs import make_mla_problem
    from tests.triton_compile import compiled_kernels

    num_q_heads, max_q_len, kv_dtype, num_seqs, cuobjdump = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                                             int(sys.argv[4]), sys.argv[5])
    tb._interpreting = lambda: False                       # the launches a GPU would get
    problem = make_mla_problem(np.random.default_rng(6), q_lens=[max_q_len] * num_seqs,
                               kv_lens=[3000] * num_seqs, num_q_heads=num_q_heads, max_q_len=max_q_len,
                               dtype=jnp.bfloat16, kv_dtype=kv_dtype, kv_lora_rank=512, rope_dim=64, nope_dim=128,
                               v_dim=128, page_size=64)
    params = AttentionParams(scale=problem.scale, causal=True, sliding_window=None, softcap=None, has_sinks=False)
    usage = {}
    for name, compiled in compiled_kernels(lambda ql, qr, c, m: tb.mla_attention(ql, qr, c, m, params),
                                           problem.q_latent, problem.q_rope, problem.cache, problem.meta).items():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage[name] = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                         check=True).stdout
    print(json.dumps(usage))
""")


@pytest.mark.parametrize("num_q_heads, max_q_len, kv_dtype, num_seqs, spills", [
    (16, 1, "bfloat16", 8, False), (16, 4, "bfloat16", 8, False), (128, 1, "bfloat16", 8, False),
    (128, 1, "bfloat16", 1, False), (16, 1, "float8_e4m3fn", 8, False), (16, 1, "float8_e4m3fn", 256, False),
    (16, 4, "float8_e4m3fn", 8, False), (128, 1, "float8_e4m3fn", 8, True)])
def test_gpu_configs_compile_for_sm90_without_spills(num_q_heads, max_q_len, kv_dtype, num_seqs, spills):
    """No GPU needed: the launches ``mla_attention`` makes on a GPU at DeepSeek shapes (decode, and
    speculative decode packing 4 tokens x 16 heads; one sequence of 128 heads; bf16 and FP8 pools;
    the reduce kernel where they split the keys) compile for sm_90 with Triton's own ptxas, without
    register spills (``cuobjdump`` resource usage) but where ``mla_config`` takes a spilling tile
    that measured fastest (FP8's 64-head tiles: a small stack). In a fresh process: the interpreter
    the other tests run leaves Triton's language module patched."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip(f"no {cuobjdump}")
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, str(num_q_heads), str(max_q_len), kv_dtype,
                          str(num_seqs), cuobjdump],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    usage = json.loads(run.stdout.strip().splitlines()[-1])
    assert "mla_decode_kernel" in usage and set(usage) <= {"mla_decode_kernel", "mla_reduce_kernel"}, usage
    for name, text in usage.items():
        stack = int(text.split("STACK:")[1].split()[0])
        assert stack <= (512 if spills and name == "mla_decode_kernel" else 0), (name, text)


# --- GPU: DeepSeek shapes in bfloat16 ------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kv_len", [1024, 4096, 16384])
@pytest.mark.parametrize("num_q_heads", [16, 128])
def test_gpu_deepseek_decode(num_q_heads, kv_len):
    check_deepseek_decode("triton", num_q_heads, kv_len)


@pytest.mark.gpu
@pytest.mark.parametrize("max_q_len", [1, 4])
@pytest.mark.parametrize("num_q_heads", [16, 128])
def test_gpu_deepseek_fp8_pool(num_q_heads, max_q_len):
    check_deepseek_fp8_pool("triton", num_q_heads, max_q_len)


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads", [16, 128])
def test_gpu_deepseek_spec_decode_and_broken_sequences(num_q_heads):
    """Queries of up to 4 tokens, every fault, NaN in every unowned page."""
    check_deepseek_broken_sequences("triton", num_q_heads, [1, 4, 2, 3, 1, 4, 1, 2])


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads", [16, 128])
def test_gpu_deepseek_prefill(num_q_heads):
    check_deepseek_prefill("triton", num_q_heads)


@pytest.mark.gpu
def test_gpu_deepseek_prefill_over_fp8_latents_and_broken_sequences():
    check_deepseek_prefill("triton", 16, kv_dtype=jnp.float8_e4m3fn)
    check_deepseek_prefill_broken_sequences("triton")


@pytest.mark.gpu
def test_gpu_launches_captured_in_command_buffer(tmp_path):
    """The MLA kernel and its reduction run inside one kCommandBuffer (16 heads over 8 x 3000 keys
    split the keys into segments, so both launch)."""
    setup = ("from jaxattn.backends import triton as tb\n"
             "assert tb.mla_config(8, 16, 512, problem.meta.max_pages_per_seq * 64, 1).num_segments > 1")
    check_captured_in_command_buffer(tmp_path, "triton", 16, setup, min_custom_calls=2)
