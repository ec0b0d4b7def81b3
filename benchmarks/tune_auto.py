"""auto's choice table: every backend that takes each call of a grid of workloads, timed, and the
table ``auto`` reads written (``jaxattn/tuning/<arch>.json``), one device run.

    python -m benchmarks.tune_auto [--budget-s 420] [--rounds 3] [--out PATH] [--smoke]

Workloads (bf16, Hq=32, Hkv=8, D=128, page 64, causal, HND pages in a randomly permuted pool, unless
the name says NHD or fp8 pages), in this order, until the budget is spent: the issue's points
(decode B=64 kv U[2048,4096] and 4096, B=256 kv 4096, B=1/2/4 x kv 4096-131072; speculative decode
B=64 x 4 tokens; prefill B=8 x 4096 and B=1 x 512; chunked prefill B=4 x 300 new tokens over 1200;
a mixed batch of 63 decodes at 4096 and an 8192-token prefill), then the decode grid B in {1, 4,
16, 64, 256} x kv in {512, ..., 65536} (B x kv <= 2**22 tokens), then a few more speculative-decode
and prefill points, NHD pages and fp8 pages, then the engine's mixed steps (Llama-3-8B serving
chat: 156 rows padded, 284-2048 tokens, ``max_q_len`` min(T, 512), tables 2048 keys wide).
``mla_prefill`` at DeepSeek's dims (B=8 x 4096 at 128 and 16 query heads among the issue's points; B=1 x 512, chunked B=4 x 300 over 1200 and B=1 x 4096
after), each backend whole, the query whole (``[T, Hq, Dn + Dr]``, as the model passes it).

Each workload's candidates are the backends that rank its call (``dispatch.rank_order``) and can
take it here. Each candidate X runs whole (plan label "X") and, where ``auto`` weighs a split for
it (``jaxattn.dispatch.split_route``: a step that is not decode-only, the leading decodes to the
backend D that ``auto`` picks for decodes), also split ("D+X"), so the table says which is faster.
Time: GPU busy time per call from the profiler (``benchmarks.common.device_seconds``: every kernel
of the call, metadata sanitizing included), median of ``--rounds`` rounds of 10 calls that
interleave the plans, after a warm-up call; a plan slower than 0.2 s a call is timed once.
Workloads of one bucket (``jaxattn.choice_table.Key``) make one entry, its plans ordered by their
times summed over those workloads (those that failed last).

Writes the table (``--out``, default ``jaxattn/tuning/<arch>.json``) and the auto-table section of
benchmarks/RESULTS.md. ``--smoke`` (CPU, seconds): a tiny grid on the backends that run here (xla),
the table to ``$OUT/<arch>.json`` (or a temporary directory) and the section only to ``$OUT``.

The whole grid takes longer than one device call may run. Every measured workload is saved to
``--rows`` (default ``$OUT/tune_auto_rows.json``) as it finishes; a later run with ``--resume`` on
the same machine (device, jax) keeps that file's workloads, measures the rest, and writes the
table and section of them all (the table's ``comment`` names the earlier runs):

    python -m benchmarks.tune_auto --budget-s 500 --rows /tmp/rows.json            # one call
    python -m benchmarks.tune_auto --budget-s 500 --rows /tmp/rows.json --resume   # the next

On a machine of several GPUs of one kind, ``--shard K/N`` measures every N-th workload (from the
K-th) and saves its rows without writing a table, one process per GPU; a last run merges their
rows (``--merge``, same machine) and writes the table:

    for k in 1 2 3 4; do CUDA_VISIBLE_DEVICES=$((k-1)) python -m benchmarks.tune_auto --shard $k/4 \
        --rows /tmp/rows_$k.json & done; wait
    python -m benchmarks.tune_auto --rows /tmp/rows.json --merge /tmp/rows_[1-4].json --device-table

``--only TEXT,...`` measures the workloads whose name holds one of the texts, and ``--extend``
writes them into the table already at its path (their buckets replaced or added, the other entries kept):

    python -m benchmarks.tune_auto --only "engine mixed" --device-table --extend --section auto-table-engine

A bucket holds every workload measured into it, its plans ranked by their summed times: to weigh the
engine's decode-only steps against the grid's full-length decodes of the same bucket, measure both
(``--only "engine decode,decode B=256 kv=2048"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import jax

import jaxattn
from benchmarks.common import (HERE, MLA_SCALE, D, Budget, Case, Inputs, MLAPrefillInputs, command_line, device_name,
                               device_seconds, fp8_inputs, make_inputs, mla_prefill_inputs, rel_error, utc_now,
                               write_section)
from jaxattn import attention, attention_plan, backends, choice_table, dispatch
from jaxattn.backends.base import AttentionParams, Call

PARAMS = AttentionParams(scale=1 / math.sqrt(D), causal=True, sliding_window=None, softcap=None, has_sinks=False)
MLA_PARAMS = dataclasses.replace(PARAMS, scale=MLA_SCALE)
CALLS_PER_ROUND = 10
SLOW_CALL_S = 0.2
MAX_GRID_TOKENS = 2**22        # B x kv of a grid point: K and V pools of 17 GB at the standard shape


@dataclasses.dataclass(frozen=True)
class Workload:
    """A case, what kind of step it is (its name's first words), and its pages' layout and dtype;
    with ``mla_heads``, an ``mla_prefill`` call at DeepSeek's dims with that many query heads."""

    kind: str
    case: Case
    layout: str = "HND"
    fp8: bool = False
    mla_heads: int | None = None

    @property
    def name(self) -> str:
        return " ".join([self.kind, self.case.name] + (["NHD"] if self.layout == "NHD" else []) +
                        (["fp8 pages"] if self.fp8 else []) +
                        ([f"Hq={self.mla_heads}"] if self.mla_heads else []))

    def inputs(self) -> Inputs | MLAPrefillInputs:
        if self.mla_heads:
            return mla_prefill_inputs(self.case, self.mla_heads)
        x = make_inputs(self.case)
        if self.fp8:
            x = fp8_inputs(x)
        if self.layout == "NHD":
            cache = x.cache
            x = dataclasses.replace(x, cache=dataclasses.replace(
                cache, k_pages=cache.k_pages.swapaxes(1, 2), v_pages=cache.v_pages.swapaxes(1, 2), layout="NHD"))
        return x


def decode(batch: int, kv_len: int, ragged: bool = False, **pages) -> Workload:
    return Workload("decode", Case.decode(batch, kv_len, ragged), **pages)


def mla_prefill(heads: int, batch: int, q_len: int, kv_len: int | None = None) -> Workload:
    return Workload("mla chunked prefill" if kv_len else "mla prefill", Case.prefill(batch, q_len, kv_len),
                    mla_heads=heads)


def spec_decode(batch: int, q_len: int, kv_len: int) -> Workload:
    case = Case.decode(batch, kv_len, q_len=q_len)
    return Workload("spec decode", dataclasses.replace(case, name=f"B={batch} x {q_len} kv={kv_len}"))


ISSUE = [
    decode(64, 4096, ragged=True), decode(64, 4096), decode(256, 4096),
    *(decode(b, kv) for b in (1, 2, 4) for kv in (4096, 16384, 131072)),
    spec_decode(64, 4, 4096),
    Workload("prefill", Case.prefill(8, 4096)), Workload("prefill", Case.prefill(1, 512)),
    Workload("chunked prefill", Case.prefill(4, 300, 1200)),
    Workload("mixed", Case("63 decodes + 8192 prefill", (1,) * 63 + (8192,), (4096,) * 63 + (8192,))),
    mla_prefill(128, 8, 4096), mla_prefill(16, 8, 4096),
]
GRID = [decode(b, kv) for b in (1, 4, 16, 64, 256) for kv in (512, 1024, 2048, 4096, 16384, 65536)
        if b * kv <= MAX_GRID_TOKENS]
MORE = [
    spec_decode(64, 16, 4096), spec_decode(8, 4, 4096), spec_decode(256, 4, 2048),
    Workload("prefill", Case.prefill(1, 4096)), Workload("prefill", Case.prefill(1, 16384)),
    Workload("chunked prefill", Case.prefill(16, 512, 4096)),
    decode(64, 4096, layout="NHD"), decode(1, 16384, layout="NHD"), Workload("prefill", Case.prefill(8, 4096), "NHD"),
    decode(64, 4096, fp8=True), decode(1, 16384, fp8=True), decode(4, 131072, fp8=True), decode(256, 4096, fp8=True),
    mla_prefill(128, 1, 512), mla_prefill(128, 4, 300, 1200), mla_prefill(16, 1, 4096),
]
# The engine's mixed steps as Llama-3-8B serves chat (bench_serving): 156 rows (max_seqs), the
# token buckets of ``jaxattn.serve.step.mixed_buckets(156, 2048)`` with max_q_len min(T, 512),
# tables 2048 keys wide (max_seq_len), decodes and prompt chunks at chat's contexts. Then its
# decode-only steps (rows 128 and 256, ``StepBuckets.default``): the same 2048-key tables, whose
# rows read far fewer keys than the grid's decodes of the same bucket (every row as long as the
# table), the case where the backends part (RESULTS.md, step_profile_width).
ENGINE = [Workload("engine mixed", Case.engine_mixed(decodes, chunks, chunk, context, 156, tokens, 2048))
          for decodes, chunks, chunk, context, tokens in (
              (155, 1, 128, 512, 284), (150, 2, 64, 256, 412), (155, 1, 512, 512, 668), (124, 32, 16, 512, 668),
              (28, 4, 256, 512, 1180), (36, 60, 32, 256, 2048))] + [
    Workload("engine decode", Case.engine_decode(decodes, context, rows, 2048))
    for decodes, context, rows in ((100, 256, 128), (100, 512, 128), (200, 256, 256), (200, 512, 256),
                                   (256, 1024, 256))]
SMOKE = [decode(2, 128), decode(2, 128, layout="NHD"), Workload("prefill", Case.prefill(1, 64)),
         Workload("mixed", Case("1 decode + 64 prefill", (1, 64), (128, 64))), mla_prefill(4, 1, 64)]


def workloads(smoke: bool) -> list[Workload]:
    """The run's workloads in order, each name once."""
    if smoke:
        return SMOKE
    return list({w.name: w for w in ISSUE + GRID + MORE + ENGINE}.values())


@dataclasses.dataclass
class Row:
    """One workload's measurements: its bucket, the backends that rank its call (``by_rank``, rank
    order) and those of them that take it here (the candidates), the plans timed by label (each
    candidate whole, and split where ``auto`` weighs a split), ms per label (None: failed), each
    plan's relative error against the reference plan, and notes."""

    workload: Workload
    key: choice_table.Key
    by_rank: list[str]
    candidates: list[str]
    plans: dict[str, dispatch.Route]
    ms: dict[str, float | None] = dataclasses.field(default_factory=dict)
    reference: str | None = None
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def split(self, main: str) -> dispatch.Route | None:
        """The split plan timed with ``main`` as the main backend, or None."""
        return next((plan for plan in self.plans.values() if plan.main == main and plan.decode), None)


def plan_call(plan: dispatch.Route, x: Inputs | MLAPrefillInputs) -> Callable[[], jax.Array]:
    """A zero-argument call of ``plan`` on ``x``, jitted as ``paged_attention`` given bare metadata
    runs it (planned per call); MLA inputs: ``mla_prefill`` on the plan's backend."""
    if isinstance(x, MLAPrefillInputs):
        fn = jax.jit(lambda *args: jaxattn.mla_prefill(*args, scale=MLA_SCALE, backend=plan.main))
        return lambda: fn(*x.args)

    def run(q, cache, meta):
        call = Call("paged_attention", q, cache, meta, PARAMS)
        return attention.run(q, cache, attention_plan.build(call, "auto", route=plan), None)

    fn = jax.jit(run)
    return lambda: fn(x.q, x.cache, x.meta)


def measure(w: Workload, rounds: int, calls_per_round: int) -> Row:
    """Times every plan of ``w``'s candidates (module docstring) in interleaved rounds."""
    x = w.inputs()
    if isinstance(x, MLAPrefillInputs):
        call = attention_plan.mla_call("mla_prefill", x.q, None, x.cache, x.meta, MLA_PARAMS, x.w_uv)
    else:
        call = Call("paged_attention", x.q, x.cache, x.meta, PARAMS)
    by_rank = dispatch.rank_order(call)
    names = [name for name in by_rank if backends.check(name, call) is None]
    split = dispatch.split_route if call.op == "paged_attention" else lambda call, name: None
    plans = {plan.label: plan for name in names
             for plan in (dispatch.Route(name), split(call, name)) if plan is not None}
    row = Row(w, choice_table.Key.of(call), by_rank, names, plans)
    runs, outputs, slow = {}, {}, {}
    for label, plan in plans.items():
        try:
            run = plan_call(plan, x)
            outputs[label] = jax.block_until_ready(run())
            start = time.perf_counter()
            jax.block_until_ready(run())
            if time.perf_counter() - start > SLOW_CALL_S:
                slow[label] = device_seconds(run, 1)
            else:
                runs[label] = run
        except Exception as err:  # noqa: BLE001 - a plan failing is a result of the sweep
            row.ms[label] = None
            row.notes.append(f"{label} failed: {' '.join(str(err).split())[:160]}")
            traceback.print_exc(file=sys.stderr)
    times = {label: [] for label in runs}
    for _ in range(rounds):
        for label, run in runs.items():
            times[label].append(device_seconds(run, calls_per_round))
    for label in plans:
        if label in times or label in slow:
            row.ms[label] = 1e3 * (statistics.median(times[label]) if label in times else slow[label])
    row.reference = "xla" if "xla" in outputs else next(iter(outputs), None)
    for label, out in outputs.items():
        if label != row.reference:
            row.errors[label] = rel_error(out, outputs[row.reference])
    return row


def entries(rows: list[Row]) -> list[choice_table.Entry]:
    """One entry per bucket: its plans by their times summed over the bucket's workloads (a plan
    that failed or was not timed in one of them goes last)."""
    buckets: dict[choice_table.Key, list[Row]] = {}
    for row in rows:
        buckets.setdefault(row.key, []).append(row)
    result = []
    for key, group in buckets.items():
        labels = list(dict.fromkeys(label for row in group for label in row.ms))
        total = {label: (sum(row.ms[label] for row in group)
                         if all(row.ms.get(label) is not None for row in group) else None) for label in labels}
        timed = sorted((label for label in labels if total[label] is not None), key=total.get)
        result.append(choice_table.Entry(
            key=key, order=tuple(timed + [label for label in labels if total[label] is None]),
            ms={label: None if t is None else round(t, 4) for label, t in total.items()},
            workloads=tuple(row.workload.name for row in group)))
    return result


def auto_choice(row: Row, order: list[str], entry: choice_table.Entry | None) -> str:
    """The label of the plan ``auto`` makes for ``row``'s call with backends tried in ``order`` and
    ``entry`` as the nearest table entry (None: the split rule), as ``dispatch.auto_route`` does."""
    main = next(name for name in order if name in row.candidates)
    split = row.split(main)
    if split is None or (entry is not None and entry.split_first(main, split.decode) is False):
        return main
    return split.label


def section(rows: list[Row], table: choice_table.Table, path: str, skipped: list[str]) -> str:
    """The RESULTS.md section: per workload, each plan's time and auto's plan by ranks and by the table."""
    columns = [name for name in backends.names("paged_attention") if any(name in row.ms for row in rows)]
    lines = [f"Device: {table.device}; jax {table.jax}; {table.date}; `{table.command}`; table: `{path}` "
             f"({len(table.entries)} entries). Time per call in ms (GPU busy time from the profiler; wall time on CPU), "
             f"median of interleaved rounds. Each backend runs whole; where auto weighs splitting a step's "
             f"leading decodes off to the backend it picks for decodes (column `decodes to`), also split: "
             f"a cell `whole / split`. Plans: `X` whole, `D+X` split. auto by ranks: the rank order's backend "
             f"with the split rule; by table: as auto reads the new table. Bucket: B, kv capacity "
             f"(table width x page), T, each rounded up to a power of 2.", "",
             "| workload | bucket (B, kv, T) | " + " | ".join(columns)
             + " | decodes to | auto by ranks | auto by table |",
             "|---" * (len(columns) + 5) + "|"]
    for row in rows:
        cells = [" / ".join(time_cell(row, plan.label) for plan in (dispatch.Route(name), row.split(name)) if plan)
                 if name in row.ms else "" for name in columns]
        decodes = next((plan.decode for plan in row.plans.values() if plan.decode), "")
        entry = table.nearest(row.key)
        by_table = row.by_rank if entry is None else choice_table.reorder(row.by_rank, entry.backend_order)
        lines.append(f"| {row.workload.name} | {row.key.seqs}, {row.key.capacity}, {row.key.tokens} | "
                     + " | ".join(cells)
                     + f" | {decodes} | {auto_choice(row, row.by_rank, None)} | {auto_choice(row, by_table, entry)} |")
    notes = [f"{row.workload.name}: " + ", ".join(
        row.notes + [f"{label} {err:.1e} vs {row.reference}" for label, err in row.errors.items()])
        for row in rows if row.notes or row.errors]
    if notes:
        lines += ["", "Notes (failures, relative errors between plans): " + "; ".join(notes) + "."]
    if table.comment:
        lines += ["", f"This run {table.comment}."]
    if skipped:
        lines += ["", "Not run (time budget): " + ", ".join(skipped) + "."]
    return "\n".join(lines)


def time_cell(row: Row, label: str) -> str:
    """``label``'s time in ``row`` for the section ("failed"; bold when it is the row's fastest plan)."""
    t = row.ms[label]
    if t is None:
        return "failed"
    fastest = min((other_t, other) for other, other_t in row.ms.items() if other_t is not None)[1]
    return f"**{t:.3f}**" if label == fastest else f"{t:.3f}"


def shown_path(path: str) -> str:
    """``path`` relative to the repository when it is in it."""
    repo = os.path.dirname(HERE)
    inside = os.path.commonpath([repo, os.path.abspath(path)]) == repo
    return os.path.relpath(path, repo) if inside else path


def row_json(row: Row) -> dict:
    return {"workload": row.workload.name, "key": row.key.to_json(), "by_rank": row.by_rank,
            "candidates": row.candidates, "plans": {label: [p.main, p.decode] for label, p in row.plans.items()},
            "ms": row.ms, "reference": row.reference, "errors": row.errors, "notes": row.notes}


def row_of(data: dict, by_name: dict[str, Workload]) -> Row:
    plans = {label: dispatch.Route(main, decode) for label, (main, decode) in data["plans"].items()}
    return Row(by_name[data["workload"]], choice_table.Key.from_json(data["key"]), data["by_rank"], data["candidates"], plans, data["ms"],
               data["reference"], data["errors"], data["notes"])


def load_rows(path: str, machine: dict, by_name: dict[str, Workload]) -> tuple[list[Row], list[dict]]:
    """The rows and runs saved in ``path`` (``save_rows``), which must come from this ``machine``."""
    with open(path) as f:
        data = json.load(f)
    if data["machine"] != machine:
        raise SystemExit(f"tune_auto: rows file {path} was measured on {data['machine']}, not this {machine}")
    unknown = [r["workload"] for r in data["rows"] if r["workload"] not in by_name]
    if unknown:
        raise SystemExit(f"tune_auto: rows file {path} has workloads this grid lacks: {unknown}")
    return [row_of(r, by_name) for r in data["rows"]], data["runs"]


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)`` with ``1 <= K <= N``."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard must be K/N, got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 1 <= K <= N, got {text!r}")
    return k, n


