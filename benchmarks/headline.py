"""The headline table at the top of benchmarks/RESULTS.md: one row per key workload, taken from
the tables of the sections below it (each row's device, date and command come from its section).

    python -m benchmarks.headline            # rewrite the table between its markers in RESULTS.md
    python -m benchmarks.headline --check    # exit 1 when the table there is stale

Run it after a benchmark has rewritten its section. A row whose number is no longer in its
section's tables fails loudly: pick it again in ``ROWS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from benchmarks.common import RESULTS, replace_section

SECTION = "headline"


@dataclasses.dataclass(frozen=True)
class Pick:
    """One number in a section: in ``column``, on the table row whose cells match ``cells``
    (column -> text; a cell "auto (trtllm)" matches "auto"). ``label`` names it in the headline;
    "{}" in it stands for the matched text of the last of ``cells`` (e.g. "auto (trtllm)")."""
    label: str
    cells: tuple[tuple[str, str], ...]
    column: str


@dataclasses.dataclass(frozen=True)
class Row:
    """A headline row: jaxattn's number against the best of its peers (the lowest time; with
    ``higher_is_better``, the highest), or, where the run had no peer, against a ``baseline``.

    With ``every_run``, the peers are every other implementation on ``ours``' rows (its last
    cell names the implementation column), in every section named ``section`` or
    ``section_<suffix>`` (runs of one benchmark with different peers): the best of them all
    wins, against jaxattn's number from the same run."""
    workload: str
    op: str
    shape: str
    section: str
    ours: Pick
    peers: tuple[Pick, ...] = ()
    baseline: Pick | None = None
    unit: str = "us"
    higher_is_better: bool = False
    every_run: bool = False


def across(key: dict[str, str], ours: tuple[str, str], *peers: tuple[str, str]) -> dict:
    """``Row`` arguments for a wide table: one row (``key``), jaxattn and each peer in a column of
    its own, given as (label, column)."""
    cells = tuple(key.items())
    return dict(ours=Pick(ours[0], cells, ours[1]), peers=tuple(Pick(label, cells, column) for label, column in peers))


def down(key: dict[str, str], by: str, column: str, ours: str, *peers: str, baseline: str | None = None,
         label: str = "{}") -> dict:
    """``Row`` arguments for a long table: one row per implementation (the ``by`` column, which
    ``label`` names), the numbers in ``column``."""
    def pick(name: str) -> Pick:
        return Pick(label, (*key.items(), (by, name)), column)
    return dict(ours=pick(ours), peers=tuple(pick(p) for p in peers), baseline=pick(baseline) if baseline else None)


def jax_peers(workload: str) -> dict:
    """``Row`` arguments for a workload of benchmarks/bench_jax_peers.py: jaxattn auto against
    the fastest JAX peer of any of its runs (``every_run``)."""
    return dict(op="paged_attention", section="jax_peers", unit="ms", every_run=True,
                ours=Pick("{}", (("workload", workload), ("implementation", "jaxattn auto")), "GPU time / call"))


