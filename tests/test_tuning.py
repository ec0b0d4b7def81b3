"""auto's measured choice table (``jaxattn.choice_table``): buckets, the nearest entry, the order
``dispatch.ranking`` takes from it, and the fallback to ranks without one."""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest

from jaxattn import attention, attention_plan, backends, choice_table, dispatch
from jaxattn.backends.base import AttentionParams, Call
from jaxattn.kv_cache import KVCache, MLACache
from jaxattn.metadata import AttentionMetadata

BACKENDS = ("xla", "cudnn", "trtllm", "triton")
H100 = "NVIDIA H100 80GB HBM3"
PARAMS = AttentionParams(scale=0.125, causal=True, sliding_window=None, softcap=None, has_sinks=False)


def make_call(batch: int = 3, width: int = 5, page_size: int = 16, tokens: int | None = None,
              max_q_len: int | None = 1, layout: str = "HND") -> Call:
    """A paged_attention call of ``batch`` sequences over block tables ``width`` pages wide
    (8 query heads over 2 KV heads of 64 dims, bf16)."""
    tokens = batch if tokens is None else tokens
    shape = (8, 2, page_size, 64) if layout == "HND" else (8, page_size, 2, 64)
    cache = KVCache(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16), layout=layout)
    meta = AttentionMetadata(cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32), kv_lens=jnp.ones((batch,), jnp.int32),
                             block_tables=jnp.ones((batch, width), jnp.int32), num_decodes=jnp.int32(batch),
                             max_q_len=max_q_len)
    return Call("paged_attention", jnp.zeros((tokens, 8, 64), jnp.bfloat16), cache, meta, PARAMS)


def entry(order: list[str], **key_fields) -> dict:
    """An entry's JSON for a decode call of ``make_call``'s shapes, with ``key_fields`` replaced."""
    key = {**choice_table.Key.of(make_call()).to_json(), **key_fields}
    return {"key": key, "order": order, "ms": {name: 1.0 for name in order}, "workloads": ["test"]}


def table_json(*entries: dict) -> dict:
    return {"format": 1, "arch": "sm_90", "command": "python -m benchmarks.tune_auto", "device": "test",
            "date": "today", "jax": "0", "entries": list(entries)}


@pytest.fixture
def on_sm90(monkeypatch, tmp_path):
    """This machine looks like an sm_90 GPU whose tables are in ``tmp_path`` (none until a test
    writes ``sm_90.json``); the registry's first four backends, each of which runs here."""
    monkeypatch.setattr(backends, "REGISTRY", {name: backends.REGISTRY[name] for name in BACKENDS})
    monkeypatch.setattr(choice_table, "current_arch", lambda: "sm_90")
    monkeypatch.setattr(choice_table, "current_device_kind", lambda: H100)
    monkeypatch.setattr(choice_table, "TABLE_DIR", str(tmp_path))
    monkeypatch.setattr(backends, "unavailable_reason", lambda name: None)
    monkeypatch.setattr(dispatch, "_logged", set())
    choice_table.shipped_table.cache_clear()
    yield tmp_path
    choice_table.shipped_table.cache_clear()


def write_table(directory, data: dict, name: str = "sm_90") -> None:
    with open(os.path.join(directory, f"{name}.json"), "w") as f:
        json.dump(data, f)
    choice_table.shipped_table.cache_clear()


def test_a_call_buckets_by_static_facts_and_powers_of_two():
    key = choice_table.Key.of(make_call(batch=3, width=5, page_size=16, tokens=3))
    assert key == choice_table.Key(op="paged_attention", phase="decode", dtype="bfloat16", kv_dtype="bfloat16",
                                   group=4, head_dim=64, page_size=16, layout="HND", options=(), seqs=4,
                                   capacity=128, tokens=4)
    prefill = choice_table.Key.of(make_call(batch=2, width=64, tokens=1000, max_q_len=None, layout="NHD"))
    assert (prefill.phase, prefill.layout, prefill.sizes) == ("prefill", "NHD", (2, 1024, 1024))
    spec = choice_table.Key.of(dataclasses.replace(make_call(tokens=12, max_q_len=4)))
    assert spec.phase == "spec_decode" and spec.tokens == 16
    windowed = make_call()
    windowed = dataclasses.replace(windowed, params=dataclasses.replace(PARAMS, sliding_window=8))
    assert choice_table.Key.of(windowed).options == ("sliding_window",)
    assert [choice_table.pow2_ceil(n) for n in (0, 1, 2, 3, 64, 65)] == [1, 1, 2, 4, 64, 128]


