"""The README's ``step`` snippet, run as written, keeps the out-of-pages contract: a refused
request writes nothing, its rows are zero and flagged, and the other sequences are unaffected."""

from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np

import jaxattn

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _snippet(marker: str) -> str:
    """The README's python code block that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def _packed(rng, lens, heads, head_dim):
    return jnp.asarray(rng.normal(size=(sum(lens), heads, head_dim)), jnp.float32)


def test_readme_step_out_of_pages():
    namespace: dict = {}
    exec(_snippet("def step("), namespace)
    step = namespace["step"]
    rng = np.random.default_rng()
    cache = jaxattn.KVCache.create(num_pages=4, page_size=16, num_kv_heads=2, head_dim=16, dtype=jnp.float32)
    table = jaxattn.PageTable.create(num_pages=4, max_seqs=4, max_pages_per_seq=4, page_size=16)

    # Prefill: sequence 0 takes two pages, sequence 1 the last free one.
    lens = [30, 10]
    kv = _packed(rng, lens, 2, 16)
    out, ok, valid, cache, table = step(_packed(rng, lens, 4, 16), kv, -kv, cache, table,
                                        jnp.asarray([0, 1], jnp.int32), jnp.asarray(lens, jnp.int32))
    assert np.asarray(ok).all() and np.asarray(valid).all() and int(table.num_free) == 0

    # Decodes of 0 and 1 around a new request (sequence 2) that finds no free page.
    seq_ids, q_lens = jnp.asarray([0, 2, 1], jnp.int32), jnp.asarray([1, 5, 1], jnp.int32)
    q, kv = _packed(rng, [7], 4, 16), _packed(rng, [7], 2, 16)
    out, ok, valid, new_cache, new_table = step(q, kv, -kv, cache, table, seq_ids, q_lens)
    np.testing.assert_array_equal(ok, [True, False, True])
    np.testing.assert_array_equal(valid, [True, False, True])
    assert not np.asarray(out[1:6]).any(), "the refused request's rows are zeros"
    assert int(new_table.seq_lens[2]) == 0 and int(new_table.num_free) == 0

    # Only the two decodes' slots changed (sequence 0 at position 30, sequence 1 at 10).
    written = np.zeros((4, 16), bool)
    for seq, pos in ((0, 30), (1, 10)):
        written[int(table.block_tables[seq, pos // 16]), pos % 16] = True
    for before, after in ((cache.k_pages, new_cache.k_pages), (cache.v_pages, new_cache.v_pages)):
        before, after = np.asarray(before), np.asarray(after)       # HND: [pages, Hkv, page, D]
        changed = (before != after).any(axis=(1, 3))
        np.testing.assert_array_equal(changed, written)

    # The decodes' rows are what they are without the refused request in the batch.
    alone = step(q[jnp.asarray([0, 6])], kv[jnp.asarray([0, 6])], -kv[jnp.asarray([0, 6])], cache, table,
                 jnp.asarray([0, 1], jnp.int32), jnp.asarray([1, 1], jnp.int32))[0]
    np.testing.assert_allclose(out[jnp.asarray([0, 6])], alone, rtol=1e-6, atol=1e-6)
