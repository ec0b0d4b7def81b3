"""The benchmarks' CPU smoke modes run (each in a fresh Python, as on the device): they measure
nothing, but keep the benchmarks from breaking between GPU sessions. And RESULTS.md's headline
table is the one its sections give."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from tests.xla_dump import REPO


@pytest.mark.parametrize("module", ["bench_tp", "bench_serving --trace shared-prefix --section serving_named",
                                    "bench_mla", "profile_calls",
                                    "bench_step_variants", "bench_speculative",
                                    "bench_serving --trace throughput --preset deepseek-v2-lite --moe-gemm dense "
                                    "--quantization fp8 --fp8-activations --kv-cache-dtype fp8 --profile-at 2",
                                    "tune_grouped_gemm --tokens 1",
                                    "tune_grouped_gemm --tokens 1 --configs '32x32 w4 s1,32x32 w4 s1 by block'",
                                    "grouped_gemm_variants --tokens 1", "bench_fp8_linear",
                                    "profile_verify", "step_padding --trace chat", "bench_server_host"])
def test_smoke_run(module, tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), JAX_PLATFORMS="cpu")
    module, *args = shlex.split(module)
    result = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args, "--smoke"], check=False, cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if module in ("bench_serving", "bench_speculative"):       # the warm-up's compiles, one line each
        assert "compiled step 1/" in result.stderr, result.stderr[-3000:]
    if "--section" in args:                          # the section it was told to write, in $OUT
        assert (tmp_path / f"{args[args.index('--section') + 1]}_results.md").exists()


def test_serving_profile_window_groups_kernels_by_kind():
    import collections

    from benchmarks.bench_serving import StepWindow, kernel_rows

    window = StepWindow(40, 2)
    window.first, window.last = 40, 42
    window.events = {"gemm_fusion_dot_3": (3e-3, 4.0), "nvjet_hsh_128x256": (1e-3, 2.0), "xqa_kernel": (3e-4, 1.0),
                     "mla_decode_kernel": (2e-4, 1.0), "loop_add_fusion": (5e-4, 6.0)}
    window.span_s = 6.25e-3
    rows = kernel_rows(window, collections.Counter({"mixed": 2}), top=2)
    assert "steps 40-41 of the trace (2 mixed)" in rows[1]
    assert "| GEMM | 4.00 | 80% | 6 |" in rows and "| attention | 0.50 | 10% | 2 |" in rows
    assert "| total | 5.00 | 100% | 14 |" in rows
    assert any(row.startswith("GPU span per step") and "6.25 ms, 80% of it in kernels" in row for row in rows)
    assert rows[-2:] == ["| `gemm_fusion_dot_3` | GEMM | 3.000 | 4 |",
                         "| `nvjet_hsh_128x256` | GEMM | 1.000 | 2 |"]


def test_profile_calls_splits_backend_kernels_from_the_per_call_work():
    from benchmarks.profile_calls import split_events

    events = {"kernel_mha": (9e-6, 1.0), "cudnn_generated_fort_native_sdpa_sm90_knob_7": (1e-3, 1.0),
              "loop_select_fusion": (2e-6, 1.0), "input_reduce_fusion_3": (1e-6, 2.0),
              "wrapped_concatenate": (3e-6, 1.0), "sanitize_kernel": (1.5e-6, 1.0),
              "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90": (5e-6, 1.0)}
    split = split_events(events)
    assert split["kernel"] == pytest.approx(1e-3 + 14e-6) and split["kernel_launches"] == 3
    assert split["per_call"] == pytest.approx(7.5e-6) and split["per_call_launches"] == 5
    assert [name for _, name in split["top_per_call"]] == ["wrapped_concatenate", "loop_select_fusion", "sanitize_kernel"]


def test_profile_calls_workload_names_keep_bracketed_commas():
    from benchmarks.bench_jax_peers import WORKLOADS
    from benchmarks.profile_calls import workload_names

    names = [w.name for w in WORKLOADS]
    assert workload_names(",".join(names)) == names and any("," in name for name in names)
    assert workload_names("") == []


def test_tune_auto_smoke_writes_a_table_auto_can_read(tmp_path):
    """tune_auto's CPU smoke run: its table (the backends that run here: xla) loads, one entry per
    bucket, and the RESULTS.md section goes to $OUT only."""
    from jaxattn import choice_table

    results = open(os.path.join(REPO, "benchmarks", "RESULTS.md")).read()
    env = dict(os.environ, OUT=str(tmp_path), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "benchmarks.tune_auto", "--smoke"], check=False, cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = choice_table.load(str(tmp_path / "cpu.json"))
    assert table.arch == "cpu" and table.command == "python -m benchmarks.tune_auto --smoke"
    assert len(table.entries) == 5 and {entry.order for entry in table.entries} == {("xla",)}
    assert {entry.key.layout for entry in table.entries} == {"HND", "NHD", ""}
    assert [entry.key.op for entry in table.entries].count("mla_prefill") == 1
    assert "| decode B=2 kv=128 | 2, 128, 2 |" in (tmp_path / "auto-table_results.md").read_text()
    assert open(os.path.join(REPO, "benchmarks", "RESULTS.md")).read() == results
    assert not os.path.exists(os.path.join(choice_table.TABLE_DIR, "cpu.json"))


def test_tune_auto_resumes_a_sweep_across_runs(tmp_path):
    """A sweep cut short by its budget saves its rows; a --resume run keeps them, measures the rest,
    and writes one table of all the workloads, its comment naming the earlier run."""
    from jaxattn import choice_table

    env = dict(os.environ, OUT=str(tmp_path), JAX_PLATFORMS="cpu")
    rows = str(tmp_path / "rows.json")
    run = lambda *args: subprocess.run([sys.executable, "-m", "benchmarks.tune_auto", "--smoke", "--rows", rows, *args],  # noqa: E731
                                       check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    first = run("--budget-s", "1")                    # the first workload starts, and outlasts the budget
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    saved = json.load(open(rows))
    measured = len(saved["rows"])
    assert 1 <= measured < 5 and [len(r["workloads"]) for r in saved["runs"]] == [measured]
    second = run("--resume")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    saved = json.load(open(rows))
    assert [len(r["workloads"]) for r in saved["runs"]] == [measured, 5 - measured] and len(saved["rows"]) == 5
    table = choice_table.load(str(tmp_path / "cpu.json"))
    assert len(table.entries) == 5
    assert table.comment == (f"resumed from earlier runs on this machine: {measured} workloads by "
                             f"`python -m benchmarks.tune_auto --smoke --rows {rows} --budget-s 1` ({saved['runs'][0]['date']})")
    section = (tmp_path / "auto-table_results.md").read_text()
    assert "| decode B=2 kv=128 | 2, 128, 2 |" in section and "This run resumed from earlier runs" in section


def test_tune_auto_shards_merge_into_one_table(tmp_path):
    """Two --shard runs (one per GPU on a device) split the grid between them and write no table;
    a --merge run keeps both shards' rows, measures nothing more, and writes the table of all."""
    from jaxattn import choice_table

    env = dict(os.environ, OUT=str(tmp_path), JAX_PLATFORMS="cpu")
    run = lambda *args: subprocess.run([sys.executable, "-m", "benchmarks.tune_auto", "--smoke", *args],  # noqa: E731
                                       check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    shards = [str(tmp_path / f"rows_{k}.json") for k in (1, 2)]
    for k, rows in enumerate(shards, start=1):
        result = run("--shard", f"{k}/2", "--rows", rows)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not (tmp_path / "cpu.json").exists()
    names = [[r["workload"] for r in json.load(open(rows))["rows"]] for rows in shards]
    assert len(names[0]) == 3 and len(names[1]) == 2 and not set(names[0]) & set(names[1])
    merged = run("--rows", str(tmp_path / "rows.json"), "--merge", *shards)
    assert merged.returncode == 0, merged.stdout[-3000:] + merged.stderr[-3000:]
    saved = json.load(open(tmp_path / "rows.json"))
    assert [len(r["workloads"]) for r in saved["runs"]] == [3, 2, 0] and len(saved["rows"]) == 5
    table = choice_table.load(str(tmp_path / "cpu.json"))
    assert len(table.entries) == 5 and table.comment.count("--shard") == 2


def test_tune_auto_extends_a_table_with_the_buckets_it_measures(tmp_path):
    """--only measures the workloads whose name holds the text; --extend writes the table at its path
    with those buckets replaced and its other entries kept, and says so in its comment."""
    from jaxattn import choice_table

    env = dict(os.environ, OUT=str(tmp_path), JAX_PLATFORMS="cpu")
    run = lambda *args: subprocess.run([sys.executable, "-m", "benchmarks.tune_auto", "--smoke", *args],  # noqa: E731
                                       check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    full = run("--rows", str(tmp_path / "all.json"))
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    before = choice_table.load(str(tmp_path / "cpu.json"))
    extended = run("--rows", str(tmp_path / "some.json"), "--only", "prefill", "--extend", "--section", "auto-extra")
    assert extended.returncode == 0, extended.stdout[-3000:] + extended.stderr[-3000:]
    assert [r["workload"] for r in json.load(open(tmp_path / "some.json"))["rows"]] == \
        ["prefill B=1 x 64", "mixed 1 decode + 64 prefill", "mla prefill B=1 x 64 Hq=4"]
    after = choice_table.load(str(tmp_path / "cpu.json"))
    assert {e.key for e in after.entries} == {e.key for e in before.entries}
    assert "extended by" in after.comment and "3 buckets" in after.comment
    assert (tmp_path / "auto-extra_results.md").exists()
    assert "no workload" in run("--only", "nothing like this").stderr


def test_engine_mixed_case_pads_like_the_engine():
    """An engine step's case: padding rows of no tokens, padding tokens past the last row, tables as
    wide as the engine's, and the engine's static max_q_len."""
    from benchmarks.common import Case, make_inputs

    case = Case.engine_mixed(3, 2, 16, 100, rows=8, tokens=48, capacity=512, prefill_chunk=32)
    x = make_inputs(case)
    assert x.q.shape[0] == 48 and x.meta.block_tables.shape == (8, 8) and x.meta.max_q_len == 32
    assert x.meta.cu_q_lens.tolist() == [0, 1, 2, 3, 19, 35, 35, 35, 35] and int(x.meta.num_decodes) == 3
    assert x.meta.kv_lens.tolist() == [100] * 3 + [115] * 2 + [0] * 3
    with pytest.raises(ValueError, match="does not fit"):
        Case.engine_mixed(7, 2, 16, 100, rows=8, tokens=48, capacity=512)
    decode = make_inputs(Case.engine_decode(5, 100, rows=8, capacity=512))
    assert decode.q.shape[0] == 8 and decode.meta.block_tables.shape == (8, 8) and decode.meta.max_q_len == 1
    assert decode.meta.kv_lens.tolist() == [100] * 5 + [0] * 3 and int(decode.meta.num_decodes) == 5


@pytest.mark.parametrize("shard", ["0/2", "3/2", "1", "a/b"])
def test_tune_auto_refuses_a_bad_shard(shard):
    from benchmarks import tune_auto

    with pytest.raises(argparse.ArgumentTypeError, match="--shard"):
        tune_auto.parse_shard(shard)


def test_tune_auto_resume_refuses_rows_of_another_machine(tmp_path):
    from benchmarks import tune_auto

    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"machine": {"device": "another GPU"}, "runs": [], "rows": []}))
    with pytest.raises(SystemExit, match="was measured on .*another GPU"):
        tune_auto.load_rows(str(path), {"device": "this one"}, {})


