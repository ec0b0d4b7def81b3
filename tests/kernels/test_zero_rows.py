"""``kernels.zero_rows``: the in-place zeroing of the output rows a kernel skipped (Triton's
interpreter on CPU, the compiled kernel on a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the zero_rows kernel needs the triton package")
from jaxattn.kernels import zero_rows  # noqa: E402


def _case(q_lens, used, num_tokens, row_shape, seed):
    """A poisoned output (NaN in every unwritten row) and which rows were written."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    written = np.zeros(num_tokens, bool)
    for start, n in zip(cu[:-1], used):
        written[start:start + n] = True
    out = np.random.default_rng(seed).normal(size=(num_tokens, *row_shape)).astype(np.float32)
    out[~written] = np.nan
    return jnp.asarray(cu), jnp.asarray(np.asarray(used, np.int32)), out, written


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("q_lens, used, num_tokens, row_shape", [
    # 3 tokens; 2 tokens of a sequence emptied by sanitize; a padding sequence; 4 tokens; 3 padding tokens
    ([3, 2, 0, 4], [3, 0, 0, 4], 12, (2, 16)),
    # more sequences than one step compares (SEQS), rows wider than one store (COLS), a partial last program
    ([1 + i % 3 for i in range(300)], [(1 + i % 3) * (i % 7 != 3) for i in range(300)],
     620, (3, 400)),
    # every row written: nothing changes
    ([5, 11], [5, 11], 16, (4, 8)),
])
def test_zeroes_exactly_the_unwritten_rows(q_lens, used, num_tokens, row_shape, dtype, on_platform):
    """Unwritten rows become zero; every written row keeps its bits (a kept NaN shows a missed row)."""
    cu, rows_used, out, written = _case(q_lens, used, num_tokens, row_shape, seed=len(q_lens))
    out = jnp.asarray(out, dtype)
    zeroed = jax.jit(zero_rows.zero_unwritten_rows)(out, cu, rows_used)
    assert zeroed.shape == out.shape and zeroed.dtype == out.dtype
    assert np.array_equal(np.asarray(zeroed[written]).view(np.uint16), np.asarray(out[written]).view(np.uint16))
    assert not np.asarray(zeroed[~written].astype(jnp.float32)).any()
