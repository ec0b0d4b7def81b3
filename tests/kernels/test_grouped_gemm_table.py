import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import choice_table
from jaxattn.kernels import grouped_gemm_table
from jaxattn.kernels.grouped_gemm_table import Entry, Key, Table, Tiles

GATE_UP = dict(swiglu=True, k=2048, n=1408)      # DeepSeek-V2-Lite's gate and up
SWAPPED = Tiles(128, 128, 4, 3, True)


def entry(tiles: Tiles, weights="fp8", block_m=32, **shape) -> Entry:
    return Entry(Key(weights, block_m=block_m, **{**GATE_UP, **shape}), tiles, {"a": 1.0})


def table(*entries: Entry) -> Table:
    return Table("sm_90", "python -m benchmarks.tune_grouped_gemm", "NVIDIA H100 80GB HBM3", "2026-12-07", "0.11.2",
                 "", entries)


@pytest.fixture
def sm90_table(monkeypatch, tmp_path):
    """This machine looks like an sm_90 GPU whose grouped GEMM table is written by the test."""
    monkeypatch.setattr(choice_table, "current_arch", lambda: "sm_90")
    monkeypatch.setattr(choice_table, "TABLE_DIR", str(tmp_path))
    grouped_gemm_table.current_table.cache_clear()

    def write(*entries: Entry) -> None:
        grouped_gemm_table.dump(table(*entries), grouped_gemm_table.table_path("sm_90"))
        grouped_gemm_table.current_table.cache_clear()
    yield write
    grouped_gemm_table.current_table.cache_clear()


def test_the_nearest_entry_has_the_same_kind_swiglu_and_block_rows_and_the_fewest_doublings():
    near, far, down, bf16 = (entry(SWAPPED), entry(Tiles(64, 64, 4, 3), k=7168, n=2048),
                             entry(Tiles(32, 128, 4, 4), swiglu=False, k=1408, n=2048), entry(Tiles(), weights="bf16"))
    measured = table(near, far, down, bf16)
    assert measured.nearest(Key("fp8", True, 32, 2048, 1408)) is near
    assert measured.nearest(Key("fp8", True, 32, 2048, 2816)) is near          # 1 doubling against 2.3
    assert measured.nearest(Key("fp8", True, 32, 7168, 2048)) is far
    assert measured.nearest(Key("fp8", False, 32, 1408, 2048)) is down
    assert measured.nearest(Key("bf16", True, 32, 2048, 1408)) is bf16
    assert measured.nearest(Key("fp8", True, 16, 2048, 1408)) is None          # block rows must match
    assert measured.nearest(Key("fp8", True, 32, 2048, 1408 * 8)) is None      # N more than two doublings off


def test_choose_tiles_takes_the_table_and_falls_back_to_default_tiles(sm90_table):
    from jaxattn.kernels.grouped_gemm import choose_tiles, default_tiles

    assert choose_tiles(32, 2048, 1408, True, "fp8") == default_tiles(fp8_enk=True)     # no table yet
    sm90_table(entry(SWAPPED), entry(Tiles(64, 256, 8, 3), weights="bf16", block_m=16))
    assert choose_tiles(32, 2048, 1408, True, "fp8") == SWAPPED
    assert choose_tiles(32, 2048, 1408, True, "fp8", scale_depth=64) == SWAPPED._replace(block_k=64)
    assert choose_tiles(16, 2048, 1408, True, "bf16") == Tiles(64, 256, 8, 3)
    assert choose_tiles(64, 2048, 1408, True, "fp8") == default_tiles(fp8_enk=True)      # no 64-row entry
    assert choose_tiles(32, 2048, 1408, False, "fp8") == default_tiles(fp8_enk=True)     # no down entry
    assert choose_tiles(16, 2048, 1408, True, None) == default_tiles()                   # e.g. FP8 [E, K, N]


def test_grouped_gemm_runs_with_the_tiles_of_the_table(sm90_table, monkeypatch):
    """A call without ``tiles`` launches the table's (swapped) configuration and computes the same."""
    from jaxattn.kernels import grouped_gemm as gg

    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.normal(size=(32, 64)), jnp.bfloat16)
    weights = jnp.asarray(rng.normal(size=(2, 64, 32)) / 8, jnp.bfloat16)
    blocks = jnp.asarray([1, 0], jnp.int32)
    run = jax.jit(lambda r, b, w: gg.grouped_gemm(r, b, w, block_m=16))
    expected = run(rows, blocks, weights)
    sm90_table(entry(Tiles(32, 32, 4, 1, True), weights="bf16", block_m=16, swiglu=False, k=64, n=32))
    launched = []
    choose = gg.choose_tiles
    monkeypatch.setattr(gg, "choose_tiles", lambda *a, **kw: launched.append(choose(*a, **kw)) or launched[-1])
    out = jax.jit(lambda r, b, w: gg.grouped_gemm(r, b, w, block_m=16))(rows, blocks, weights)
    assert launched == [Tiles(32, 32, 4, 1, True)]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), rtol=2e-2, atol=2e-2)


