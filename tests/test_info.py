"""``python -m jaxattn.info`` reports versions and a line per backend."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxattn import backends, choice_table, info
from jaxattn.backends.base import NO_GPU
from tests.conftest import HAS_GPU


def test_report_lists_every_backend_with_a_reason():
    text = info.report()
    backend_lines = text.split("jaxattn backends:")[1].splitlines()
    for name in backends.ALL_BACKENDS:
        line = next(l for l in backend_lines if l.strip().startswith(name + " "))
        reason = backends.unavailable_reason(name)
        assert ("available" in line) if reason is None else (reason in line)
    assert "jax " in text and "xla        available" in text


def test_report_lists_ops_by_backends_from_the_registry():
    listed, op = {}, None
    for line in info.report().split("Ops x backends")[1].splitlines()[1:]:
        if line.startswith("    "):
            listed[op].append(line.split()[0])
        else:
            op = line.strip().rstrip(":")
            listed[op] = []
    assert listed == {op: list(backends.names(op)) for op in backends.OPS}


def test_without_a_gpu_every_gpu_backend_says_so():
    if HAS_GPU:
        pytest.skip("a GPU is visible")
    text = info.report()
    for name in backends.ALL_BACKENDS[1:]:
        assert f"  {name:<10} unavailable: {NO_GPU}" in text
    handler = next(line for line in text.splitlines() if "cuDNN handler" in line)
    assert "install" not in handler, "no install advice for the GPU handler on a machine without a GPU"


def test_report_says_which_table_auto_reads():
    line = next(line for line in info.report().splitlines() if line.startswith("auto's measured table: "))
    assert line.endswith(choice_table.describe_current_table())


def test_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "jaxattn.info"], capture_output=True, text=True, check=True)
    assert "jaxattn backends:" in result.stdout
