"""tests/conftest.py's ``--shard K/N`` (contiguous parts of the selected tests that together run
each once) and its ``-n auto`` worker count."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _collect(*args: str) -> subprocess.CompletedProcess:
    """``pytest --collect-only -q tests/test_metadata.py *args`` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/test_metadata.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _collected(*args: str) -> list[str]:
    result = _collect(*args)
    assert result.returncode in (0, 5), result.stdout[-2000:] + result.stderr[-2000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_shards_split_the_selected_tests_into_contiguous_parts():
    everything = _collected("-k", "not gpu")
    parts = [_collected("-k", "not gpu", "--shard", f"{k}/3") for k in (1, 2, 3)]
    assert len(everything) >= 3 and all(parts)
    assert sum(parts, []) == everything


def test_a_bad_shard_is_a_usage_error():
    result = _collect("--shard", "4/3")
    assert result.returncode == 4 and re.search(r"--shard K/N needs 1 <= K <= N", result.stderr)


def test_auto_workers_follow_cores_and_memory_and_none_with_a_gpu(monkeypatch):
    from tests import conftest

    gib = 1 << 30
    monkeypatch.setattr(conftest, "HAS_GPU", False)
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    for memory, workers in ((64 * gib, conftest.MAX_WORKERS), (13 * gib, 2), (4 * gib, 1)):
        monkeypatch.setattr(conftest.os, "sysconf", lambda name, memory=memory: {"SC_PAGE_SIZE": 4096,
                                                                                 "SC_PHYS_PAGES": memory // 4096}[name])
        assert conftest.pytest_xdist_auto_num_workers(None) == workers, memory
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert conftest.pytest_xdist_auto_num_workers(None) == 1
    monkeypatch.setattr(conftest, "HAS_GPU", True)
    assert conftest.pytest_xdist_auto_num_workers(None) == 0
