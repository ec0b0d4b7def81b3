import dataclasses
import json
import os

import jax
import pytest

from jaxattn import choice_table
from jaxattn.serve.models import expert_gemm_table, experts
from jaxattn.serve.models.expert_gemm_table import Entry, Key, Table

DEEPSEEK = dict(experts=64, k=6, dim=2048, hidden=1408)     # DeepSeek-V2-Lite's routed experts
MIXTRAL = dict(experts=8, k=2, dim=4096, hidden=14336)


def entry(order, weights="bf16", tokens=1, **shape) -> Entry:
    return Entry(Key(weights, **{**DEEPSEEK, **shape}, tokens=tokens), tuple(order),
                 {name: float(i + 1) for i, name in enumerate(order)})


def table(*entries: Entry) -> Table:
    return Table("sm_90", "python -m benchmarks.bench_moe", "NVIDIA H100 80GB HBM3", "2026-12-05", "0.11.2", "",
                 entries)


@pytest.fixture
def on_sm90_gpu(monkeypatch):
    """This machine looks like an sm_90 GPU (its tables: the shipped ones, unless a test points
    ``choice_table.TABLE_DIR`` elsewhere before it reads one)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(choice_table, "current_arch", lambda: "sm_90")
    expert_gemm_table.current_table.cache_clear()
    yield
    expert_gemm_table.current_table.cache_clear()


def test_the_nearest_entry_has_the_same_weights_and_the_fewest_doublings():
    small, large, fp8 = (entry(["triton"], tokens=1), entry(["dense"], tokens=64),
                         entry(["ragged_dot"], weights="fp8", tokens=8))
    measured = table(small, large, fp8)
    assert measured.nearest(Key("bf16", **DEEPSEEK, tokens=4)) is small      # 2 doublings from 1, 4 from 64
    assert measured.nearest(Key("bf16", **DEEPSEEK, tokens=2048)) is large
    assert measured.nearest(Key("fp8", **DEEPSEEK, tokens=2048)) is fp8
    assert measured.nearest(Key("bf16", **DEEPSEEK, tokens=8)) is small       # equidistant: the first
    # every shape size within two doublings, tokens any distance
    assert measured.nearest(Key("bf16", **{**DEEPSEEK, "experts": 256}, tokens=1)) is small
    assert measured.nearest(Key("bf16", **{**DEEPSEEK, "experts": 257}, tokens=1)) is None
    assert measured.nearest(Key("bf16", **MIXTRAL, tokens=1)) is None


def test_the_shipped_tables_load_and_are_named_after_their_arch():
    names = [name for name in os.listdir(choice_table.TABLE_DIR) if name.startswith("moe_")]
    assert names
    for name in names:
        assert name == f"moe_{expert_gemm_table.load(os.path.join(choice_table.TABLE_DIR, name)).arch}.json"


def test_choose_gemm_takes_the_fastest_of_the_shipped_table_on_a_gpu(on_sm90_gpu):
    shipped = expert_gemm_table.current_table()
    assert {e.key.weights for e in shipped.entries} == {"bf16", "fp8"}
    for measured in shipped.entries:
        key = measured.key
        assert set(measured.order) == set(experts.GEMMS) == set(measured.us)
        assert measured.us[measured.order[0]] == min(measured.us.values())
        assert experts.choose_gemm(key.tokens, key.experts, key.k, key.dim, key.hidden,
                                   key.weights == "fp8") == measured.order[0]
    assert experts.choose_gemm(1, 64, 6, 2048, 1408) == "triton"                    # 7x dense in the table
    assert experts.choose_gemm(256, 8, 2, 4096, 14336) == "dense"                   # Mixtral's mid sizes
    assert experts.choose_gemm(1, 1024, 6, 2048, 1408) == "dense"                   # nothing near: dense


def test_choose_gemm_is_dense_on_a_gpu_without_a_table_and_ragged_dot_off_it(on_sm90_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(choice_table, "TABLE_DIR", str(tmp_path))
    assert experts.choose_gemm(1, 64, 6, 2048, 1408) == "dense"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert experts.choose_gemm(1, 64, 6, 2048, 1408) == "ragged_dot"


def test_a_table_entry_of_another_strategy_is_passed_over(on_sm90_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(choice_table, "TABLE_DIR", str(tmp_path))
    expert_gemm_table.dump(table(entry(["tokamax", "triton", "dense"])), expert_gemm_table.table_path("sm_90"))
    assert experts.choose_gemm(1, 64, 6, 2048, 1408) == "triton"


def test_dump_load_and_merge_round_trip(tmp_path):
    path = str(tmp_path / "moe.json")
    bf16 = table(entry(["triton", "dense"]), entry(["dense", "triton"], tokens=32))
    expert_gemm_table.dump(bf16, path)
    assert expert_gemm_table.load(path) == bf16
    fp8 = dataclasses.replace(table(entry(["dense", "triton"], weights="fp8"), entry(["triton", "dense"], tokens=32)),
                              command="python -m benchmarks.bench_moe --fp8")
    both = expert_gemm_table.merged(bf16, fp8)
    assert [e.order[0] for e in both.entries] == ["dense", "triton", "triton"]     # fp8's, its bf16 32, bf16 1
    assert "1 entries kept from the table of `python -m benchmarks.bench_moe`" in both.comment


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format=2), "format"),
    (lambda d: d["entries"][0]["key"].update(weights="int4"), "key.weights"),
    (lambda d: d["entries"][0]["key"].update(tokens=0), "key.tokens"),
    (lambda d: d["entries"][0].update(order=[]), "order"),
])
def test_a_malformed_table_raises_naming_the_file(tmp_path, change, message):
    path = tmp_path / "moe_sm_90.json"
    data = table(entry(["triton", "dense"])).to_json()
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"moe_sm_90.json.*{message}"):
        expert_gemm_table.load(str(path))


def test_bench_moe_writes_its_table_and_an_fp8_run_adds_to_it(tmp_path, monkeypatch):
    from benchmarks import bench_moe

    monkeypatch.setenv("OUT", str(tmp_path))
    path = tmp_path / "moe.json"
    bench_moe.main(["--smoke", "--trials", "1", "--table", str(path)])
    bench_moe.main(["--smoke", "--trials", "1", "--fp8", "--table", str(path)])
    written = expert_gemm_table.load(str(path))
    assert sorted((e.key.weights, e.key.tokens) for e in written.entries) == [
        ("bf16", 1), ("bf16", 4), ("fp8", 1), ("fp8", 4)]
    assert "--fp8" in written.command and "entries kept from" in written.comment
