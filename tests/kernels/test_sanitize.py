"""``kernels.sanitize``: the one-kernel ``AttentionMetadata.sanitize`` gives the reference's arrays
bit for bit, on metadata that breaks the contract in every way it can (Triton's interpreter on
CPU, the compiled kernel on a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the sanitize kernel needs the triton package")
import jaxattn  # noqa: E402
from jaxattn.kernels import sanitize  # noqa: E402


def _hostile(rng: np.random.Generator, batch: int, width: int, page: int, num_pages: int, num_tokens: int):
    """Offsets mostly in order with some out of order, negative or past T; lengths mostly fitting
    with some negative, short of the query or over capacity; page ids mostly in the pool with some
    out of it (the null page, negative, past the pool, huge)."""
    q_lens = rng.integers(0, 4, batch)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    for b in rng.choice(batch + 1, size=min(batch + 1, rng.integers(0, 3)), replace=False):
        cu[b] = rng.choice([-3, cu[b] + 2, cu[b] - 1, num_tokens + 5, 2**31 - 1, -2**31])
    kv = q_lens + rng.integers(0, width * page, batch)
    for b in rng.choice(batch, size=min(batch, rng.integers(0, 3)), replace=False):
        kv[b] = rng.choice([-1, 0, q_lens[b] - 1, width * page, width * page + 1, 2**31 - 1])
    tables = rng.integers(1, num_pages, (batch, width))
    faults = rng.random((batch, width)) < 0.05
    tables[faults] = rng.choice([-1, 0, num_pages, 2**30, -2**31], faults.sum())
    return tuple(np.asarray(x, np.int32) for x in (cu, kv, tables))


@pytest.mark.parametrize("batch, width, page, max_q_len", [
    (1, 3, 16, 1), (5, 4, 4, None), (9, 2, 64, 2), (33, 1, 16, None), (3, 1030, 16, None),   # 2 steps of COLS
])
def test_matches_the_reference(batch, width, page, max_q_len, on_platform):
    rng = np.random.default_rng(batch * 1000 + width)
    num_pages = batch * width // 2 + 3
    run = jax.jit(lambda cu, kv, tables, num_tokens: sanitize.sanitize(
        cu, kv, tables, num_tokens=num_tokens, num_pages=num_pages, page_size=page, max_q_len=max_q_len),
        static_argnums=3)
    for trial in range(4):
        num_tokens = int(rng.integers(1, 3 * batch + 2))
        cu, kv, tables = _hostile(rng, batch, width, page, num_pages, num_tokens)
        meta = jaxattn.AttentionMetadata(jnp.asarray(cu), jnp.asarray(kv), jnp.asarray(tables),
                                         jnp.asarray(0, jnp.int32), max_q_len=max_q_len)
        want_meta, want_valid = meta.sanitize(num_tokens, num_pages, page)
        got = run(cu, kv, tables, num_tokens)
        for name, got_array, want in zip(("cu_q_lens", "kv_lens", "block_tables", "valid"), got,
                                         (want_meta.cu_q_lens, want_meta.kv_lens, want_meta.block_tables, want_valid)):
            assert got_array.dtype == want.dtype, name
            np.testing.assert_array_equal(got_array, want, err_msg=f"{name}, trial {trial}")


def test_a_table_without_columns(on_platform):
    """P = 0: nothing to check or read; every sequence with keys breaks the contract."""
    cu, kv = np.array([0, 1, 1], np.int32), np.array([1, 0], np.int32)
    tables = np.zeros((2, 0), np.int32)
    out = jax.jit(lambda *arrays: sanitize.sanitize(*arrays, num_tokens=1, num_pages=4, page_size=16,
                                                    max_q_len=None))(cu, kv, tables)
    np.testing.assert_array_equal(out[1], [0, 0])
    np.testing.assert_array_equal(out[3], [False, True])
    assert out[2].shape == (2, 0)
