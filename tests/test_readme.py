"""Every python block of the README runs as written, each with the minimal setup it needs defined
here (inputs it uses, a 2-device CPU mesh, a tiny local checkpoint for a placeholder path); a
block that cannot run on CPU would be listed in CANNOT_RUN with the reason. The ``step`` block,
run as written, also keeps the out-of-pages contract: a refused request writes nothing, its rows
are zero and flagged, and the other sequences are unaffected."""

from __future__ import annotations

import pathlib
import re
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from tests.paged_inputs import ALLCLOSE

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

# The marker (a string only that block contains) of every README python block, and the test that runs it.
RUN_BY = {
    "def step(": "test_readme_step_out_of_pages",
    "pool_sharding(mesh": "test_readme_sharding_on_two_cpu_devices",
    "prompt_token_ids = [": "test_readme_engine",
    "engine.stream()": "test_readme_sampling_and_streaming",
    'PRESETS["llama3-8b"]': "test_readme_model_on_a_mesh",
    "jaxattn.MLACache.create(": "test_readme_mla",
    "from_pretrained(path": "test_readme_hugging_face_checkpoint",
}
# marker: why the block cannot run on a CPU machine (none so far).
CANNOT_RUN: dict[str, str] = {}


def python_blocks() -> list[str]:
    """The README's ```python blocks, dedented."""
    return [textwrap.dedent(b) for b in re.findall(r"^ *```python\n(.*?)^ *```", README.read_text(), flags=re.S | re.M)]


def snippet(marker: str) -> str:
    """The README's python block that contains ``marker``."""
    (block,) = [b for b in python_blocks() if marker in b]
    return block


def test_every_block_is_run_or_listed():
    blocks = python_blocks()
    for block in blocks:
        markers = [m for m in (*RUN_BY, *CANNOT_RUN) if m in block]
        assert len(markers) == 1, f"a README python block needs one marker in RUN_BY or CANNOT_RUN:\n{block}"
    for marker in (*RUN_BY, *CANNOT_RUN):
        assert any(marker in block for block in blocks), f"no README python block contains {marker!r}"
    assert set(RUN_BY.values()) <= set(globals()), "RUN_BY names a test that does not exist"


def _packed(rng, lens, heads, head_dim, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=(sum(lens), heads, head_dim)), dtype)


def test_readme_step_out_of_pages():
    namespace: dict = {}
    exec(snippet("def step("), namespace)
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
    np.testing.assert_allclose(out[jnp.asarray([0, 6])], alone, **ALLCLOSE[jnp.dtype(jnp.float32)])  # another batch shape


def check_sharding_block() -> None:
    """In a process with 2 CPU devices: the Sharding block, after the step block and with the q, k,
    v, seq_ids and q_lens it uses, gives the unsharded step's output, sharded like q."""
    from jax.sharding import PartitionSpec as P

    namespace: dict = {}
    exec(snippet("def step("), namespace)
    rng = np.random.default_rng(0)
    lens = [5, 12]
    namespace.update(q=_packed(rng, lens, 32, 128, jnp.bfloat16), k=_packed(rng, lens, 8, 128, jnp.bfloat16),
                     v=_packed(rng, lens, 8, 128, jnp.bfloat16), seq_ids=jnp.asarray([0, 1], jnp.int32),
                     q_lens=jnp.asarray(lens, jnp.int32))
    expected = namespace["step"](*(namespace[name] for name in ("q", "k", "v", "cache", "table", "seq_ids", "q_lens")))
    exec(snippet("pool_sharding(mesh"), namespace)
    out = namespace["out"]
    assert out.sharding.spec == P(None, "tp", None), out.sharding
    assert np.asarray(namespace["valid"]).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected[0], np.float32), rtol=2e-2, atol=2e-2)


def test_readme_sharding_on_two_cpu_devices():
    from tests.test_sharding import run_on_cpu_devices

    run_on_cpu_devices(2, "from tests.test_readme import check_sharding_block; check_sharding_block()")


def check_model_on_a_mesh_block() -> None:
    """(On 2 CPU devices.) The block with the tiny preset for the 8B one, which CPU RAM would not hold twice over."""
    namespace: dict = {}
    block = snippet('PRESETS["llama3-8b"]')
    exec(block.replace('PRESETS["llama3-8b"]', 'PRESETS["tiny"]'), namespace)
    engine = namespace["engine"]
    request = engine.add_request([1, 2, 3], max_new_tokens=4)
    engine.run()
    assert len(request.output) == 4


def test_readme_model_on_a_mesh():
    from tests.test_sharding import run_on_cpu_devices

    run_on_cpu_devices(2, "from tests.test_readme import check_model_on_a_mesh_block; check_model_on_a_mesh_block()")


def test_readme_mla():
    """The MLA block on a 2-sequence step (a 5-token prefill and a 3-token chunk over 61 cached tokens)."""
    rng = np.random.default_rng(0)
    heads, q_lens, kv_lens = 4, [5, 3], [5, 64]
    table = jaxattn.PageTable.create(num_pages=1024, max_seqs=2, max_pages_per_seq=4, page_size=64)
    ids = jnp.arange(2, dtype=jnp.int32)
    table, ok = table.extend(ids, jnp.asarray(kv_lens, jnp.int32))
    assert bool(ok.all())
    q_lens = jnp.asarray(q_lens, jnp.int32)
    tokens = int(q_lens.sum())
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-1]), jnp.bfloat16)  # noqa: E731
    namespace = dict(meta=table.metadata(ids, q_lens, max_q_len=None), slots=table.slot_mapping(ids, q_lens, tokens),
                     c_kv=normal(tokens, 512), k_rope=normal(tokens, 64), q_nope=normal(tokens, heads, 128),
                     q_rope=normal(tokens, heads, 64), w_uk=normal(512, heads, 128), w_uv=normal(512, heads, 128))
    exec(snippet("jaxattn.MLACache.create("), namespace)
    assert namespace["out"].shape == (tokens, heads, 128)
    assert np.isfinite(np.asarray(namespace["out"], np.float32)).all()


def test_readme_engine():
    namespace: dict = {}
    exec(snippet("prompt_token_ids = ["), namespace)
    assert len(namespace["request"].output) == 32


def test_readme_sampling_and_streaming(capsys):
    namespace: dict = {}
    exec(snippet("engine.stream()"), namespace)
    lines = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in lines} == {"0", "1"}
    assert not namespace["engine"].has_work


def test_readme_hugging_face_checkpoint(tmp_path, capsys):
    """The block with its placeholder path replaced by a tiny checkpoint (with a tokenizer.json)."""
    pytest.importorskip("transformers")
    from tests.models.hf_checkpoints import save_checkpoint, save_tokenizer

    save_checkpoint("llama", tmp_path)
    save_tokenizer(tmp_path)
    block = snippet("from_pretrained(path")
    placeholder = '"/path/to/Llama-3.1-8B-Instruct"'
    assert block.count(placeholder) == 1
    namespace: dict = {}
    exec(block.replace(placeholder, repr(str(tmp_path))), namespace)
    request, tokenizer = namespace["request"], namespace["tokenizer"]
    assert len(request.output) == 64
    assert capsys.readouterr().out == tokenizer.decode(request.output) + "\n"
