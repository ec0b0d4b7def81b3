"""The routed experts' measured GEMM table: for MoE shapes and tokens per step, the strategies of
``jaxattn.serve.models.experts`` in the order a ``benchmarks/bench_moe.py`` run timed them.

One JSON file per GPU architecture ships in ``jaxattn/tuning/`` (``moe_sm_90.json``), written by
``python -m benchmarks.bench_moe --table PATH`` on such a GPU (a run with ``--fp8`` adds the FP8
entries to the same file). ``experts.choose_gemm`` takes the fastest strategy of the nearest entry:
the weights' kind (``"bf16"`` or ``"fp8"``) must equal the entry's, the experts, experts per token,
model dim and expert hidden size must each be within ``MAX_DOUBLINGS`` doublings of the entry's,
and the nearest is the one with the fewest doublings between them and the tokens in all (ties: the
first in the file). Without a file for this GPU, or with no entry near, the caller's default holds.

File format (``FORMAT``)::

    {"format": 1, "arch": "sm_90", "command": "python -m benchmarks.bench_moe ...",
     "device": "...", "date": "...", "jax": "0.11.2", "comment": "...",
     "entries": [{"key": {"weights": "bf16", "experts": 64, "k": 6, "dim": 2048, "hidden": 1408,
                          "tokens": 128},
                  "order": ["triton", "dense", "ragged_dot"],
                  "us": {"ragged_dot": 1160.6, "dense": 459.5, "triton": 433.4}}, ...]}
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

from jaxattn import choice_table

FORMAT = 1
# An entry serves a layer whose experts, k, dim and hidden size are each within this many doublings.
MAX_DOUBLINGS = 2
WEIGHTS = ("bf16", "fp8")
_SHAPE = ("experts", "k", "dim", "hidden")


@dataclasses.dataclass(frozen=True)
class Key:
    """A routed-experts call: the weights' kind, the layer's shape and the tokens of the step."""
    weights: str
    experts: int
    k: int
    dim: int
    hidden: int
    tokens: int

    def doublings(self, other: Key) -> dict[str, float]:
        """|log2| of each size's ratio to ``other``'s, by field."""
        return {name: abs(math.log2(getattr(self, name) / getattr(other, name))) for name in (*_SHAPE, "tokens")}


@dataclasses.dataclass(frozen=True)
class Entry:
    key: Key
    order: tuple[str, ...]          # the strategies timed, fastest first
    us: dict[str, float]            # microseconds per call, by strategy


@dataclasses.dataclass(frozen=True)
class Table(choice_table.Provenance):
    entries: tuple[Entry, ...] = ()

    def nearest(self, key: Key) -> Entry | None:
        """The entry nearest ``key`` (module docstring), or None."""
        best, best_distance = None, math.inf
        for entry in self.entries:
            if entry.key.weights != key.weights:
                continue
            doublings = key.doublings(entry.key)
            if any(doublings[name] > MAX_DOUBLINGS for name in _SHAPE):
                continue
            distance = sum(doublings.values())
            if distance < best_distance:
                best, best_distance = entry, distance
        return best

    def to_json(self) -> dict:
        return {**self.header_json(FORMAT),
                "entries": [{"key": dataclasses.asdict(e.key), "order": list(e.order), "us": e.us}
                            for e in self.entries]}


def table_path(arch: str) -> str:
    return os.path.join(choice_table.TABLE_DIR, f"moe_{arch}.json")


@functools.cache
def current_table() -> Table | None:
    """This GPU's table (``moe_<arch>.json``), or None without a GPU or a table for its arch."""
    return choice_table.arch_table(table_path, load)


def load(path: str) -> Table:
    """The table in ``path``; ValueError naming the file and what is wrong when it is malformed."""
    return choice_table.load_json(path, parse, "expert GEMM table", f"python -m benchmarks.bench_moe --table {path}")


def parse(data: object) -> Table:
    """A ``Table`` from its JSON form; ValueError (or TypeError/KeyError) where it is malformed."""
    return Table(**choice_table.parse_header(data, FORMAT),
                 entries=tuple(_entry(i, e) for i, e in enumerate(data["entries"])))


def _entry(index: int, data: dict) -> Entry:
    where = f"entries[{index}]"
    key = Key(**data["key"])
    if key.weights not in WEIGHTS:
        raise ValueError(f"{where}: key.weights must be one of {WEIGHTS}, got {key.weights!r}")
    for name in (*_SHAPE, "tokens"):
        value = getattr(key, name)
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{where}: key.{name} must be an int >= 1, got {value!r}")
    order = tuple(data["order"])
    if not order or not all(isinstance(name, str) for name in order):
        raise ValueError(f"{where}: order must be a non-empty list of strategy names")
    us = {str(name): float(value) for name, value in data["us"].items()}
    return Entry(key, order, us)


def dump(table: Table, path: str) -> None:
    """Writes ``table`` to ``path`` as JSON, one entry a line."""
    choice_table.dump_entries(table.to_json(), path)


def merged(old: Table | None, new: Table) -> Table:
    """``new`` with ``old``'s entries of other keys kept after its own (a ``--fp8`` run adds to a
    bf16 run's file): ``choice_table.merged_entries``."""
    return choice_table.merged_entries(old, new)