XQA_DECODE = dict(op="paged_attention", section="trtllm-decode")
ROWS = [
    Row("decode, the target point", shape="B=64, kv U[2048,4096]", **XQA_DECODE, **across(
        {"case": "B=64 kv=U[2048,4096]"}, ("trtllm", "jaxattn trtllm us (TB/s)"),
        ("flashinfer xqa", "flashinfer xqa us (TB/s)"), ("flashinfer fa2", "flashinfer fa2 us (TB/s)"))),
    Row("decode, batch 256", shape="B=256, kv 4096", **XQA_DECODE, **across(
        {"case": "B=256 kv=4096"}, ("trtllm", "jaxattn trtllm us (TB/s)"),
        ("flashinfer xqa", "flashinfer xqa us (TB/s)"), ("flashinfer fa2", "flashinfer fa2 us (TB/s)"))),
    Row("decode, small batch", shape="B=1, kv 4096", **XQA_DECODE, **across(
        {"case": "B=1 kv=4096"}, ("trtllm", "jaxattn trtllm us (TB/s)"),
        ("flashinfer xqa", "flashinfer xqa us (TB/s)"), ("flashinfer fa2", "flashinfer fa2 us (TB/s)"))),
    Row("decode, long context", "paged_attention", "B=1, kv 131072", "decode-frontier", **across(
        {"case": "B=1 kv=131072"}, ("auto", "jaxattn auto us (TB/s)"),
        ("flashinfer xqa", "flashinfer xqa us (TB/s)"), ("flashinfer fa2", "flashinfer fa2 us (TB/s)"))),
    Row("decode, fp8 pages", "paged_attention", "B=64, kv U[2048,4096], float8_e4m3fn KV", "fp8-decode", **across(
        {"case": "B=64 kv=U[2048,4096]"}, ("trtllm", "jaxattn trtllm fp8 us (TB/s)"),
        ("flashinfer xqa", "flashinfer xqa fp8 us (TB/s)"))),
    Row("speculative decode", "paged_attention", "B=64 x 4 draft tokens, kv U[2048,4096]", "spec-decode", **across(
        {"B": "64", "q_len": "4"}, ("trtllm", "jaxattn trtllm us"), ("flashinfer xqa", "flashinfer xqa us"))),
    Row("prefill", "paged_attention", "B=8 x 4096, causal", "cudnn-prefill", **across(
        {"case": "B=8 x 4096"}, ("cudnn", "jaxattn cudnn us (TFLOP/s)"),
        ("flashinfer cudnn", "flashinfer cudnn us (TFLOP/s)"), ("flashinfer fa3", "flashinfer fa3 us (TFLOP/s)"))),
    Row("mixed batch", shape="63 decodes at kv 4096 + an 8192-token prefill",
        **jax_peers("mixed 63 decodes + 8192 prefill")),
    Row("JAX peers: decode", shape="B=64, kv U[2048,4096]", **jax_peers("decode B=64 kv=U[2048,4096]")),
    Row("JAX peers: speculative decode", shape="B=64 x 4 draft tokens, kv 4096",
        **jax_peers("spec decode B=64 x 4 kv=4096")),
    Row("JAX peers: prefill", shape="B=8 x 4096, causal", **jax_peers("prefill B=8 x 4096")),
    Row("JAX peers: short prefill", shape="B=1 x 512, causal", **jax_peers("prefill B=1 x 512")),
    Row("JAX peers: chunked prefill", shape="B=4 x 300 new over 1200, causal",
        **jax_peers("chunked prefill B=4 x 300 over 1200")),
    Row("JAX peers: small-batch decode", shape="B=1, kv 4096", **jax_peers("decode B=1 kv=4096")),
    Row("MLA decode", "mla_paged_attention", "B=64, kv 4096, Hq 128", "mla-hq128", **across(
        {"case": "B=64 kv=4096 Hq=128"}, ("auto", "jaxattn auto us"), ("flashinfer mla", "flashinfer mla us"))),
    Row("MLA prefill", "mla_prefill", "B=8 x 4096, Hq 128", "mla-prefill-hq128", unit="ms", **across(
        {"case": "prefill B=8 x 4096, Hq=128"}, ("fa4", "jaxattn fa4"), ("flashinfer cudnn", "flashinfer cudnn"))),
    Row("decode step, end to end", "engine step", "Llama-3-8B shapes, 8 layers, B=64, context 4096", "e2e", unit="ms",
        **down({"batch": "64", "context": "4096"}, "backend (decode plan)", "step ms", "auto", baseline="xla",
               label="backend {}")),
    Row("serving with a shared prompt", "Engine", "Llama-3-8B shapes, 128 requests, 1024-token shared prompt",
        "serving", unit="tokens/s", higher_is_better=True,
        **down({}, "prefix caching", "generated tokens/s", "on", baseline="off", label="prefix caching {}")),
    Row("serving against a JAX engine", "Engine", "Llama-3-8B shapes, chat trace of 1,000 requests, 256 in flight",
        "esurge_serving_chat", unit="tokens/s", higher_is_better=True,
        **down({}, "engine", "generated tokens/s", "jaxattn", "eSurge", label="{}")),
    Row("tensor parallelism", "engine step", "Llama-3-8B shapes, 8 layers, B=64, context 4096, 2 GPUs", "tp",
        unit="ms", **down({"model": "8B shapes, 8 layers", "context": "4096"}, "GPUs", "step ms", "2", baseline="1",
                          label="{}-GPU step")),
    Row("tensor parallelism", "engine step", "Llama-3-8B shapes, 8 layers, B=64, context 16384, 2 GPUs", "tp",
        unit="ms", **down({"model": "8B shapes, 8 layers", "context": "16384"}, "GPUs", "step ms", "2", baseline="1",
                          label="{}-GPU step")),
]
NOTES = """\
Ratio = the best peer's time / jaxattn's time (tokens/s: jaxattn's / the other's): below 1.0x jaxattn is slower, \
above 1.0x it is faster. \
JAX-peer rows (mixed batch, JAX peers): the fastest peer of any bench_jax_peers run (sections jax_peers and \
jax_peers_*), against jaxattn auto in that run.

Rows whose run had no peer compare with a baseline of the same run (the xla backend, prefix caching off, one GPU) \
and say so. paged_attention rows: bf16, Hq 32, Hkv 8, D 128, page 64; MLA rows: bf16, latent 512 + RoPE 64. \
Generated by `python -m benchmarks.headline` from the sections named in the last column (their device, date and \
command); do not edit it by hand."""