def test_tune_auto_times_split_plans_by_label(monkeypatch, tmp_path):
    """Where auto weighs a split, tune_auto times the backend whole ("xla") and split ("xla+xla"
    here: on CPU xla is the only backend, so the split is forced); the entry orders the labels,
    loads, and the section shows both times in one cell and auto's plan by the table."""
    from benchmarks import tune_auto
    from benchmarks.common import Case
    from jaxattn import choice_table, dispatch

    monkeypatch.setattr(dispatch, "split_route", lambda call, main: dispatch.Route(main, "xla"))
    row = tune_auto.measure(tune_auto.Workload("prefill", Case.prefill(1, 64)), rounds=1, calls_per_round=1)
    assert list(row.plans) == ["xla", "xla+xla"] and set(row.ms) == {"xla", "xla+xla"}
    assert row.split("xla") == dispatch.Route("xla", "xla") and set(row.errors) == {"xla+xla"}
    [entry] = tune_auto.entries([row])
    assert entry.order == tuple(sorted(row.ms, key=row.ms.get)) and entry.backend_order == ("xla",)
    table = choice_table.Table(arch="cpu", command="test", device="cpu", date="today", jax="0", entries=(entry,))
    choice_table.dump(table, str(tmp_path / "cpu.json"))
    assert choice_table.load(str(tmp_path / "cpu.json")) == table
    line = next(line for line in tune_auto.section([row], table, "cpu.json", []).splitlines()
                if line.startswith("| prefill"))
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[0:2] == ["prefill B=1 x 64", "1, 64, 64"] and cells[2].count(" / ") == 1
    assert cells[3:] == ["xla", "xla+xla", entry.order[0]]      # decodes to, auto by ranks (the rule), by table


