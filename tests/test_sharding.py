"""jaxattn.sharding: paged attention and KV writes sharded by heads under a plain ``jax.jit``.

CPU tests run their checks in a subprocess with ``--xla_force_host_platform_device_count`` (the
flag must be set before JAX initialises its CPU backend, so it cannot be set for this process):
sharded vs unsharded results, output shardings, compiled HLO without collectives, and the
errors for unsupported shardings. GPU tests (``-m gpu``, 2+ GPUs: ``multigpu``) compare each fast
backend sharded over 2 GPUs with the same call on one GPU.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxattn
from jaxattn.kv_cache import pool_sharding
from jaxattn.sharding import replicate_kv_heads, shard_by_heads
from tests.paged_inputs import ALLCLOSE, TOLERANCE, make_problem, rel_error
from tests.xla_dump import REPO

# Sharded vs unsharded float32 results: the same sums, in an order that depends on the shard's
# shapes and the CPU's vector width, so equal within float32 reordering (not bit for bit).
F32_ORDER = ALLCLOSE[jnp.dtype(jnp.float32)]
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def run_on_cpu_devices(num_devices: int, code: str) -> str:
    """Runs ``code`` in a fresh Python on ``num_devices`` CPU devices; returns its stdout and
    fails the test with its output when it fails."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={num_devices}")
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def collectives(compiled_hlo: str) -> list[str]:
    """The HLO lines of ``compiled_hlo`` that communicate between devices."""
    return [line.strip() for line in compiled_hlo.splitlines() if any(op in line for op in COLLECTIVES)]


def head_sharded(mesh, problem, sinks):
    """``problem``'s q, cache and sinks placed sharded by heads over mesh axis "tp"."""
    heads = NamedSharding(mesh, P(None, "tp", None))
    pools = pool_sharding(mesh, "tp", problem.cache.layout)
    cache = jaxattn.KVCache(jax.device_put(problem.cache.k_pages, pools), jax.device_put(problem.cache.v_pages, pools),
                            problem.cache.k_scale, problem.cache.v_scale, problem.cache.layout)
    return jax.device_put(problem.q, heads), cache, jax.device_put(sinks, NamedSharding(mesh, P("tp")))


# ----------------------------------------------------------------------------- checks (subprocess)

def check_sharded_matches_unsharded() -> None:
    """xla and auto (xla on CPU), HND and NHD, GQA, sinks, a mixed batch and a decode-only step,
    Auto and Explicit mesh axes: equal to the unsharded call, sharded like q, no collectives."""
    num_devices = jax.device_count()
    cases = [dict(q_lens=[1, 1, 5, 3], kv_lens=[7, 20, 9, 30], max_q_len=None),
             dict(q_lens=[1, 1, 1], kv_lens=[3, 17, 40], max_q_len=1)]
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((num_devices,), ("tp",), axis_types=(axis_type,))
        for layout in ("HND", "NHD"):
            for backend in ("xla", "auto"):
                for case in cases:
                    where = f"{axis_type}, {layout}, {backend}, {case}"
                    problem = make_problem(np.random.default_rng(0), num_q_heads=2 * num_devices,
                                           num_kv_heads=num_devices, head_dim=16, page_size=4, layout=layout,
                                           **case)
                    sinks = jnp.linspace(-1.0, 1.0, 2 * num_devices, dtype=jnp.float32)

                    def attend(q, cache, meta, sinks):
                        return jaxattn.paged_attention(q, cache, meta, sinks=sinks, backend=backend)

                    expected = jax.jit(attend)(problem.q, problem.cache, problem.meta, sinks)
                    q, cache, sinks_sharded = head_sharded(mesh, problem, sinks)
                    step = jax.jit(attend)
                    out = step(q, cache, problem.meta, sinks_sharded)
                    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), **F32_ORDER,
                                               err_msg=where)
                    assert out.sharding.is_equivalent_to(q.sharding, 3), (where, out.sharding)
                    hlo = step.lower(q, cache, problem.meta, sinks_sharded).compile().as_text()
                    assert not collectives(hlo), (where, collectives(hlo))


