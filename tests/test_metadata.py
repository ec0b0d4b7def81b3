"""Bad metadata is data: ``AttentionMetadata.sanitize`` flags each sequence that breaks the
contract, and ``paged_attention`` gives its rows zeros on every backend while the other
sequences' rows equal the reference, whatever the pages they do not own hold."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxattn
from jaxattn import backends
from tests.paged_inputs import Problem, reference, rel_error

@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int = 4
    tokens: int = 20
    pages_per_seq: int = 4
    page: int = 4
    num_kv_heads: int = 2
    num_q_heads: int = 4
    head_dim: int = 16
    dtype: str = "float32"

    @property
    def num_pages(self) -> int:
        return 1 + self.batch * self.pages_per_seq + 3

    @property
    def bad_page_ids(self) -> tuple[int, ...]:
        return (-1, 0, self.num_pages, 2**30)


CPU = Shape()
FAULTS = ("none", "page", "short", "long")


def _meta(cu, kv_lens, tables, max_q_len=None) -> jaxattn.AttentionMetadata:
    return jaxattn.AttentionMetadata(jnp.asarray(cu, jnp.int32), jnp.asarray(kv_lens, jnp.int32),
                                     jnp.asarray(tables, jnp.int32), jnp.asarray(0, jnp.int32), max_q_len=max_q_len)


def test_offsets_out_of_order_or_past_the_tokens_are_flagged():
    tables = np.arange(1, 1 + 4 * 2).reshape(4, 2)
    meta = _meta([0, 5, 3, 8, 30], [8, 8, 8, 8], tables)
    sanitized, valid = meta.sanitize(num_tokens=10, num_pages=9, page_size=4)
    # 1 ends before it starts, 2 starts inside 0, 3 ends past T = 10.
    np.testing.assert_array_equal(valid, [True, False, False, False])
    np.testing.assert_array_equal(sanitized.cu_q_lens, [0, 5, 5, 8, 10])
    np.testing.assert_array_equal(sanitized.kv_lens, [8, 0, 0, 0])
    np.testing.assert_array_equal(sanitized.block_tables, [[1, 2], [0, 0], [0, 0], [0, 0]])


def test_lengths_pages_and_max_q_len_are_flagged():
    tables = [[1, 2], [3, 0], [0, 4], [5, 99]]
    meta = _meta([0, 1, 4, 4, 6], [5, 2, 0, 4], tables, max_q_len=2)
    # 0 ok (pages 1, 2); 1: q_len 3 > max_q_len and > kv_len; 2: empty padding; 3: page 5 covers all 4 keys.
    np.testing.assert_array_equal(meta.validate(6, 8, 4), [True, False, True, True])
    np.testing.assert_array_equal(meta.sanitize(6, 8, 4)[0].block_tables, [[1, 2], [0, 0], [0, 0], [5, 5]])
    np.testing.assert_array_equal(_meta([0, 1, 2, 3, 4], [9, 1, 1, 1], tables).validate(4, 8, 4),
                                  [False, True, False, True])          # 9 keys > 2 pages of 4; page 0 in use
    np.testing.assert_array_equal(_meta([0, 1, 2, 3, 4], [-1, 1, 5, 1], tables).validate(4, 8, 4),
                                  [False, True, False, True])          # kv_len < q_len; page 0 in use (5 keys)


def test_sequences_past_max_prefill_seqs_are_flagged():
    tables = [[1, 2], [3, 0], [4, 0], [5, 0], [6, 0]]
    meta = dataclasses.replace(_meta([0, 1, 2, 5, 7, 9], [1, 1, 3, 2, 2], tables),
                               num_decodes=jnp.asarray(2, jnp.int32), max_prefill_seqs=2)
    # decodes 0, 1; prefill part 2, 3; 4 has tokens past it.
    np.testing.assert_array_equal(meta.validate(9, 8, 4), [True, True, True, True, False])
    # num_decodes is checked: a count above the leading one-token run moves the part no further.
    meta = dataclasses.replace(meta, num_decodes=jnp.asarray(5, jnp.int32), max_prefill_seqs=1)
    np.testing.assert_array_equal(meta.validate(9, 8, 4), [True, True, True, False, False])
    # sequences without tokens keep the contract wherever they are
    padded = _meta([0, 1, 3, 3], [1, 2, 0], [[1, 0], [2, 0], [0, 0]])
    padded = dataclasses.replace(padded, num_decodes=jnp.asarray(1, jnp.int32), max_prefill_seqs=1)
    np.testing.assert_array_equal(padded.validate(3, 8, 4), [True, True, True])


def test_non_finite_fp8_scales_flag_every_sequence():
    cache = jaxattn.KVCache.create(4, 4, 1, 16, dtype=jnp.float8_e4m3fn)
    meta = _meta([0, 1, 1], [3, 0], [[1], [0]])
    q = jnp.ones((1, 1, 16), jnp.float32)
    run = jax.jit(lambda c: jaxattn.paged_attention(q, c, meta, return_status=True, backend="xla"))
    assert np.asarray(run(cache)[1]).tolist() == [True, True]
    out, valid = run(dataclasses.replace(cache, k_scale=jnp.float32(jnp.nan)))
    assert np.asarray(valid).tolist() == [False, False] and not np.asarray(out).any()


def _problem(rng: np.random.Generator, q_lens: list[int], kv_lens: list[int], shape: Shape = CPU) -> tuple[Problem, np.ndarray]:
    """A problem of fixed shapes (one compilation for all examples), HND pages; every page no
    sequence owns, page 0 included, holds NaN. Returns it and its block tables (numpy)."""
    perm = rng.permutation(np.arange(1, shape.num_pages))
    tables = np.zeros((shape.batch, shape.pages_per_seq), np.int32)
    start = 0
    for b, n in enumerate(kv_lens):
        need = -(-n // shape.page)
        tables[b, :need] = perm[start:start + need]
        start += need
    owned = np.zeros(shape.num_pages, bool)
    owned[tables[tables > 0]] = True
    pools = [rng.normal(size=(shape.num_pages, shape.num_kv_heads, shape.page, shape.head_dim)) for _ in range(2)]
    pools = [np.asarray(jnp.asarray(pool, shape.dtype).astype(jnp.float32), np.float64) for pool in pools]
    for pool in pools:
        pool[~owned] = np.nan
    dense = [[np.swapaxes(pool[tables[b, :-(-n // shape.page)]], 1, 2).reshape(-1, shape.num_kv_heads, shape.head_dim)[:n]
              for b, n in enumerate(kv_lens)] for pool in pools]
    cache = jaxattn.KVCache(jnp.asarray(pools[0], shape.dtype), jnp.asarray(pools[1], shape.dtype))
    q = jnp.asarray(rng.normal(size=(shape.tokens, shape.num_q_heads, shape.head_dim)), shape.dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = _meta(cu, kv_lens, tables)
    return Problem(q, cache, meta, dense[0], dense[1], list(q_lens), list(kv_lens), owned), tables


def _break(rng: np.random.Generator, problem: Problem, tables: np.ndarray, faults: list[str], max_q_len: int | None,
           shape: Shape = CPU) -> tuple[jaxattn.AttentionMetadata, np.ndarray]:
    """The problem's metadata with ``faults[b]`` applied to sequence b, and which sequences
    then break the contract (the faults, and queries longer than ``max_q_len``)."""
    q_lens, kv_lens = problem.q_lens, problem.kv_lens
    kv_in, broken = np.array(kv_lens), np.zeros(shape.batch, bool)
    tables = tables.copy()
    for b, fault in enumerate(faults):
        used = -(-kv_lens[b] // shape.page)
        if fault == "page" and used:
            tables[b, rng.integers(used)] = rng.choice(shape.bad_page_ids)
        elif fault == "short" and q_lens[b]:
            kv_in[b] = q_lens[b] - 1
        elif fault == "long":
            kv_in[b] = shape.pages_per_seq * shape.page + 1 + rng.integers(5)
        else:
            continue
        broken[b] = True
    if max_q_len is not None:
        broken |= np.array(q_lens) > max_q_len
    meta = dataclasses.replace(problem.meta, kv_lens=jnp.asarray(kv_in, jnp.int32), block_tables=jnp.asarray(tables),
                               max_q_len=max_q_len)
    return meta, broken


def _expected(problem: Problem, broken: np.ndarray) -> np.ndarray:
    """The float64 reference with the broken sequences' keys removed (their rows are zeros)."""
    keep = [slice(0 if bad else None) for bad in broken]
    return reference(dataclasses.replace(
        problem, kv_lens=[0 if bad else n for bad, n in zip(broken, problem.kv_lens)],
        k_dense=[k[s] for k, s in zip(problem.k_dense, keep)], v_dense=[v[s] for v, s in zip(problem.v_dense, keep)]))


