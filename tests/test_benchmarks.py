"""The benchmarks' CPU smoke modes run (each in a fresh Python, as on the device): they measure
nothing, but keep the benchmarks from breaking between GPU sessions."""
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