@dataclasses.dataclass
class Table:
    header: list[str]
    rows: list[dict[str, str]]
    command: str | None = None     # where the table's numbers came from a command other than the section's


def sections(document: str) -> dict[str, str]:
    """The text of each ``<!-- name:begin/end -->`` section of ``document``, with what follows it
    up to the next ``## `` heading (notes written beside the table)."""
    found = {}
    for m in re.finditer(r"<!-- ([\w-]+):begin -->\n(.*?)<!-- \1:end -->(.*?)(?=\n## |\n<!-- [\w-]+:begin|\Z)",
                         document, re.S):
        found[m.group(1)] = m.group(2) + m.group(3)
    return found


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[Table]:
    """The markdown tables of a section, and its "- prefill ...: name t ms (...), ..." lines as
    one-row tables (case -> the line's label, one column per implementation)."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")) and i + 1 < len(lines) \
                and lines[i + 1].startswith("|---"):
            header, rows = cells(line), []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, cells(row))))
            found.append(Table(header, rows))
        elif m := re.match(r"- (prefill [^:]+): ([^;]*)", line):
            times = dict(re.findall(r"((?:jaxattn|flashinfer) [\w ]+?) ([\d.]+ ms)", m.group(2)))
            command = re.search(r"`(python -m benchmarks\.[^`]*)`", line)
            found.append(Table(["case", *times], [{"case": m.group(1), **times}], command and command.group(1)))
    return found


def matches(cell: str, want: str) -> bool:
    return cell == want or cell.split(" (")[0] == want


def number(text: str) -> str | None:
    """The number a cell starts with, as written ("192.1 (4.15)" -> "192.1"); None for "-", "n/a"."""
    m = re.match(r"\**([\d,]+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def find(section: str, tables_: list[Table], pick: Pick) -> tuple[str, str | None, str | None]:
    """(label, the number as written or None where the table says "-" or "n/a", the table's own
    command); raises ``LookupError`` when no table row matches."""
    want = dict(pick.cells)
    for table in tables_:
        if pick.column not in table.header or not set(want) <= set(table.header):
            continue
        for row in table.rows:
            if all(matches(row.get(k, ""), v) for k, v in want.items()):
                label = pick.label.format(row[pick.cells[-1][0]])
                return label, number(row.get(pick.column, "")), table.command
    raise LookupError(f"headline: no row {want} with column {pick.column!r} in section {section!r}")


def header_facts(text: str) -> tuple[str, str, str]:
    """(device, date, command) from a section's text: the first of each it names."""
    device = re.search(r"[Dd]evice: ([^;,\n]+)", text)
    date = re.search(r"\d{4}-\d{2}-\d{2}", text)
    command = re.search(r"`(python -m benchmarks\.[^`]*)`", text)
    return (device.group(1).strip() if device else "?", date.group(0) if date else "?",
            command.group(1) if command else "?")


def value(text: str) -> float:
    return float(text.replace(",", ""))


@dataclasses.dataclass
class Run:
    """A row's numbers in one section: jaxattn's (with its label) and each peer's (None: "n/a")."""
    section: str
    facts: tuple[str, str, str]        # device, date, command
    label: str
    ours: str
    peers: list[tuple[str, str | None]]


