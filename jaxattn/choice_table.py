"""``auto``'s measured choice table: for buckets of calls, the plans in the order a sweep timed them.

One JSON file per GPU architecture ships in ``jaxattn/tuning/`` (``sm_90.json`` for compute
capability 9.0), written by ``python -m benchmarks.tune_auto`` on such a GPU; a file for one kind of
GPU (``nvidia_h100_80gb_hbm3.json``, ``tune_auto --device-table``) comes before its arch's
(``current_table``). ``dispatch.ranking`` orders the backends that rank a call by the entry of the
nearest measured bucket (see there), and ``dispatch.auto_route`` reads from it whether a step's
decodes go to a second backend; without a file for this GPU (or on a machine without one), or with
no entry near the call, the backends' ranks decide alone.

A call's bucket (``Key``) uses static facts only: the op, phase, query and page dtypes, group size,
head dim, page size, layout and options must equal an entry's; the number of sequences (the block
table's rows B), the kv capacity (the block table's width times the page size) and the number of
query tokens T are rounded up to powers of 2, and the nearest entry is the one with the fewest
doublings between them in all (each within ``MAX_DOUBLINGS``; ties: the first in the file).

File format (``FORMAT``)::

    {"format": 1, "arch": "sm_90", "command": "python -m benchmarks.tune_auto ...",
     "device": "...", "date": "...", "jax": "0.11.2",
     "entries": [{"key": {<Key's fields>}, "order": ["triton", "trtllm", "xla"],
                  "ms": {"triton": 0.10, "trtllm": 0.12, "xla": 1.9}, "workloads": ["decode B=64 kv=4096"]},
                 {"key": {...}, "order": ["fa4", "trtllm+fa4", "cudnn", "trtllm+cudnn"], ...}]}

``order`` is what ``auto`` reads: the plans timed, fastest first (those that failed in the sweep
last), each by its label: ``"X"`` for backend X serving the whole call, ``"D+X"`` for X with the
leading decodes split off to backend D (``jaxattn.dispatch.Route``); each part must be a backend
that implements the entry's op. ``ms`` (per label) and ``workloads`` say where it came from. An
optional ``comment`` is free text.

Two readings of the nearest entry: ``measured_order``, the backends by their fastest plan (each
label's main backend, first occurrence), which ``dispatch.ranking`` takes; and ``measured_split``,
whether ``"D+X"`` came before ``"X"`` (None when the entry lacks either: a table of plain names,
or a plan not timed), which ``dispatch.auto_route`` takes for a split's yes or no.
No knobs: no backend exposes a static tuning argument through its op's ``run`` (triton's split
counts and XQA's SM count are chosen inside the backends), so an entry orders plans only.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from jaxattn import backends
from jaxattn.backends.base import Call, compute_capability, gpu_devices

FORMAT = 1
TABLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning")
# An entry serves a call whose sizes are each within this many doublings of the entry's.
MAX_DOUBLINGS = 2
# Joins a split plan's decode backend and main backend in its label: "trtllm+fa4".
SPLIT_SEPARATOR = "+"
_HEADER = ("arch", "command", "device", "date", "jax")
T = TypeVar("T")
P = TypeVar("P", bound="Provenance")


@dataclasses.dataclass(frozen=True)
class Key:
    """A bucket of calls: exact static facts, and power-of-2 buckets of three sizes.

    Attributes:
      op, phase: ``Call.op`` and ``Call.phase``.
      dtype, kv_dtype: the query's and the pages' dtype names.
      group, head_dim: query heads per KV head (``Call.group_size``) and the query's last dim
        (mla_prefill: its no-RoPE width Dn, the tables' key since that op took ``q_nope``).
      page_size, layout: the cache's (layout "" for pools that have one layout, MLA's).
      options: the ``OPTIONS`` the call uses.
      seqs, capacity, tokens: B, the block tables' width x page size, and T, each rounded up to a power of 2.
    """

    op: str
    phase: str
    dtype: str
    kv_dtype: str
    group: int
    head_dim: int
    page_size: int
    layout: str
    options: tuple[str, ...]
    seqs: int
    capacity: int
    tokens: int

    @classmethod
    def of(cls, call: Call) -> Key:
        meta, cache = call.meta, call.cache
        # mla_prefill's call holds the whole query; its measured entries are keyed by Dn.
        head_dim = call.q.shape[2] - (cache.rope_dim if call.op == "mla_prefill" else 0)
        return cls(op=call.op, phase=call.phase, dtype=call.q.dtype.name, kv_dtype=cache.dtype.name,
                   group=call.group_size, head_dim=head_dim, page_size=cache.page_size,
                   layout=getattr(cache, "layout", ""), options=call.options(), seqs=pow2_ceil(meta.batch_size),
                   capacity=pow2_ceil(meta.max_pages_per_seq * cache.page_size), tokens=pow2_ceil(call.q.shape[0]))

    @property
    def exact(self) -> tuple:
        """The fields an entry must share with a call."""
        return self.op, self.phase, self.dtype, self.kv_dtype, self.group, self.head_dim, self.page_size, \
            self.layout, self.options

    @property
    def sizes(self) -> tuple[int, int, int]:
        return self.seqs, self.capacity, self.tokens

    def doublings(self, other: Key) -> tuple[int, ...]:
        """Per size, how many doublings apart ``self`` and ``other`` are."""
        return tuple(abs(round(math.log2(a / b))) for a, b in zip(self.sizes, other.sizes))

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "options": list(self.options)}

    @classmethod
    def from_json(cls, data: dict) -> Key:
        """The key ``to_json`` wrote (unchecked: ``parse`` checks a table's keys first)."""
        return cls(**{**data, "options": tuple(data["options"])})


@dataclasses.dataclass(frozen=True)
class Entry:
    """One measured bucket: ``order``, plan labels fastest first; ``ms`` per label (None: failed)."""

    key: Key
    order: tuple[str, ...]
    ms: dict[str, float | None]
    workloads: tuple[str, ...]

    @property
    def backend_order(self) -> tuple[str, ...]:
        """The main backends of ``order``'s labels, each at its first (fastest) occurrence."""
        return tuple(dict.fromkeys(split_label(label)[1] for label in self.order))

    def split_first(self, main: str, decode: str) -> bool | None:
        """True when the label ``decode+main`` comes before ``main`` in ``order``, False when after,
        None when ``order`` lacks either."""
        split, whole = plan_label(main, decode), plan_label(main)
        if split not in self.order or whole not in self.order:
            return None
        return self.order.index(split) < self.order.index(whole)

    def to_json(self) -> dict:
        return {"key": self.key.to_json(), "order": list(self.order), "ms": self.ms,
                "workloads": list(self.workloads)}


@dataclasses.dataclass(frozen=True)
class Provenance:
    """What wrote a measured table (``_HEADER``'s fields) and a free-text ``comment``: the header
    this module's tables and ``jaxattn.serve.models.expert_gemm_table``'s share."""

    arch: str
    command: str
    device: str
    date: str
    jax: str
    comment: str = ""

    def header_json(self, format: int) -> dict:
        """The JSON header: ``format``, ``_HEADER``'s fields, the comment when there is one."""
        return {"format": format, **{name: getattr(self, name) for name in _HEADER},
                **({"comment": self.comment} if self.comment else {})}


def parse_header(data: object, format: int) -> dict[str, str]:
    """A table's JSON header as ``Provenance``'s fields, ``data``'s format checked against
    ``format`` and its ``entries`` checked to be a list; ValueError (or KeyError) where it is
    malformed."""
    if not isinstance(data, dict) or data.get("format") != format:
        raise ValueError(f"expected an object with \"format\": {format}")
    for name in _HEADER:
        _expect(isinstance(data[name], str), f"{name!r} must be a string")
    _expect(isinstance(data.get("comment", ""), str), "'comment' must be a string")
    _expect(isinstance(data["entries"], list), "'entries' must be a list")
    return {**{name: data[name] for name in _HEADER}, "comment": data.get("comment", "")}


def load_json(path: str, parse: Callable[[object], T], what: str, rewrite: str) -> T:
    """``parse`` of the JSON in ``path``, a ``what``; ValueError naming the file, what is wrong and
    the ``rewrite`` command when it is malformed."""
    try:
        with open(path) as f:
            return parse(json.load(f))
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"malformed {what} {path}: {err} (rewrite it with {rewrite})") from err