def test_the_nearest_entry_shares_the_static_facts_and_is_within_two_doublings():
    table = choice_table.parse(table_json(
        entry(["xla"], seqs=4, capacity=128, tokens=4),
        entry(["cudnn"], seqs=64, capacity=4096, tokens=64),
        entry(["trtllm"], seqs=64, capacity=4096, tokens=64, layout="NHD"),
        entry(["triton"], seqs=1, capacity=128, tokens=1)))
    nearest = lambda call: (table.nearest(choice_table.Key.of(call)) or choice_table.Entry(None, ("none",), {}, ())).order[0]  # noqa: E731
    assert nearest(make_call(batch=3, width=5)) == "xla"             # the same bucket
    assert nearest(make_call(batch=16, width=128, page_size=16)) == "cudnn"   # two doublings in seqs, tokens, 0 in kv
    assert nearest(make_call(batch=16, width=128, layout="NHD")) == "trtllm"
    assert nearest(make_call(batch=2, width=8)) == "xla"             # 1 + 0 + 1 doublings; triton's is 1 + 0 + 1 too: first wins
    assert nearest(make_call(batch=1024, width=256)) == "none"       # 4 doublings from cudnn's in seqs
    assert nearest(make_call(batch=3, width=5, max_q_len=None)) == "none"   # no prefill entry


def test_measured_backends_take_their_order_in_the_places_they_hold():
    assert choice_table.reorder(["a", "b", "c", "d"], ["c", "x", "a"]) == ["c", "b", "a", "d"]
    assert choice_table.reorder(["trtllm", "triton", "xla"], ["triton", "trtllm"]) == ["triton", "trtllm", "xla"]
    assert choice_table.reorder(["trtllm", "triton", "xla"], ["cudnn"]) == ["trtllm", "triton", "xla"]


def test_without_a_gpu_or_a_table_the_ranks_decide(on_sm90, monkeypatch):
    call = make_call()
    assert choice_table.measured_order(call) is None                  # no sm_90.json in the directory
    assert dispatch.ranking(call) == dispatch.rank_order(call) == ["trtllm", "triton", "xla"]
    write_table(on_sm90, table_json(entry(["triton", "trtllm"], seqs=1024)))   # nothing near a 3-sequence call
    assert dispatch.ranking(call) == ["trtllm", "triton", "xla"]
    monkeypatch.setattr(choice_table, "current_arch", lambda: None)   # a machine without a GPU
    monkeypatch.setattr(choice_table, "current_device_kind", lambda: None)
    write_table(on_sm90, table_json(entry(["triton", "trtllm"])))
    assert choice_table.measured_order(call) is None and dispatch.ranking(call)[0] == "trtllm"


def test_cudnn_ranks_late_where_its_grid_is_mostly_empty(on_sm90):
    """A prefill step whose rows x max_q_len pass 4x its tokens (an engine's mixed step) ranks
    cuDNN behind triton; a dense prefill, or one without a static max_q_len, keeps it first."""
    mixed = make_call(batch=156, width=32, page_size=64, tokens=668, max_q_len=512)
    dense = make_call(batch=8, width=64, page_size=64, tokens=8 * 512, max_q_len=512)
    unbounded = make_call(batch=156, width=32, page_size=64, tokens=668, max_q_len=None)
    assert mixed.phase == dense.phase == "prefill"
    assert dispatch.rank_order(mixed).index("triton") < dispatch.rank_order(mixed).index("cudnn")
    assert dispatch.rank_order(dense)[0] == dispatch.rank_order(unbounded)[0] == "cudnn"