def every_peer(tables_: list[Table], ours: Pick) -> tuple[Pick, ...]:
    """The other implementations on the rows of ``ours``' table that share its cells but the last
    (rows of the same library as ``ours``, its first word, are not peers)."""
    *key, (by, name) = ours.cells
    library = name.split()[0]
    for table in tables_:
        if ours.column in table.header and {k for k, _ in ours.cells} <= set(table.header):
            rows = [r for r in table.rows if all(matches(r.get(k, ""), v) for k, v in key)]
            if any(matches(r.get(by, ""), name) for r in rows):
                return tuple(Pick("{}", (*key, (by, r[by])), ours.column) for r in rows
                             if not r.get(by, "").startswith(library))
    return ()


def run_of(row: Row, section: str, text: str) -> Run:
    """``row``'s numbers in ``section`` (its text); raises ``LookupError`` when jaxattn's are missing."""
    tables_ = tables(text)
    device, date, command = header_facts(text)
    label, ours, own_command = find(section, tables_, row.ours)
    if ours is None:
        raise LookupError(f"headline: {section}: jaxattn's number ({row.ours}) is missing")
    picks = row.peers + (every_peer(tables_, row.ours) if row.every_run else ())
    return Run(section, (device, date, own_command or command), label, ours,
               [find(section, tables_, p)[:2] for p in picks])


def runs_of(row: Row, found: dict[str, str]) -> list[Run]:
    """``row``'s numbers in its section, or (``every_run``) in each section of its benchmark that has them."""
    if not row.every_run:
        return [run_of(row, row.section, found[row.section])]
    runs, errors = [], []
    for name, text in found.items():
        if name == row.section or name.startswith(row.section + "_"):
            try:
                runs.append(run_of(row, name, text))
            except LookupError as err:
                errors.append(str(err))
    if not runs:
        raise LookupError("; ".join(errors) or f"headline: RESULTS.md has no section {row.section!r}")
    return runs


def render_row(row: Row, found: dict[str, str]) -> str:
    """``row``'s line of the headline table; ``found``: RESULTS.md's sections by name."""
    runs = runs_of(row, found)
    unit = f" {row.unit}"
    timed = [(run, name, v) for run in runs for name, v in run.peers if v is not None]
    better = max if row.higher_is_better else min
    run = runs[0]
    if timed:
        run, name, other = better(timed, key=lambda t: value(t[2]))
        peer = f"{name} {other}{unit}"
    elif row.baseline:
        name, other, _ = find(run.section, tables(found[run.section]), row.baseline)
        peer = f"no peer in this run; baseline: {name} {other}{unit}"
    else:
        other = None
        names = dict.fromkeys(name for r in runs for name, _ in r.peers)
        peer = "none runs it (" + ", ".join(f"{n}: n/a" for n in names) + ")"
    if other is None:
        ratio = "-"
    else:
        r = value(run.ours) / value(other) if row.higher_is_better else value(other) / value(run.ours)
        ratio = f"{r:.2f}x" + ("" if timed else " (vs baseline)")
    device, date, command = run.facts
    source = f"{run.section}: `{command.removeprefix('python -m benchmarks.')}`"
    return " | ".join(["", row.workload, row.op, row.shape, f"{run.ours}{unit}, {run.label}", peer, ratio, device,
                       date, source, ""]).strip()


def headline(document: str) -> str:
    """The headline section's text for ``document`` (RESULTS.md's text)."""
    found = sections(document)
    missing = sorted({row.section for row in ROWS if not row.every_run} - set(found))
    if missing:
        raise LookupError(f"headline: RESULTS.md has no section {missing}")
    lines = ["| workload | op | shape | jaxattn, backend | best peer, same run | ratio | device | date | "
             "section: command |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [render_row(row, found) for row in ROWS]
    return "\n".join(lines + ["", NOTES])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.headline", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the headline table is stale; write nothing")
    parser.add_argument("--file", default=RESULTS, help="the results file (default: benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    old = open(args.file).read()
    new = replace_section(old, SECTION, headline(old))
    if new is None:
        sys.exit(f"{args.file} has no <!-- {SECTION}:begin/end --> markers")
    if args.check:
        if new != old:
            sys.exit(f"the headline table of {args.file} is stale: run python -m benchmarks.headline")
        print("headline table up to date")
        return
    with open(args.file, "w") as f:
        f.write(new)
    print(headline(old))


if __name__ == "__main__":
    main()