@dataclasses.dataclass(frozen=True)
class Table(Provenance):
    """A choice table and what produced it."""

    entries: tuple[Entry, ...] = ()

    def nearest(self, key: Key) -> Entry | None:
        """The entry of the nearest bucket to ``key`` (module docstring), or None."""
        best, best_steps = None, None
        for entry in self.entries:
            if entry.key.exact != key.exact:
                continue
            steps = entry.key.doublings(key)
            if max(steps) <= MAX_DOUBLINGS and (best_steps is None or sum(steps) < best_steps):
                best, best_steps = entry, sum(steps)
        return best

    def to_json(self) -> dict:
        return {**self.header_json(FORMAT), "entries": [entry.to_json() for entry in self.entries]}


def dump(table: Table, path: str) -> None:
    """Writes ``table`` to ``path`` as JSON, one entry a line."""
    dump_entries(table.to_json(), path)


def dump_entries(data: dict, path: str) -> None:
    """Writes a table's JSON form ``data`` to ``path``, its header indented and one entry a line."""
    data = dict(data)
    entries = ",\n".join(f"  {json.dumps(entry)}" for entry in data.pop("entries"))
    header = json.dumps(data, indent=1)[:-2]              # without its closing "\n}"
    with open(path, "w") as f:
        f.write(f'{header},\n "entries": [\n{entries}\n ]\n}}\n')