@st.composite
def _batches(draw):
    q_lens = [draw(st.integers(0, CPU.tokens // CPU.batch)) for _ in range(CPU.batch)]
    kv_lens = [draw(st.integers(q, CPU.pages_per_seq * CPU.page)) for q in q_lens]
    faults = [draw(st.sampled_from(FAULTS)) for _ in range(CPU.batch)]
    return q_lens, kv_lens, faults, draw(st.sampled_from((None, 3))), draw(st.integers(0, 2**32 - 1))


@pytest.fixture(params=["xla", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton":
        pytest.importorskip("triton")
        # On CPU the triton kernels run under Triton's interpreter (tests only).
        real = backends.unavailable_reason
        monkeypatch.setattr(backends, "unavailable_reason", lambda name: None if name == "triton" else real(name))
    return request.param


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=_batches())
def test_broken_sequences_are_zero_and_flagged_and_unowned_pages_never_leak(backend, batch):
    q_lens, kv_lens, faults, max_q_len, seed = batch
    rng = np.random.default_rng(seed)
    problem, tables = _problem(rng, q_lens, kv_lens)
    meta, broken = _break(rng, problem, tables, faults, max_q_len)
    run = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, return_status=True, backend=backend))
    out, valid = run(problem.q, problem.cache, meta)
    np.testing.assert_array_equal(valid, ~broken)
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), "a page the sequence does not own reached its output"
    np.testing.assert_allclose(out, _expected(problem, broken), rtol=2e-4, atol=2e-4)


GPU = Shape(batch=8, tokens=40, pages_per_seq=8, page=16, num_kv_heads=2, num_q_heads=8, head_dim=128,
            dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("max_q_len", [1, 4, None])
@pytest.mark.parametrize("name", ["xla", "cudnn", "trtllm", "triton", "auto"])
def test_gpu_broken_sequences_are_zero_and_flagged(name, max_q_len):
    """Every fault at once (bad page ids incl. 0, -1, num_pages and 2**30; kv_lens too short and
    too long; queries past max_q_len), NaN in every page the batch does not own, page 0 too."""
    if name != "auto" and backends.unavailable_reason(name) is not None:
        pytest.skip(backends.unavailable_reason(name))
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    q_lens = [1, 1, 1, 1, 1, 1, 0, 1] if max_q_len == 1 else [1, 1, 4, 2, 7, 3, 0, 5]
    kv_lens = [int(rng.integers(q, GPU.pages_per_seq * GPU.page + 1)) for q in q_lens]
    kv_lens[6] = 0                                                 # a padding sequence (no tokens, no keys)
    faults = ["page", "none", "short", "long", "none", "page", "none", "none"]
    problem, tables = _problem(rng, q_lens, kv_lens, GPU)
    meta, broken = _break(rng, problem, tables, faults, max_q_len, GPU)
    assert broken.any() and not broken.all()
    if name == "trtllm" and max_q_len is None:
        pytest.skip("trtllm takes decode and speculative-decode steps only")
    run = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, return_status=True, backend=name))
    out, valid = run(problem.q, problem.cache, meta)
    np.testing.assert_array_equal(valid, ~broken, err_msg=f"seed {seed}")
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert not np.isnan(out).any(), f"a page the sequence does not own reached its output (seed {seed})"
    expected = _expected(problem, broken)
    for b, bad in enumerate(broken):
        rows = slice(int(meta.cu_q_lens[b]), int(meta.cu_q_lens[b + 1]))
        if bad:
            assert not out[rows].any(), f"sequence {b} broke the contract but has non-zero rows (seed {seed})"
    assert rel_error(out, expected) < 2e-2, f"seed {seed}"


@pytest.mark.parametrize("method, args", [("positions", (None,)), ("positions", (0,)), ("positions", (2.5,)),
                                          ("token_to_seq", (-1,)), ("validate", (5, 8, 0)), ("validate", (None, 8, 4)),
                                          ("validate", (5, 8, 2.5)), ("sanitize", (5, 8, -4)),
                                          ("sanitize", (5, 2 ** 31, 4))])
def test_static_sizes_of_the_methods_are_checked(method, args):
    meta = _meta([0, 1, 5], [9, 9], [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match=f"AttentionMetadata.{method}: .* must be an int in \\[1, 2\\*\\*31 - 1\\]"):
        getattr(meta, method)(*args)

