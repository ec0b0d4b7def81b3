"""The Triton grouped GEMM's measured launch configurations: for a kind of weights, SwiGLU or not,
the rows per block and the weights' ``K x N``, the ``Tiles`` a ``benchmarks/tune_grouped_gemm.py``
run timed fastest.

One JSON file per GPU architecture ships in ``jaxattn/tuning/`` (``grouped_gemm_sm_90.json``),
written by ``python -m benchmarks.tune_grouped_gemm --table PATH`` on such a GPU (a run keeps the
file's entries of keys it did not time). ``grouped_gemm.choose_tiles`` takes the nearest entry's
tiles: the weights' kind, SwiGLU and the rows per block must equal the entry's (a 16-row block and
a 64-row block want different tiles), ``K`` and ``N`` must each be within ``MAX_DOUBLINGS``
doublings of the entry's, and the nearest is the one with the fewest doublings in all (ties: the
first in the file). Without a file for this GPU, or with no entry near, ``default_tiles`` holds.
Weights: ``"bf16"`` (bf16 rows and weights), ``"fp8"`` (FP8 weights ``[E, N, K]`` with scales
constant along K, which the tuner times with FP8 rows, as the model runs them).

File format (``FORMAT``)::

    {"format": 1, "arch": "sm_90", "command": "python -m benchmarks.tune_grouped_gemm ...",
     "device": "...", "date": "...", "jax": "0.11.2", "comment": "...",
     "entries": [{"key": {"weights": "fp8", "swiglu": true, "block_m": 32, "k": 2048, "n": 1408},
                  "tiles": [128, 128, 4, 3, true],
                  "us": {"128x128 w4 s3 swap": 101.2, "128x64 w4 s4": 120.5}}, ...]}

``tiles`` is ``(block_n, block_k, num_warps, num_stages, swap_ab[, block_tiles_first])`` (the
last one False where left out); ``us`` the microseconds per call of every configuration the run
timed (a record; the chooser reads ``tiles``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import NamedTuple

from jaxattn import choice_table

FORMAT = 1
# An entry serves weights whose K and N are each within this many doublings of its own.
MAX_DOUBLINGS = 2
WEIGHTS = ("bf16", "fp8")
# FP8 MMA instructions are 32 deep: an FP8 tile no shallower (grouped_gemm.fp8_row_group relies on it)
MIN_FP8_BLOCK_K = 32


class Tiles(NamedTuple):
    """A launch configuration of the grouped GEMM kernel (``grouped_gemm`` re-exports it):
    ``block_n x block_k`` weight tiles, ``num_warps``, ``num_stages``; ``swap_ab``: each tile's
    product computed transposed, ``w_tile^T @ rows^T``, so that the weights' ``block_n`` columns
    take the MMA's M side (a Hopper warpgroup MMA is 64 rows deep) and a block's rows its N side (8
    and up), as TensorRT-LLM and SGLang do for small-M GEMMs; ``block_tiles_first``: the programs
    of one block (its weight tiles along N) launched next to each other, so that its rows are read
    from memory once and the blocks of one expert share each weight tile in L2 (else one weight
    tile column over every block first, and a block's rows are read once per tile column: from
    memory where they do not fit L2, as the down projection's rows at mixed-step sizes). Defined
    here, without Triton, so that the table loads anywhere."""
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    block_tiles_first: bool = False

    def launchable(self) -> bool:
        """Whether ``grouped_gemm`` can launch it: ``block_n`` and ``block_k`` powers of two >= 16,
        warps and stages ints >= 1, ``swap_ab`` and ``block_tiles_first`` bools."""
        return (all(isinstance(size, int) and size >= 16 and size & (size - 1) == 0
                    for size in (self.block_n, self.block_k))
                and all(isinstance(count, int) and count >= 1 for count in (self.num_warps, self.num_stages))
                and isinstance(self.swap_ab, bool) and isinstance(self.block_tiles_first, bool))


@dataclasses.dataclass(frozen=True)
class Key:
    """A grouped GEMM call: the weights' kind, SwiGLU (two stacks) or not, rows per block, K x N."""
    weights: str
    swiglu: bool
    block_m: int
    k: int
    n: int

    def doublings(self, other: Key) -> float:
        """The |log2| of K's and N's ratios to ``other``'s, summed; inf where either is more than
        ``MAX_DOUBLINGS`` or the kind, SwiGLU or rows per block differ."""
        if (self.weights, self.swiglu, self.block_m) != (other.weights, other.swiglu, other.block_m):
            return math.inf
        steps = [abs(math.log2(getattr(self, name) / getattr(other, name))) for name in ("k", "n")]
        return math.inf if max(steps) > MAX_DOUBLINGS else sum(steps)


@dataclasses.dataclass(frozen=True)
class Entry:
    key: Key
    tiles: Tiles               # the fastest configuration timed
    us: dict[str, float]            # microseconds per call, by configuration label


@dataclasses.dataclass(frozen=True)
class Table(choice_table.Provenance):
    entries: tuple[Entry, ...] = ()

    def nearest(self, key: Key) -> Entry | None:
        """The entry nearest ``key`` (module docstring), or None."""
        best, best_distance = None, math.inf
        for entry in self.entries:
            distance = key.doublings(entry.key)
            if distance < best_distance:
                best, best_distance = entry, distance
        return best

    def to_json(self) -> dict:
        return {**self.header_json(FORMAT),
                "entries": [{"key": dataclasses.asdict(e.key), "tiles": list(e.tiles), "us": e.us}
                            for e in self.entries]}


def measured_tiles(weights: str, swiglu: bool, block_m: int, k: int, n: int) -> Tiles | None:
    """The tiles of this GPU's nearest entry for the call (module docstring), or None."""
    table = current_table()
    entry = None if table is None else table.nearest(Key(weights, swiglu, block_m, k, n))
    return None if entry is None else entry.tiles


def table_path(arch: str) -> str:
    return os.path.join(choice_table.TABLE_DIR, f"grouped_gemm_{arch}.json")


@functools.cache
def current_table() -> Table | None:
    """This GPU's table (``grouped_gemm_<arch>.json``), or None without a GPU or a table for its arch."""
    return choice_table.arch_table(table_path, load)


def load(path: str) -> Table:
    """The table in ``path``; ValueError naming the file and what is wrong when it is malformed."""
    return choice_table.load_json(path, parse, "grouped GEMM tiles table",
                                  f"python -m benchmarks.tune_grouped_gemm --table {path}")


def parse(data: object) -> Table:
    """A ``Table`` from its JSON form; ValueError (or TypeError/KeyError) where it is malformed."""
    return Table(**choice_table.parse_header(data, FORMAT),
                 entries=tuple(_entry(i, e) for i, e in enumerate(data["entries"])))


def _entry(index: int, data: dict) -> Entry:
    where = f"entries[{index}]"
    key = Key(**data["key"])
    if key.weights not in WEIGHTS:
        raise ValueError(f"{where}: key.weights must be one of {WEIGHTS}, got {key.weights!r}")
    if not isinstance(key.swiglu, bool):
        raise ValueError(f"{where}: key.swiglu must be a bool, got {key.swiglu!r}")
    for name in ("block_m", "k", "n"):
        value = getattr(key, name)
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{where}: key.{name} must be an int >= 1, got {value!r}")
    tiles = Tiles(*data["tiles"])
    if not tiles.launchable():
        raise ValueError(f"{where}: tiles must be [block_n, block_k (powers of two >= 16), warps >= 1, "
                         f"stages >= 1, swap_ab (bool)(, block_tiles_first (bool))], got {list(tiles)}")
    if key.weights == "fp8" and tiles.block_k < MIN_FP8_BLOCK_K:
        raise ValueError(f"{where}: FP8 tiles must be at least {MIN_FP8_BLOCK_K} deep, got block_k {tiles.block_k}")
    us = {str(name): float(value) for name, value in data["us"].items()}
    return Entry(key, tiles, us)


def dump(table: Table, path: str) -> None:
    """Writes ``table`` to ``path`` as JSON, one entry a line."""
    choice_table.dump_entries(table.to_json(), path)