def test_current_arch_is_none_on_this_cpu_machine():
    if backends.base.gpu_devices():
        pytest.skip("a GPU is visible")
    assert choice_table.current_arch() is None and choice_table.current_device_kind() is None
    assert choice_table.current_table() is None
    assert choice_table.describe_current_table().startswith("none (no GPU, or no table for it)")


def test_a_table_for_this_kind_of_gpu_comes_before_the_arch_table(on_sm90):
    """GPUs of one arch (the H100, the H200) each may ship a table of their own; the arch's serves
    the others."""
    assert choice_table.device_table_name(H100) == "nvidia_h100_80gb_hbm3"
    assert choice_table.device_table_name("NVIDIA H200") == "nvidia_h200"
    call = make_call()
    write_table(on_sm90, table_json(entry(["triton", "trtllm"])))
    assert choice_table.measured_order(call) == ("triton", "trtllm")
    assert choice_table.current_table_name() == "sm_90"
    write_table(on_sm90, table_json(entry(["trtllm", "triton"])), name="nvidia_h100_80gb_hbm3")
    assert choice_table.measured_order(call) == ("trtllm", "triton")
    assert choice_table.current_table().entries[0].order == ("trtllm", "triton")
    assert choice_table.current_table_name() == "nvidia_h100_80gb_hbm3"
    assert choice_table.describe_current_table() == ("jaxattn/tuning/nvidia_h100_80gb_hbm3.json (1 entries; swept on "
                                                     "test, today)")


def test_a_table_reorders_auto_and_leaves_explicit_backends_alone(on_sm90):
    """The issue's decode point: triton measured faster than trtllm goes first; a backend the
    table lists but whose rank is None (cudnn for decodes) stays out; an explicit backend is unchanged."""
    write_table(on_sm90, table_json(entry(["cudnn", "triton", "trtllm", "xla"])))
    call = make_call()
    assert dispatch.ranking(call) == ["triton", "trtllm", "xla"]
    assert dispatch.choose(call) == "triton" and dispatch.choose(call, "trtllm") == "trtllm"
    q, cache, meta = call.q, call.cache, call.meta
    assert attention.backend_for(q, cache, meta, scale=0.125) == dispatch.Route("triton")
    assert attention.backend_for(q, cache, meta, scale=0.125, backend="trtllm") == dispatch.Route("trtllm")
    # A step with options the table did not measure keeps the ranks.
    assert attention.backend_for(q, cache, meta, scale=0.125, sliding_window=4) == dispatch.Route("trtllm")


def test_a_measured_backend_that_cannot_take_the_call_is_skipped(on_sm90, monkeypatch):
    write_table(on_sm90, table_json(entry(["triton", "trtllm"])))
    monkeypatch.setattr(backends, "unavailable_reason", lambda name: "off" if name == "triton" else None)
    assert dispatch.choose(make_call()) == "trtllm"


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("jax"), "'jax'"),
    (lambda d: d.update(format=2), "\"format\": 1"),
    (lambda d: d["entries"][0]["key"].update(seqs=3), "entries\\[0\\].key.seqs must be a power of 2"),
    (lambda d: d["entries"][0]["key"].pop("layout"), "entries\\[0\\].key must have exactly the fields"),
    (lambda d: d["entries"][0].update(order="triton"), "entries\\[0\\].order must be a non-empty list"),
    (lambda d: d["entries"][0]["ms"].update(triton="fast"), "entries\\[0\\].ms must map plan labels"),
    (lambda d: d["entries"][0].update(order=["trtlm"]), "entries\\[0\\].order: 'trtlm' is not a backend"),
    (lambda d: d["entries"][0].update(order=["trtllm+fa3"]), "entries\\[0\\].order: 'trtllm\\+fa3' is not a backend"),
    (lambda d: d["entries"][0].update(order=["a+trtllm+xla"]), "'a\\+trtllm\\+xla' is not a backend"),
    (lambda d: d["entries"][0]["ms"].update({"+xla": 1.0}), "entries\\[0\\].ms: '\\+xla' is not a backend"),
])
def test_a_malformed_table_raises_naming_the_file(on_sm90, change, message):
    data = table_json(entry(["triton", "trtllm"]))
    change(data)
    write_table(on_sm90, data)
    path = os.path.join(on_sm90, "sm_90.json")
    with pytest.raises(ValueError, match=f"malformed choice table {path}: .*{message}"):
        dispatch.ranking(make_call())