def check_replicated_kv_heads() -> None:
    """More shards than KV heads: a cache of replicated KV heads (replicate_kv_heads) sharded over
    all devices gives the unsharded result of the original cache."""
    num_devices = jax.device_count()
    mesh = jax.make_mesh((num_devices,), ("tp",), axis_types=(AxisType.Auto,))
    problem = make_problem(np.random.default_rng(1), q_lens=[1, 4], kv_lens=[9, 12], num_q_heads=2 * num_devices,
                           num_kv_heads=1, head_dim=16, page_size=4, layout="NHD")
    expected = jaxattn.paged_attention(problem.q, problem.cache, problem.meta)
    pages = []
    for pool in (problem.cache.k_pages, problem.cache.v_pages):               # [N, page, 1, D]
        tokens = replicate_kv_heads(pool.reshape(-1, 1, pool.shape[3]), num_devices)
        pages.append(tokens.reshape(*pool.shape[:2], num_devices, pool.shape[3]))
    problem.cache = jaxattn.KVCache(*pages, layout="NHD")
    q, cache, _ = head_sharded(mesh, problem, jnp.zeros(2 * num_devices))
    out = jax.jit(jaxattn.paged_attention)(q, cache, problem.meta)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), **F32_ORDER)


def check_backend_constants() -> None:
    """A backend that builds arrays from NumPy (constants of its trace, as trtllm's scales are)
    runs per shard too: shard_by_heads passes them to the partitioned call as operands."""
    num_devices = jax.device_count()
    mesh = jax.make_mesh((num_devices,), ("tp",), axis_types=(AxisType.Auto,))
    problem = make_problem(np.random.default_rng(2), q_lens=[1, 6], kv_lens=[20, 11], num_q_heads=2 * num_devices,
                           num_kv_heads=num_devices, head_dim=16, page_size=4)

    def attend(q, cache, meta, sinks):
        out = jaxattn.paged_attention(q, cache, meta, sinks=sinks, backend="xla")
        return out * jnp.asarray(np.full(q.shape[1:], 2.0, np.float32))

    sinks = jnp.linspace(-1.0, 1.0, 2 * num_devices, dtype=jnp.float32)
    expected = attend(problem.q, problem.cache, problem.meta, sinks)
    q, cache, sinks_sharded = head_sharded(mesh, problem, sinks)
    out = jax.jit(functools.partial(shard_by_heads, attend))(q, cache, problem.meta, sinks_sharded)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), **F32_ORDER)


def check_sharded_cache_writes_in_place() -> None:
    """KVCache.create(sharding=...) places the pools by KV heads (FP8 scales replicated); a
    donated jitted write of head-sharded tokens keeps that sharding, reuses the buffers and
    gathers nothing; the pages equal an unsharded write."""
    num_devices = jax.device_count()
    mesh = jax.make_mesh((num_devices,), ("tp",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(3)
    for layout in ("HND", "NHD"):
        for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
            where = f"{layout}, {jnp.dtype(dtype).name}"
            pools = pool_sharding(mesh, "tp", layout)
            cache = jaxattn.KVCache.create(6, 4, num_devices, 8, dtype=dtype, layout=layout, sharding=pools)
            assert cache.k_pages.sharding == cache.v_pages.sharding == pools, where
            if cache.k_scale is not None:
                assert cache.k_scale.sharding.is_fully_replicated, where
            k, v = (jnp.asarray(rng.normal(size=(7, num_devices, 8)), jnp.bfloat16) for _ in range(2))
            slots = jnp.asarray([5, -1, 0, 23, 9, 30, 12], jnp.int32)
            expected = jaxattn.KVCache.create(6, 4, num_devices, 8, dtype=dtype, layout=layout).write(k, v, slots)
            tokens = NamedSharding(mesh, P(None, "tp", None))
            write = jax.jit(jaxattn.KVCache.write, donate_argnums=0)
            hlo = write.lower(cache, jax.device_put(k, tokens), jax.device_put(v, tokens), slots).compile().as_text()
            assert not collectives(hlo), (where, collectives(hlo))
            k_buffers = {shard.data.unsafe_buffer_pointer() for shard in cache.k_pages.addressable_shards}
            written = write(cache, jax.device_put(k, tokens), jax.device_put(v, tokens), slots)
            assert cache.k_pages.is_deleted(), where
            assert written.k_pages.sharding == written.v_pages.sharding == pools, (where, written.k_pages.sharding)
            assert {shard.data.unsafe_buffer_pointer() for shard in written.k_pages.addressable_shards} == k_buffers
            for name in ("k_pages", "v_pages"):
                np.testing.assert_array_equal(np.asarray(getattr(written, name).astype(jnp.float32)),
                                              np.asarray(getattr(expected, name).astype(jnp.float32)), err_msg=where)


def check_serving_step_has_no_collectives() -> None:
    """README's sharded step (page allocation, KV writes, attention in one donated jit) on Auto
    and Explicit mesh axes: output sharded like q, the pools stay sharded, no collectives, and
    the same output as the unsharded step."""
    num_devices = jax.device_count()

    def step(q, cache, table, k, v, seq_ids, q_lens):
        table, ok = table.extend(seq_ids, table.seq_lens[jnp.maximum(seq_ids, 0)] + q_lens)
        seq_ids = jnp.where(ok, seq_ids, -1)
        cache = cache.write(k, v, table.slot_mapping(seq_ids, q_lens, q.shape[0]))
        return jaxattn.paged_attention(q, cache, table.metadata(seq_ids, q_lens)), cache, table

    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.normal(size=(8, heads, 16)), jnp.float32)
               for heads in (2 * num_devices, num_devices, num_devices))
    seq_ids, q_lens = jnp.asarray([0, 1, -1], jnp.int32), jnp.asarray([1, 5, 0], jnp.int32)

    def fresh(sharding=None):
        return (jaxattn.KVCache.create(16, 4, num_devices, 16, dtype=jnp.float32, sharding=sharding),
                jaxattn.PageTable.create(num_pages=16, max_seqs=3, max_pages_per_seq=4, page_size=4))

    expected, _, _ = jax.jit(step)(q, *fresh(), k, v, seq_ids, q_lens)
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = jax.make_mesh((num_devices,), ("tp",), axis_types=(axis_type,))
        pools = pool_sharding(mesh, "tp")
        heads = NamedSharding(mesh, P(None, "tp", None))
        sharded_step = jax.jit(step, donate_argnums=(1, 2))
        args = (jax.device_put(q, heads), *fresh(pools), jax.device_put(k, heads), jax.device_put(v, heads),
                seq_ids, q_lens)
        hlo = sharded_step.lower(*args).compile().as_text()
        assert not collectives(hlo), (axis_type, collectives(hlo))
        out, cache, _ = sharded_step(*args)
        assert out.sharding.is_equivalent_to(heads, 3) and cache.k_pages.sharding.is_equivalent_to(pools, 4)
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), **F32_ORDER, err_msg=str(axis_type))


