"""The benchmarks' CPU smoke modes run (each in a fresh Python, as on the device): they measure
nothing, but keep the benchmarks from breaking between GPU sessions. And RESULTS.md's headline
table is the one its sections give."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.xla_dump import REPO


@pytest.mark.parametrize("module", ["bench_tp", "bench_serving", "bench_mla"])
def test_smoke_run(module, tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--smoke"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


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

    row = "| B=64 kv=U[2048,4096] | 192.1 (4.15) |"   # the trtllm-decode section's target point
    assert committed.count(row) == 1
    copy.write_text(committed.replace(row, "| B=64 kv=U[2048,4096] | 180.0 (4.15) |"))
    with pytest.raises(SystemExit, match="stale"):
        headline.main(["--check", "--file", str(copy)])
    headline.main(["--file", str(copy)])
    assert "| 180.0 us, trtllm | flashinfer xqa 196.8 us | 1.09x |" in copy.read_text()


def test_tune_mla_candidates_compile_for_sm90(tmp_path):
    """tune_mla's compile phase (CPU processes, no GPU): every point's quick candidates build."""
    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip(f"no {ptxas}")
    env = dict(os.environ, OUT=str(tmp_path), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "benchmarks.tune_mla", "--quick", "--compile-only"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "failed: none" in result.stdout