def test_invalid_json_raises_naming_the_file(tmp_path):
    path = tmp_path / "sm_90.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"malformed choice table {path}"):
        choice_table.load(str(path))


def test_dump_and_load_round_trip(tmp_path):
    table = choice_table.parse(table_json(entry(["triton", "trtllm"]), entry(["xla"], seqs=64)))
    for tables in (table, dataclasses.replace(table, entries=(), comment="not measured yet")):
        choice_table.dump(tables, str(tmp_path / "t.json"))
        assert choice_table.load(str(tmp_path / "t.json")) == tables


def test_the_shipped_tables_load():
    """Every table in the package is well formed and named after its arch or the kind of GPU that
    swept it (``device``: nvidia-smi's name, then the driver)."""
    for name in os.listdir(choice_table.TABLE_DIR):
        # the expert GEMM and grouped GEMM tiles tables: tests of their own
        if name.endswith(".json") and not name.startswith(("moe_", "grouped_gemm_")):
            table = choice_table.load(os.path.join(choice_table.TABLE_DIR, name))
            kind = table.device.split(",")[0]
            assert name in (f"{table.arch}.json", f"{choice_table.device_table_name(kind)}.json")


def test_mla_prefill_buckets_by_its_no_rope_width_in_either_query_form():
    """mla_prefill's call holds the whole query ``[T, Hq, Dn + Dr]``; its bucket keeps ``Dn`` (128
    at DeepSeek's dims), as the shipped tables were keyed, so their entries still serve it."""
    cache = MLACache(jax.ShapeDtypeStruct((1 + 8 * 64, 64, 512 + 64), jnp.bfloat16))
    meta = AttentionMetadata(cu_q_lens=jnp.arange(9, dtype=jnp.int32) * 4096, kv_lens=jnp.full((8,), 4096, jnp.int32),
                             block_tables=jnp.ones((8, 64), jnp.int32), num_decodes=jnp.int32(0))
    whole, nope, rope = (jax.ShapeDtypeStruct((8 * 4096, 128, d), jnp.bfloat16) for d in (192, 128, 64))
    w_uv = jax.ShapeDtypeStruct((512, 128, 128), jnp.bfloat16)
    keys = {choice_table.Key.of(attention_plan.mla_call("mla_prefill", q, q_rope, cache, meta, PARAMS, w_uv))
            for q, q_rope in ((whole, None), (nope, rope))}
    assert len(keys) == 1 and next(iter(keys)).head_dim == 128
    table = choice_table.load(os.path.join(choice_table.TABLE_DIR, "sm_90.json"))
    assert table.nearest(next(iter(keys))) is not None


def test_plan_labels_name_the_main_backend_after_the_last_plus():
    assert choice_table.plan_label("fa4") == "fa4" and choice_table.plan_label("fa4", "trtllm") == "trtllm+fa4"
    assert choice_table.split_label("fa4") == (None, "fa4")
    assert choice_table.split_label("trtllm+fa4") == ("trtllm", "fa4")
    assert choice_table.split_label("a+b+c") == ("a+b", "c")        # load rejects "a+b": not a backend
    assert dispatch.Route("fa4", "triton").label == "triton+fa4" and dispatch.Route("cudnn").label == "cudnn"


def test_an_entry_orders_backends_by_their_fastest_plan_and_says_which_plan_of_one_is_faster():
    split_wins = choice_table.parse(table_json(entry(["trtllm+triton", "xla", "triton", "trtllm", "xla+trtllm"])))
    only_names = choice_table.parse(table_json(entry(["triton", "trtllm"])))
    split_wins, only_names = split_wins.entries[0], only_names.entries[0]
    assert split_wins.backend_order == ("triton", "xla", "trtllm")
    assert split_wins.split_first("triton", "trtllm") is True
    assert split_wins.split_first("trtllm", "xla") is False
    assert split_wins.split_first("xla", "trtllm") is None          # "trtllm+xla" not timed
    assert only_names.backend_order == ("triton", "trtllm") and only_names.split_first("triton", "trtllm") is None