def merged_entries(old: P | None, new: P) -> P:
    """``new`` (a ``Provenance`` with ``entries`` that have a ``key``) with ``old``'s entries of
    other keys kept after its own, its comment saying what it was merged over: a run that measures
    some keys adds to the file of a run that measured others. ``new`` alone where ``old`` is None
    or of another arch."""
    if old is None or old.arch != new.arch:
        return new
    keys = {entry.key for entry in new.entries}
    kept = tuple(entry for entry in old.entries if entry.key not in keys)
    if not kept:
        return new
    # the kept entries may be older than the old file's own run: its comment says which
    comment = f"{len(kept)} entries kept from the table of `{old.command}` ({old.date}, {old.device})" + \
        (f", whose comment read: {old.comment}" if old.comment else "")
    return dataclasses.replace(new, comment=comment, entries=new.entries + kept)


def pow2_ceil(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def plan_label(main: str, decode: str | None = None) -> str:
    """A plan's label in a table: ``main`` whole, or ``"decode+main"`` with its decodes split off."""
    return main if decode is None else f"{decode}{SPLIT_SEPARATOR}{main}"


def split_label(label: str) -> tuple[str | None, str]:
    """``(decode, main)`` of a plan label: the parts before and after its last ``+`` (decode None
    without one). ``split_label("trtllm+fa4") == ("trtllm", "fa4")``."""
    decode, separator, main = label.rpartition(SPLIT_SEPARATOR)
    return (decode if separator else None), main


def measured_order(call: Call) -> tuple[str, ...] | None:
    """The backends in the measured order of the entry nearest to ``call`` in this GPU's table
    (``Entry.backend_order``); None without a table or a near entry (on CPU, always None)."""
    entry = _nearest_entry(call)
    return entry.backend_order if entry is not None else None


def measured_split(call: Call, main: str, decode: str) -> bool | None:
    """Whether the nearest entry to ``call`` in this GPU's table timed ``main`` with the decodes
    split off to ``decode`` faster (True) or slower (False) than ``main`` whole; None without a
    table, a near entry, or both plans in it (``Entry.split_first``)."""
    entry = _nearest_entry(call)
    return entry.split_first(main, decode) if entry is not None else None


def _nearest_entry(call: Call) -> Entry | None:
    table = current_table()
    return table.nearest(Key.of(call)) if table is not None else None


def current_arch() -> str | None:
    """"sm_<major><minor>" of the first GPU (``sm_90`` on an H100 or H200); None without a GPU."""
    gpus = gpu_devices()
    if not gpus:
        return None
    major, minor = compute_capability(gpus[0])
    return f"sm_{major}{minor}"


def arch_table(path_of: Callable[[str], str], load: Callable[[str], T]) -> T | None:
    """``load`` of this GPU's file ``path_of(arch)`` (``current_arch``), or None without a GPU or
    a file for its arch: how the per-arch tables of other kinds (the expert GEMM strategies, the
    grouped GEMM's tiles) find theirs."""
    arch = current_arch()
    if arch is None or not os.path.exists(path_of(arch)):
        return None
    return load(path_of(arch))


def current_device_kind() -> str | None:
    """The first GPU's ``device_kind`` ("NVIDIA H100 80GB HBM3"); None without a GPU."""
    gpus = gpu_devices()
    return gpus[0].device_kind if gpus else None


def device_table_name(device_kind: str) -> str:
    """The name of a table swept on one kind of GPU: its ``device_kind`` in lower case, each run of
    other characters than letters and digits one ``_`` ("NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3")."""
    return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")


def current_table_name() -> str | None:
    """The name of this GPU's table (``TABLE_DIR/<name>.json``): the one swept on its kind of GPU
    when it ships (GPUs of one arch differ in their ratio of memory bandwidth to compute, the H100
    and the H200 among them), else its arch's; None without a GPU or a table."""
    kind, arch = current_device_kind(), current_arch()
    names = ([device_table_name(kind)] if kind else []) + ([arch] if arch else [])
    return next((name for name in names if shipped_table(name) is not None), None)


def current_table() -> Table | None:
    """This GPU's table (``current_table_name``), or None."""
    name = current_table_name()
    return None if name is None else shipped_table(name)


def describe_current_table() -> str:
    """Which table ``auto`` reads here, in one line for reports: its file, entries, where and when
    it was swept; or that there is none and the backends' ranks decide."""
    name = current_table_name()
    if name is None:
        return "none (no GPU, or no table for it): the backends' ranks decide"
    table = shipped_table(name)
    return f"jaxattn/tuning/{name}.json ({len(table.entries)} entries; swept on {table.device}, {table.date})"


@functools.cache
def shipped_table(name: str) -> Table | None:
    """The table shipped as ``TABLE_DIR/<name>.json`` (an arch's, ``sm_90``, or a kind of GPU's,
    ``device_table_name``), or None when there is none."""
    path = os.path.join(TABLE_DIR, f"{name}.json")
    return load(path) if os.path.exists(path) else None


def load(path: str) -> Table:
    """The table in ``path``; ValueError naming the file and what is wrong when it is malformed."""
    return load_json(path, parse, "choice table", "python -m benchmarks.tune_auto")


def parse(data: object) -> Table:
    """A ``Table`` from its JSON form; ValueError (or TypeError/KeyError) where it is malformed."""
    return Table(**parse_header(data, FORMAT), entries=tuple(_entry(i, e) for i, e in enumerate(data["entries"])))


def _entry(index: int, data: dict) -> Entry:
    where = f"entries[{index}]"
    _expect(isinstance(data, dict) and set(data) == {"key", "order", "ms", "workloads"},
            f"{where} must have exactly the fields key, order, ms, workloads")
    key = data["key"]
    fields = {f.name: f.type for f in dataclasses.fields(Key)}
    _expect(isinstance(key, dict) and set(key) == set(fields),
            f"{where}.key must have exactly the fields {list(fields)}")
    for name, kind in fields.items():
        if kind == "int":
            _expect(type(key[name]) is int and key[name] >= 1, f"{where}.key.{name} must be an int >= 1")
        elif kind == "str":
            _expect(isinstance(key[name], str), f"{where}.key.{name} must be a string")
    _expect(_strings(key["options"]), f"{where}.key.options must be a list of strings")
    for name in ("seqs", "capacity", "tokens"):
        _expect(key[name] == pow2_ceil(key[name]), f"{where}.key.{name} must be a power of 2")
    _expect(_strings(data["order"]) and data["order"], f"{where}.order must be a non-empty list of plan labels")
    _expect(isinstance(data["ms"], dict) and all(v is None or isinstance(v, (int, float)) for v in data["ms"].values()),
            f"{where}.ms must map plan labels to milliseconds or null")
    known = backends.names(key["op"])
    for field, labels in (("order", data["order"]), ("ms", data["ms"])):
        for label in labels:
            _expect(all(part in known for part in split_label(label) if part is not None),
                    f"{where}.{field}: {label!r} is not a backend of {key['op']} or decode+main of two "
                    f"(known: {', '.join(known)})")
    _expect(_strings(data["workloads"]), f"{where}.workloads must be a list of strings")
    return Entry(key=Key.from_json(key), order=tuple(data["order"]), ms=data["ms"],
                 workloads=tuple(data["workloads"]))


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def _expect(condition: object, message: str) -> None:
    if not condition:
        raise ValueError(message)


def reorder(by_rank: Sequence[str], measured: Sequence[str]) -> list[str]:
    """``by_rank`` with the backends ``measured`` names put in measured order, in the places they
    hold in ``by_rank``; the others keep theirs. ``reorder([a, b, c, d], [c, x, a]) == [c, b, a, d]``."""
    known = set(by_rank) & set(measured)
    slots = iter(name for name in measured if name in known)
    return [next(slots) if name in known else name for name in by_rank]