def test_serving_traces():
    """bench_serving's traces: lengths fixed by the seed, the shapes the issue asks for."""
    from benchmarks.bench_serving import SPECS, make_trace

    heavy = make_trace("decode-heavy", SPECS["decode-heavy"], 1000)
    assert len(heavy) == 512 and {(r.prompt.size, r.new_tokens, r.arrival) for r in heavy} == {(1024, 1024, 0.0)}
    chat = make_trace("chat", SPECS["chat"], 1000)
    prompts, outputs = (np.array([r.prompt.size for r in chat]), np.array([r.new_tokens for r in chat]))
    assert len(chat) == 1000 and 200 < prompts.mean() < 240 and 185 < outputs.mean() < 215
    assert prompts.min() >= 4 and max(prompts.max(), outputs.max()) <= 1024
    again = make_trace("chat", SPECS["chat"], 1000)
    assert all((a.prompt == b.prompt).all() and a.new_tokens == b.new_tokens for a, b in zip(chat, again))
    shared = make_trace("shared-prefix", SPECS["shared-prefix"], 1000)
    assert all((r.prompt[:1024] == shared[0].prompt[:1024]).all() and 1056 <= r.prompt.size <= 1280 for r in shared)
    timed = make_trace("poisson", SPECS["poisson"], 1000, rate=50.0)
    arrivals = np.array([r.arrival for r in timed])
    assert (np.diff(arrivals) >= 0).all() and 15 < arrivals[-1] < 25           # 1000 requests at 50/s
    assert all((a.prompt == b.prompt).all() for a, b in zip(chat, timed))      # the chat trace, spread out
    throughput = make_trace("throughput", SPECS["throughput"], 1000)
    assert len(throughput) == 300 and {(r.prompt.size, r.new_tokens) for r in throughput} == {(1000, 1000)}


