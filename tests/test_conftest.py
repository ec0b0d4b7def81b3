"""tests/conftest.py's ``--shard K/N``: contiguous parts of the selected tests that together run each once."""

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