def check_unsupported_shardings_raise() -> None:
    """Each unsupported sharding raises ValueError naming the argument and the supported
    shardings: at trace time with Explicit mesh axes, when XLA partitions with Auto ones."""
    num_devices = jax.device_count()
    problem = make_problem(np.random.default_rng(4), q_lens=[1, 3], kv_lens=[5, 8], num_q_heads=2 * num_devices,
                           num_kv_heads=num_devices, head_dim=16, page_size=4, pad_tokens=4)
    few_kv_heads = make_problem(np.random.default_rng(4), q_lens=[1, 3], kv_lens=[5, 8], num_q_heads=2 * num_devices,
                                num_kv_heads=num_devices // 2, head_dim=16, page_size=4, pad_tokens=4)
    supported = "supported: q P(None, axes, None), HND pages P(None, axes, None, None)"
    cases = [  # (problem, q spec, pool spec, message)
        (problem, P(None, None, "tp"), P(None, "tp"), "q may be sharded only on its head axis"),
        (problem, P("tp"), P(None, "tp"), "q may be sharded only on its head axis"),
        (problem, P(None, "tp"), P("tp"), "the cache's HND pages must be sharded like q's heads"),
        (problem, P(None, "tp"), P(None, None, None, "tp"), "the cache's HND pages must be sharded like q's heads"),
        (problem, P(), P(None, "tp"), "the cache's HND pages must be sharded like q's heads"),
        (few_kv_heads, P(None, "tp"), P(), "replicate_kv_heads"),
    ]
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((num_devices,), ("tp",), axis_types=(axis_type,))
        for case, q_spec, pool_spec, message in cases:
            pools = NamedSharding(mesh, pool_spec)
            cache = jaxattn.KVCache(jax.device_put(case.cache.k_pages, pools),
                                    jax.device_put(case.cache.v_pages, pools))
            q = jax.device_put(case.q, NamedSharding(mesh, q_spec))
            where = f"q {q_spec}, pages {pool_spec}, {axis_type}"
            try:
                jax.jit(jaxattn.paged_attention).lower(q, cache, case.meta).compile()
            except ValueError as err:            # Explicit axes: the shardings are in the types
                assert axis_type == AxisType.Explicit, (where, err)
                error = str(err)
            except jax.errors.JaxRuntimeError as err:   # Auto axes: XLA's partitioner met the ValueError
                assert axis_type == AxisType.Auto and "ValueError: " in str(err), (where, err)
                error = str(err)
            else:
                raise AssertionError(f"no error for {where}")
            assert message in error and (supported in error or "num_kv_heads" in error), (where, error)
        try:
            jaxattn.KVCache.create(6, 4, num_devices // 2, 8, sharding=pool_sharding(mesh, "tp"))
        except ValueError as err:
            assert "num_kv_heads" in str(err), err
        else:
            raise AssertionError("KVCache.create took more shards than KV heads")
    # Fewer query heads than shards: XLA may pad the head axis, the partitioner names the problem.
    mesh = jax.make_mesh((num_devices,), ("tp",), axis_types=(AxisType.Auto,))
    heads = num_devices // 2
    few_q_heads = make_problem(np.random.default_rng(4), q_lens=[1, 3], kv_lens=[5, 8], num_q_heads=heads,
                               num_kv_heads=heads, head_dim=16, page_size=4)

    def constrained(q, cache, meta):
        return jaxattn.paged_attention(jax.lax.with_sharding_constraint(q, NamedSharding(mesh, P(None, "tp"))),
                                       cache, meta)

    try:
        jax.jit(constrained).lower(few_q_heads.q, few_q_heads.cache, few_q_heads.meta).compile()
    except jax.errors.JaxRuntimeError as err:
        assert f"ValueError: paged_attention under sharding: q's {heads} heads cannot be split into " \
               f"{num_devices} head shards" in str(err), err
    else:
        raise AssertionError("q heads split over more shards than heads")


# --------------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("num_devices", [2, 4])
@pytest.mark.parametrize("check", ["check_sharded_matches_unsharded", "check_replicated_kv_heads", "check_backend_constants",
                                   "check_sharded_cache_writes_in_place", "check_serving_step_has_no_collectives",
                                   "check_unsupported_shardings_raise"])
def test_on_cpu_devices(check, num_devices):
    run_on_cpu_devices(num_devices, f"from tests.test_sharding import {check}; {check}()")


def test_replicate_kv_heads():
    kv = jnp.arange(2 * 2 * 3).reshape(2, 2, 3)
    assert replicate_kv_heads(kv, 2) is kv
    np.testing.assert_array_equal(replicate_kv_heads(kv, 4), jnp.repeat(kv, 2, axis=1))
    with pytest.raises(ValueError, match="num_shards \\(3\\) must be a multiple of the number of KV heads \\(2\\)"):
        replicate_kv_heads(kv, 3)


# --------------------------------------------------------------------------------------------- GPU

def _gpu_problem(backend: str, layout: str):
    """A bf16 problem each fast backend takes: decodes for trtllm, a mixed batch otherwise."""
    rng = np.random.default_rng(5)
    if backend == "trtllm":
        q_lens, kv_lens, max_q_len = [1] * 12, [int(n) for n in rng.integers(1, 900, 12)], 1
    else:
        q_lens, kv_lens, max_q_len = [1] * 4 + [70, 33], [300, 41, 900, 5, 170, 400], None
    return make_problem(rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=16, num_kv_heads=4, head_dim=128,
                        page_size=32, layout=layout, dtype=jnp.bfloat16, max_q_len=max_q_len)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("backend", ["cudnn", "trtllm", "triton", "auto"])
def test_gpu_backend_sharded_over_two_gpus(backend, layout):
    problem = _gpu_problem(backend, layout)
    sinks = jnp.linspace(-1.0, 1.0, 16, dtype=jnp.float32) if backend != "cudnn" else None

    def attend(q, cache, meta, sinks):
        return jaxattn.paged_attention(q, cache, meta, sinks=sinks, backend=backend)

    one_gpu = jax.jit(attend)(problem.q, problem.cache, problem.meta, sinks)
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices("gpu")[:2])
    q, cache, sinks_sharded = head_sharded(mesh, problem, jnp.zeros(16) if sinks is None else sinks)
    step = jax.jit(attend)
    out = step(q, cache, problem.meta, None if sinks is None else sinks_sharded)
    assert rel_error(out, np.asarray(one_gpu.astype(jnp.float32))) < TOLERANCE[jnp.dtype(jnp.bfloat16)]
    assert out.sharding.is_equivalent_to(q.sharding, 3)
    hlo = step.lower(q, cache, problem.meta, None if sinks is None else sinks_sharded).compile().as_text()
    assert not collectives(hlo)