def prefill_call() -> Call:
    """A prefill step of 3 sequences (decode-only steps of its size rank trtllm first)."""
    return make_call(batch=3, tokens=40, max_q_len=None)


def prefill_entry(order: list[str]) -> dict:
    return entry(order, **{name: value for name, value in choice_table.Key.of(prefill_call()).to_json().items()
                           if name in ("phase", "tokens")})


def test_measured_order_and_split_read_labels_from_this_gpus_table(on_sm90):
    call = prefill_call()
    assert choice_table.measured_split(call, "xla", "trtllm") is None   # no table
    write_table(on_sm90, table_json(prefill_entry(["trtllm+cudnn", "xla", "trtllm+xla", "cudnn"])))
    assert choice_table.measured_order(call) == ("cudnn", "xla")
    assert dispatch.ranking(call) == ["cudnn", "triton", "xla"]
    assert choice_table.measured_split(call, "cudnn", "trtllm") is True
    assert choice_table.measured_split(call, "xla", "trtllm") is False
    assert choice_table.measured_split(call, "cudnn", "triton") is None
    assert choice_table.measured_split(make_call(batch=64, width=64, tokens=1000, max_q_len=None), "cudnn",
                                       "trtllm") is None           # no entry near


@pytest.mark.parametrize("order, plan", [
    (["xla", "trtllm+xla"], dispatch.Route("xla")),                  # measured: whole first
    (["trtllm+xla", "xla"], dispatch.Route("xla", "trtllm")),        # measured: split first
    (["xla"], dispatch.Route("xla", "trtllm")),                      # plain names (the shipped table): the rule
    (["xla", "triton+xla"], dispatch.Route("xla", "trtllm")),        # a split to another decode backend: the rule
])
def test_auto_splits_a_prefill_step_as_the_table_measured(on_sm90, monkeypatch, order, plan):
    """xla is the main backend (cudnn and triton switched off) and trtllm the decodes'; the
    table's order of "xla" and "trtllm+xla" decides the split, and without both the rule splits."""
    monkeypatch.setattr(backends, "unavailable_reason", lambda name: None if name in ("xla", "trtllm") else "off")
    write_table(on_sm90, table_json(prefill_entry(order)))
    call = prefill_call()
    assert dispatch.split_route(call, "xla") == dispatch.Route("xla", "trtllm")
    assert dispatch.auto_route(call, "xla") == plan
    assert attention.backend_for(call.q, call.cache, call.meta, scale=0.125) == plan
    assert attention.backend_for(call.q, call.cache, call.meta, scale=0.125, backend="xla") == dispatch.Route("xla")


def test_no_split_is_weighed_for_decode_steps_or_one_backend(on_sm90, monkeypatch):
    assert dispatch.split_route(make_call(), "trtllm") is None                  # a decode-only step
    monkeypatch.setattr(backends, "unavailable_reason", lambda name: None if name == "xla" else "off")
    write_table(on_sm90, table_json(prefill_entry(["xla+xla", "xla"])))
    assert dispatch.split_route(prefill_call(), "xla") is None                  # decodes would go to xla too
    assert dispatch.auto_route(prefill_call(), "xla") == dispatch.Route("xla")


def test_no_split_is_weighed_for_one_sequence(monkeypatch):
    """One sequence is a decode or a prefill, never both: the prefill backend serves it whole even
    where a decode-only call of its size goes to another backend (the split would launch it empty)."""
    monkeypatch.setattr(backends, "unavailable_reason", lambda name: None if name in ("xla", "trtllm") else "off")
    assert dispatch.split_route(prefill_call(), "xla") == dispatch.Route("xla", "trtllm")
    one = make_call(batch=1, tokens=40, max_q_len=None)
    assert dispatch.split_route(one, "xla") is None
    assert dispatch.route(one) == dispatch.Route("xla")