def test_serving_roofline_counts_the_experts_a_step_touches():
    """A mixture of experts' roofline (Qwen1.5-MoE shapes): dense weights every step, each routed
    expert once if the step touches it (the expectation under uniform routing), k experts' FLOPs
    per token."""
    from flax import nnx

    from benchmarks.bench_serving import model_costs, step_bound
    from jaxattn.serve.models.llama import PRESETS, Llama
    from jaxattn.serve.step import StepRecord

    cfg = PRESETS["qwen1.5-moe-a2.7b"]
    costs = model_costs(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0))), page_size=64)
    expert = 3 * 2048 * 1408
    assert costs.num_experts == 60 and costs.experts_per_token == 4
    assert costs.expert_params == 24 * expert and costs.expert_bytes == 2 * 24 * expert
    # attention (with q/k/v biases not counted as matmuls), router, gated shared expert
    dense = 24 * (4 * 2048 * 2048 + 2048 * 60 + 3 * 2048 * 5632 + 2048)
    assert costs.matmul_params == dense
    one = StepRecord(rows=1, decode_rows=1, tokens=1, prefill_tokens=0, context_tokens=0, attention_pairs=0,
                     padded_rows=0, padded_tokens=0, t_start=0.0)
    nbytes = costs.weight_bytes + 4 * costs.expert_bytes + 2048 * 2 + costs.kv_bytes_per_token
    assert step_bound(one, costs, copy_rate=1e12, matmul_rate=1e18) == pytest.approx(nbytes / 1e12)