def save_rows(path: str, machine: dict, runs: list[dict], rows: list[Row]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"machine": machine, "runs": runs, "rows": [row_json(r) for r in rows]}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_auto", description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new workload after this")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per workload")
    parser.add_argument("--out", default=None, help="where the table goes (default: the shipped jaxattn/tuning/<arch>.json)")
    parser.add_argument("--rows", default=None,
                        help="where each measured workload is saved (default: $OUT, else benchmarks/out, tune_auto_rows.json)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the workloads saved in --rows by an earlier run on this machine; measure the rest")
    parser.add_argument("--shard", type=parse_shard, default=None, metavar="K/N",
                        help="measure every N-th workload from the K-th and save the rows only (no table)")
    parser.add_argument("--merge", nargs="+", default=[], metavar="ROWS",
                        help="also keep the workloads saved in these rows files (--shard runs on this machine)")
    parser.add_argument("--device-table", action="store_true",
                        help="name the table after this kind of GPU (jaxattn/tuning/<device kind>.json), which auto "
                             "reads before the arch's")
    parser.add_argument("--only", default=None, metavar="TEXT,...",
                        help="measure only the workloads whose name holds one of these texts (e.g. 'engine mixed')")
    parser.add_argument("--extend", action="store_true",
                        help="write the table at its path (--out, --device-table) with this run's buckets replaced or "
                             "added and its other entries kept")
    parser.add_argument("--section", default="auto-table", help="the RESULTS.md section it writes")
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny grid, written to $OUT or a temporary directory")
    args = parser.parse_args()
    arch = choice_table.current_arch()
    if arch is None and not args.smoke:
        sys.exit("tune_auto measures a GPU and none is visible to JAX (on CPU: --smoke)")
    arch = arch or "cpu"
    out_dir = choice_table.TABLE_DIR if not args.smoke else os.environ.get("OUT") or tempfile.mkdtemp()
    kind = choice_table.current_device_kind() or "cpu"
    name = choice_table.device_table_name(kind) if args.device_table else arch
    path = args.out or os.path.join(out_dir, f"{name}.json")
    rows_path = args.rows or os.path.join(os.environ.get("OUT") or os.path.join(HERE, "out"), "tune_auto_rows.json")
    only = None if args.only is None else [text for text in args.only.split(",") if text]
    grid = [w for w in workloads(args.smoke) if only is None or any(text in w.name for text in only)]
    if not grid:
        sys.exit(f"tune_auto: no workload's name holds --only {args.only!r}")
    by_name = {w.name: w for w in grid}
    machine = {"arch": arch, "device": device_name(), "jax": jax.__version__, "rounds": args.rounds, "smoke": args.smoke}
    measured, runs = load_rows(rows_path, machine, by_name) if args.resume else ([], [])
    for merged_path in args.merge:
        merged_rows, merged_runs = load_rows(merged_path, machine, by_name)
        measured += merged_rows
        runs += merged_runs
    done = {row.workload.name: row for row in measured}
    runs.append({"command": command_line(), "date": utc_now(), "workloads": []})
    save_rows(rows_path, machine, runs, measured)      # this run is on file even if it measures nothing
    budget = Budget(args.budget_s)
    rounds, calls = (1, 2) if args.smoke else (args.rounds, CALLS_PER_ROUND)
    shard_k, shard_n = args.shard or (1, 1)
    for index, w in enumerate(grid):
        if index % shard_n != shard_k - 1 or w.name in done or budget.spent(w.name):
            continue
        done[w.name] = measure(w, rounds, calls)
        runs[-1]["workloads"].append(w.name)
        save_rows(rows_path, machine, runs, list(done.values()))
        times = ", ".join(f"{label} {'failed' if t is None else f'{t:.3f} ms'}" for label, t in done[w.name].ms.items())
        print(f"{w.name}: {times}", file=sys.stderr, flush=True)
        jax.clear_caches()
    if args.shard:
        print(f"shard {shard_k}/{shard_n}: rows saved to {rows_path}; merge them with --merge to write the table")
        return
    rows = [done[w.name] for w in grid if w.name in done]
    skipped = [w.name for w in grid if w.name not in done]
    earlier = "; ".join(f"{len(run['workloads'])} workloads by `{run['command']}` ({run['date']})" for run in runs[:-1])
    comment = f"resumed from earlier runs on this machine: {earlier}" if earlier else ""
    new = entries(rows)
    if args.extend and os.path.exists(path):
        base = choice_table.load(path)
        measured = {entry.key for entry in new}
        new = [entry for entry in base.entries if entry.key not in measured] + new
        extended = (f"extended by `{command_line()}` ({utc_now()}, {len(measured)} buckets) over `{base.command}` "
                    f"({base.date})")
        comment = "; ".join(filter(None, [base.comment, extended, comment]))
    table = choice_table.Table(arch=arch, command=command_line(), device=device_name(), date=utc_now(),
                               jax=jax.__version__, entries=tuple(new), comment=comment)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    choice_table.dump(table, path)
    choice_table.load(path)
    print(f"wrote {path} ({len(table.entries)} entries)")
    print(write_section(args.section, section(rows, table, shown_path(path), skipped),
                        heading="auto's measured choice table (benchmarks/tune_auto.py)"
                        + (f": {args.only}" if args.only else ""),
                        update=not args.smoke))


if __name__ == "__main__":
    main()