def test_dump_load_and_merge_round_trip(tmp_path):
    path = str(tmp_path / "grouped_gemm.json")
    first = table(entry(SWAPPED), entry(Tiles(), block_m=16))
    grouped_gemm_table.dump(first, path)
    assert grouped_gemm_table.load(path) == first
    second = table(entry(Tiles(64, 64, 4, 3)))
    both = choice_table.merged_entries(first, second)
    assert [e.tiles for e in both.entries] == [Tiles(64, 64, 4, 3), Tiles()]          # its own, then first's 16
    assert "1 entries kept from the table of `python -m benchmarks.tune_grouped_gemm`" in both.comment


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format=2), "format"),
    (lambda d: d["entries"][0]["key"].update(weights="int4"), "key.weights"),
    (lambda d: d["entries"][0]["key"].update(swiglu=1), "key.swiglu"),
    (lambda d: d["entries"][0]["key"].update(block_m=0), "key.block_m"),
    (lambda d: d["entries"][0].update(tiles=[96, 64, 4, 3, False]), "tiles must be"),
    (lambda d: d["entries"][0].update(tiles=[128, 64, 4, 3, "no"]), "tiles must be"),
    (lambda d: d["entries"][0].update(tiles=[128, 64, 4, 3, False, 1]), "tiles must be"),
    (lambda d: d["entries"][0].update(tiles=[128, 16, 4, 3, False]), "FP8 tiles must be at least 32 deep"),
])
def test_a_malformed_table_raises_naming_the_file(tmp_path, change, message):
    path = tmp_path / "grouped_gemm_sm_90.json"
    data = table(entry(SWAPPED)).to_json()
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"grouped_gemm_sm_90.json.*{message}"):
        grouped_gemm_table.load(str(path))


def test_the_shipped_tables_load_and_are_named_after_their_arch():
    for name in (n for n in os.listdir(choice_table.TABLE_DIR) if n.startswith("grouped_gemm_")):
        assert name == f"grouped_gemm_{grouped_gemm_table.load(os.path.join(choice_table.TABLE_DIR, name)).arch}.json"


def test_the_tuner_writes_its_table_and_keeps_other_keys(tmp_path, monkeypatch):
    from benchmarks import tune_grouped_gemm

    monkeypatch.setenv("OUT", str(tmp_path))
    path = tmp_path / "grouped_gemm.json"
    earlier = dataclasses.replace(table(entry(SWAPPED, block_m=64, k=7168, n=2048)), arch="cpu")  # the smoke run's
    grouped_gemm_table.dump(earlier, str(path))
    tune_grouped_gemm.main(["--smoke", "--trials", "1", "--tokens", "1", "--table", str(path)])
    written = grouped_gemm_table.load(str(path))
    assert [(e.key.weights, e.key.swiglu) for e in written.entries[:4]] == [
        ("bf16", True), ("bf16", False), ("fp8", True), ("fp8", False)]
    assert all(len(e.us) == 4 and e.us[tune_grouped_gemm.label(e.tiles)] == min(e.us.values())
               for e in written.entries[:4])            # the smoke run's four configurations, one "by block"
    assert all("32x32 w4 s1 by block" in e.us for e in written.entries[:4])
    saved = json.loads(path.read_text())       # tiles with block_tiles_first; the kept entry's as written
    assert [len(e["tiles"]) for e in saved["entries"]] == [6, 6, 6, 6, 6]
    assert [Tiles(*e["tiles"]) for e in saved["entries"][:4]] == [e.tiles for e in written.entries[:4]]
    saved["entries"][4]["tiles"] = saved["entries"][4]["tiles"][:5]     # a table written before block_tiles_first
    path.write_text(json.dumps(saved))
    assert grouped_gemm_table.load(str(path)).entries[4].tiles == SWAPPED._replace(block_tiles_first=False)
    assert written.entries[4].key.k == 7168 and "entries kept from" in written.comment
    with pytest.raises(SystemExit):                                     # --configs names an unknown label
        tune_grouped_gemm.main(["--smoke", "--tokens", "1", "--configs", "32x32 w4 s1,16x16 w1 s1"])
    with pytest.raises(SystemExit):
        tune_grouped_gemm.main(["--smoke", "--tokens", "1", "--shared", "-1"])


@pytest.mark.parametrize("tokens", [1, 5, 256, 2048])
def test_the_tuner_lays_out_blocks_as_the_fused_model_does(tokens):
    """The tuner's blocks for DeepSeek-V2-Lite with its shared expert fused (two more experts every
    token takes): as many as ``routed_experts`` makes over 66 experts, 8 per token, each shared
    expert's blocks holding every token, kept in place by the placements that rotate the routed."""
    from benchmarks.tune_grouped_gemm import block_experts, placements
    from jaxattn.serve.models.experts import block_rows, num_blocks

    block_m = block_rows(tokens, 66, 8)
    blocks = block_experts(tokens, 64, 6, block_m, shared=2)
    assert blocks.size == num_blocks(tokens, 66, 8, block_m)
    for expert in (64, 65):
        assert (blocks == expert).sum() == -(-tokens // block_m)
    routed_copies = np.bincount(np.arange(tokens * 6) % min(64, tokens * 6))        # spread evenly
    assert ((blocks >= 0) & (blocks < 64)).sum() == sum(-(-c // block_m) for c in routed_copies)
    for placed in placements(tokens, 64, 6, block_m, shared=2):
        placed = np.asarray(placed)
        assert np.array_equal(placed >= 64, blocks >= 64) and np.array_equal(placed < 0, blocks < 0)