def test_serving_roofline_of_a_fused_shared_expert():
    """A DeepSeek whose shared expert joined the expert stacks (fusion) has the unfused model's costs."""
    from flax import nnx

    from benchmarks.bench_serving import model_costs
    from jaxattn.serve.models import fusion
    from jaxattn.serve.models.deepseek import PRESETS, DeepSeek

    cfg = PRESETS["tiny"].replace(num_experts=4, num_experts_per_tok=2, moe_hidden_dim=32, shared_expert_dim=64,
                                  first_k_dense_replace=1)
    model = DeepSeek(cfg, nnx.Rngs(0))
    fusion.fuse_projections(model, shards=2)              # the MLPs' gate / up fused only
    expected = model_costs(model, page_size=16)
    fusion.fuse_projections(model)
    assert model.layers[1].mlp.fused_shared_experts == 2
    assert model_costs(model, page_size=16) == expected


def test_serving_roofline():
    """bench_serving's roofline at Llama-3-8B shapes (abstract weights) and its busy-share estimate."""
    from flax import nnx

    from benchmarks.bench_serving import busy_share, model_costs, step_bound
    from jaxattn.serve.models.llama import PRESETS, Llama
    from jaxattn.serve.step import StepRecord

    model = nnx.eval_shape(lambda: Llama(PRESETS["llama3-8b"], nnx.Rngs(0)))
    costs = model_costs(model, page_size=64)
    assert costs.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2                        # K and V, 32 layers, bf16
    assert costs.matmul_params == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert costs.head_params == 128256 * 4096 and costs.embed_row_bytes == 4096 * 2
    assert costs.weight_bytes == 2 * (costs.matmul_params + costs.head_params + 65 * 4096)   # + the norms

    def record(**fields) -> StepRecord:
        blank = {"rows": 0, "decode_rows": 0, "tokens": 0, "prefill_tokens": 0, "context_tokens": 0,
                 "attention_pairs": 0, "padded_rows": 0, "padded_tokens": 0, "t_start": 0.0}
        return StepRecord(**{**blank, **fields})

    # 64 decodes at context 4096: bandwidth-bound, weights + KV over the copy rate
    decode = record(rows=64, decode_rows=64, tokens=64, context_tokens=64 * 4096, attention_pairs=64 * 4096)
    nbytes = costs.weight_bytes + 64 * 8192 + 64 * 4097 * costs.kv_bytes_per_token
    assert step_bound(decode, costs, copy_rate=3e12, matmul_rate=7e14) == pytest.approx(nbytes / 3e12)
    # one 2048-token prefill: compute-bound
    prefill = record(rows=1, tokens=2048, prefill_tokens=2048, context_tokens=2048, attention_pairs=2048 * 2049 // 2)
    flops = 2 * costs.matmul_params * 2048 + 2 * costs.head_params + 4 * 32 * 32 * 128 * 2048 * 2049 // 2
    assert step_bound(prefill, costs, copy_rate=3e12, matmul_rate=7e14) == pytest.approx(flops / 7e14)

    # steps of 1 s from t=1: launched 0.1 s after the previous one's tokens came back, except one queued early
    steps = [record(t_launched=1.0, t_done=2.0), record(t_launched=2.1, t_done=3.1), record(t_launched=3.0, t_done=4.0)]
    assert busy_share(steps, start=0.0, wall=4.0) == pytest.approx(1 - (1.0 + 0.1) / 4.0)


def test_headline_is_up_to_date(tmp_path):
    """The committed RESULTS.md's headline table is what ``benchmarks.headline`` generates from its
    sections: on a copy, ``--check`` passes and a rewrite changes nothing; once a number in a
    section changes, ``--check`` fails and a rewrite carries the new number into the table."""
    from benchmarks import headline

    committed = open(os.path.join(REPO, "benchmarks", "RESULTS.md")).read()
    copy = tmp_path / "RESULTS.md"
    copy.write_text(committed)
    headline.main(["--check", "--file", str(copy)])
    headline.main(["--file", str(copy)])
    assert copy.read_text() == committed

    # The trtllm-decode section's target point: "| B=64 kv=U[2048,4096] | <us> (<TB/s>) | <xqa us> (...) |".
    section = committed[committed.index("<!-- trtllm-decode:begin -->"):committed.index("<!-- trtllm-decode:end -->")]
    row = next(line for line in section.splitlines() if line.startswith("| B=64 kv=U[2048,4096] | "))
    ours, xqa = (float(cell.split()[0]) for cell in row.split("|")[2:4])
    faster = f"| B=64 kv=U[2048,4096] | {ours / 2:.1f} "
    copy.write_text(committed.replace(row, row.replace(f"| B=64 kv=U[2048,4096] | {ours:.1f} ", faster)))
    with pytest.raises(SystemExit, match="stale"):
        headline.main(["--check", "--file", str(copy)])
    headline.main(["--file", str(copy)])
    assert f"| {ours / 2:.1f} us, trtllm | flashinfer xqa {xqa:.1f} us | {xqa / (ours / 2):.2f}x |" in copy.read_text()


def test_headline_takes_the_fastest_jax_peer_of_any_run():
    """A JAX-peers headline row: the fastest peer in any jax_peers section that has the workload
    (n/a rows, jaxattn's own other rows and other sections passed over), against jaxattn's number
    from that peer's run."""
    from benchmarks import headline

    def section(name: str, date: str, rows: list[tuple[str, str, str]]) -> str:
        lines = [f"Device: GPU; {date}; `python -m benchmarks.bench_jax_peers --section {name}`", "",
                 "| workload | implementation | GPU time / call |", "|---|---|---|"]
        lines += [f"| {w} | {peer} | {ms} |" for w, peer, ms in rows]
        return f"<!-- {name}:begin -->\n" + "\n".join(lines) + f"\n<!-- {name}:end -->\n\n"

    short, long = "prefill B=1 x 512", "prefill B=8 x 4096"
    doc = section("jax_peers", "2026-01-01", [
        (short, "jaxattn auto (fa4)", "0.040 ms"), (short, "jaxattn auto, run with a step's plan", "0.030 ms"),
        (short, "fa4-jax flash_attn_varlen", "0.050 ms"),
        (short, "ejkernel page_attention", "n/a"),
        (long, "jaxattn auto (cudnn)", "2.000 ms"), (long, "fa4-jax flash_attn_varlen", "2.100 ms")]) + \
        section("jax_peers_fa3", "2026-01-02", [(long, "jaxattn auto", "2.200 ms"),
                                                 (long, "flash-attn3-jax splits=1", "2.050 ms")]) + \
        section("other", "2026-01-03", [(long, "jaxattn auto", "1.000 ms"), (long, "elsewhere", "0.100 ms")])
    found = headline.sections(doc)

    def line(workload: str) -> str:
        return headline.render_row(headline.Row("w", shape="s", **headline.jax_peers(workload)), found)

    assert "| 2.200 ms, jaxattn auto | flash-attn3-jax splits=1 2.050 ms | 0.93x | GPU | 2026-01-02 | " \
           "jax_peers_fa3: `bench_jax_peers --section jax_peers_fa3` |" in line(long)
    assert "| 0.040 ms, jaxattn auto (fa4) | fa4-jax flash_attn_varlen 0.050 ms | 1.25x | GPU | 2026-01-01 |" \
        in line(short)
    with pytest.raises(LookupError, match="jax_peers"):
        line("decode B=1 kv=4096")


@pytest.mark.parametrize("flags", [[], ["--fp8"]], ids=["bf16", "fp8"])
def test_tune_mla_candidates_compile_for_sm90(tmp_path, flags):
    """tune_mla's compile phase (CPU processes, no GPU): every point's quick candidates build, over
    bf16 and FP8 latents."""
    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip(f"no {ptxas}")
    env = dict(os.environ, OUT=str(tmp_path), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "benchmarks.tune_mla", "--quick", "--compile-only", *flags],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "failed: none" in result.stdout


def test_serving_breakdown_by_step_kind():
    """bench_serving's time by step kind: each step's time from the step before's tokens to its
    own, its kind from its rows, the padding its compiled shape added."""
    from flax import nnx

    from benchmarks.bench_serving import breakdown, model_costs
    from jaxattn.serve.models.llama import PRESETS, Llama
    from jaxattn.serve.step import StepRecord

    costs = model_costs(nnx.eval_shape(lambda: Llama(PRESETS["tiny"], nnx.Rngs(0))), page_size=8)

    def record(decode_rows, prefill_tokens, padded_tokens, t_done):
        rows = decode_rows + bool(prefill_tokens)
        return StepRecord(rows=rows, decode_rows=decode_rows, tokens=decode_rows + prefill_tokens,
                          prefill_tokens=prefill_tokens, context_tokens=0, attention_pairs=0, padded_rows=4,
                          padded_tokens=padded_tokens, t_start=0.0, t_done=t_done)

    records = [record(0, 64, 64, 1.0), record(2, 30, 64, 1.5), record(4, 0, 4, 2.0), record(2, 0, 4, 4.0)]
    rows = breakdown({"records": records, "start": 0.0, "wall_s": 4.0}, costs, 1e12, 1e15)
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in rows]
    assert [c[:4] for c in cells] == [["decode only", "2", "2.50", "62%"], ["mixed", "1", "0.50", "12%"],
                                      ["prefill only", "1", "1.00", "25%"]]
    assert [c[5:] for c in cells] == [["6", "25%", "25%"], ["32", "50%", "25%"], ["64", "0%", "75%"]]


def test_mixed_step_decodes_and_prefills_in_a_padded_step():
    """engine_step.mixed_step (profile_step --mixed) on a tiny model: decodes and prompt chunks in a
    step padded to a bucket, chained; its record counts what the step needed and its roofline is
    bench_serving's; --mixed specs parse and a bad one names the flag."""
    import jax
    from flax import nnx

    from benchmarks.engine_step import mixed_step, step_record
    from benchmarks.profile_step import mixed_shapes, parse_mixed, step_bounds
    from jaxattn.serve.models.llama import PRESETS, Llama

    model = Llama(PRESETS["tiny"].replace(num_layers=2), nnx.Rngs(0))
    model_step, state, _, record = mixed_step(model, "xla", rows=6, tokens=40, decodes=3, chunks=2, chunk=16,
                                              context=20, max_seq_len=64, max_q_len=32)
    assert (record.rows, record.decode_rows, record.tokens, record.prefill_tokens) == (5, 3, 35, 32)
    assert record.context_tokens == 3 * 20 + 2 * (19 + 16)
    assert record.attention_pairs == 3 * 20 + 2 * (16 * 19 + 16 * 17 // 2)
    for _ in range(3):
        state = model_step(state)
    tokens, _, table = jax.block_until_ready(state)
    assert tokens.shape == (6,) and table.block_tables.shape[1] * table.page_size >= 64
    assert list(np.asarray(table.seq_lens)[:6]) == [19] * 6          # every call redoes the same step
    roofline, bounds = step_bounds(model, record, copy_rate=1e12, matmul_rate=1e14)
    assert roofline >= max(bounds.values()) > 0
    # a decode step's GEMMs: the weight read below the ridge, 2 x params x rows FLOPs above it
    small, big = (step_bounds(model, step_record(b, 0, 1, 512, b, b), 1e12, 1e9)[1]["GEMM"] for b in (128, 256))
    assert big == pytest.approx(2 * small)
    low, high = (step_bounds(model, step_record(b, 0, 1, 512, b, b), 1e12, 1e18)[1]["GEMM"] for b in (128, 256))
    assert low == high > 0
    assert parse_mixed("155+1x512, 124+32x16") == [(155, 1, 512), (124, 32, 16)]
    with pytest.raises(ValueError, match="--mixed"):
        parse_mixed("155x512")
    assert mixed_shapes("155+1x512,28+4x256", rows=156, max_step_tokens=2048) == [(155, 1, 512, 668),
                                                                                   (28, 4, 256, 1180)]
    with pytest.raises(ValueError, match="--mixed: 100\\+2x1024 is more than 2048 tokens"):
        mixed_shapes("100+2x1024", rows=156, max_step_tokens=2048)
    with pytest.raises(ValueError, match="mixed_step"):
        mixed_step(model, "xla", rows=4, tokens=40, decodes=3, chunks=2, chunk=16, context=20, max_seq_len=64)
    with pytest.raises(ValueError, match="max_q_len=8"):
        mixed_step(model, "xla", rows=6, tokens=40, decodes=3, chunks=2, chunk=16, context=20, max_seq_len=64,
                   max_q_len=8)
    with pytest.raises(ValueError, match="max_seq_len=32"):
        mixed_step(model, "xla", rows=6, tokens=40, decodes=3, chunks=2, chunk=16, context=20, max_seq_len=32)


def test_decode_step_tables_as_wide_as_asked():
    """engine_step.decode_step (profile_step's decode path): block tables as wide as the context
    needs, or ``width`` keys (an engine's max_seq_len, what ``auto`` chooses by); profile_step
    refuses a non-positive --max-seq-len before measuring anything."""
    from flax import nnx

    from benchmarks import profile_step
    from benchmarks.engine_step import decode_step
    from jaxattn.serve.models.llama import PRESETS, Llama

    model = Llama(PRESETS["tiny"].replace(num_layers=1), nnx.Rngs(0))
    widths = []
    for width in (0, 4096):
        _, (_, _, table, _), _, _ = decode_step(model, "xla", batch=2, context=20, steps=1, width=width)
        widths.append(table.block_tables.shape[1] * table.page_size)
    assert widths[0] < 4096 <= widths[1]
    with pytest.raises(SystemExit):
        profile_step.main(["--max-seq-len", "0"])


def test_tune_triton_decode_points():
    """tune_triton --decode-points: BxKV points parse (a bad one names the flag), and each point's
    plan times decode + reduce launches over 1 to 128 KV segments at B <= 4."""
    from benchmarks.tune_triton import decode_plans, parse_decode_points

    points = parse_decode_points("1x4096, 4x512")
    assert points == [("decode B=1 x kv 4096", 1, 4096), ("decode B=4 x kv 512", 4, 512)]
    with pytest.raises(ValueError, match="--decode-points"):
        parse_decode_points("1x")
    plans = decode_plans(128, points, quick=False)
    for (_, batch, _), (_, _, _, num_decodes, rows, _) in zip(points, plans):
        launches = [launches for _, launches in rows]
        assert num_decodes == batch and len(rows) == 48
        assert {dict(decode.constants)["NSEG"] for decode, _ in launches} == {1, 2, 4, 8, 16, 32, 64, 128}
        assert all(decode.grid == (batch, 8, dict(decode.constants)["NSEG"]) and reduce.kernel.endswith("reduce_kernel")
                   for decode, reduce in launches)


def test_esurge_table_takes_jaxattn_row_from_bench_serving_section(tmp_path, capsys):
    """bench_esurge reads the row to compare with from bench_serving's section of the same call:
    the first row (published rows come after it), or shared-prefix's caching-on row; and the
    sequences in flight its header names (eSurge's default); a time limit that is not > 0 is a usage error."""
    from benchmarks.bench_esurge import jaxattn_row, main, sequences_in_flight

    section = tmp_path / "serving_chat_results.md"
    section.write_text("<!-- serving_chat:begin -->\nDevice: H100; date 2026-11-28\n\n"
                       "| trace shape | requests | generated tokens/s | TPOT ms p50 / p90 / p99 |\n|---|---|---|---|\n"
                       "| lognormal | 1,000 | 8,066 | 17.1 / 20.0 / 22.3 |\n"
                       "| published, not our run: vLLM | 1,000 | 12,600 | - |\n<!-- serving_chat:end -->\n")
    header, cells = jaxattn_row(str(section))
    assert header.startswith("Device: H100") and cells["generated tokens/s"] == "8,066"
    assert cells["TPOT ms p50 / p90 / p99"] == "17.1 / 20.0 / 22.3"
    section.write_text("Device: cpu\n| prefix caching | generated tokens/s |\n|---|---|\n| off | 10 |\n| on | 12 |\n")
    assert jaxattn_row(str(section), "on")[1]["generated tokens/s"] == "12"
    assert jaxattn_row(str(section), "neither") is None
    assert jaxattn_row(str(tmp_path / "missing.md")) is None
    assert sequences_in_flight("Device: NVIDIA H200; backend auto; 256 sequences in flight, 2048 tokens") == 256
    assert sequences_in_flight("Device: cpu") is None
    for limit in ("0", "-5", "nan"):
        with pytest.raises(SystemExit):
            main(["--trace", "chat", "--time-limit-s", limit])
    assert "--time-limit-s must be a number of seconds > 0, got nan" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--pairs", "0"], ["--streams", "-1"], ["--new-tokens", "x"],
                                   ["--logprobs-share", "1.5"], ["--json-share", "nan"]])
def test_bench_server_host_bad_flags_are_usage_errors(flags, capsys):
    from benchmarks.bench_server_host import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(flags)
    assert flags[0] in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--engine-modes", "proces"], ["--engine-modes", "thread,thread"],
                                   ["--engine-modes", ""], ["--repeats", "0"]])
def test_bench_http_bad_flags_are_usage_errors(flags, capsys):
    from benchmarks.bench_http import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(flags)
    assert flags[0] in capsys.readouterr().err
