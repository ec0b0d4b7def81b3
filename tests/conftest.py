"""Shared test setup: the `gpu` marker skips without a CUDA device, `multigpu` with fewer than 2;
each module's compiled functions are dropped after it; `-n auto` (pytest-xdist, the README's test
command) picks how many processes run the tests."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import jax
import pytest

from jaxattn.backends import _nvcc
from jaxattn.backends.base import gpu_devices

HAS_GPU = bool(gpu_devices())
NUM_GPUS = len(gpu_devices())


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_functions():
    """After each module, drops the compiled functions it left in JAX's caches and the engine
    step's. XLA's CPU backend maps every executable's code into memory: the whole suite in one
    process (about 900 tests, thousands of compilations) passed Linux's vm.max_map_count (65530),
    and the next compilation segfaulted."""
    yield
    from jaxattn.serve.step import _jitted_step

    _jitted_step.cache_clear()
    jax.clear_caches()
    gc.collect()


MAX_WORKERS = 4
WORKER_MEMORY = 6 << 30      # a worker's peak resident memory seen on the CPU suite: 5.8 GB (2026-11-28)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one process per core, up to ``MAX_WORKERS`` and as many as the machine's memory
    holds at ``WORKER_MEMORY`` each (each process compiles on about one core and keeps its own JAX
    caches); none on a machine with a GPU (0: the tests run in this process), whose GPU tests would
    share one device's memory."""
    if HAS_GPU:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        memory = MAX_WORKERS * WORKER_MEMORY
    return max(1, min(cores, MAX_WORKERS, memory // WORKER_MEMORY))


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only the K-th (from 1) of N contiguous parts of the selected tests, e.g. the GPU "
                          "suite over several device calls (-m gpu --shard 1/3, then 2/3, 3/3)")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the parts split what would run
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (run with -m gpu on the device machine)")
    skip_multigpu = pytest.mark.skip(reason=f"needs 2 or more NVIDIA GPUs, found {NUM_GPUS}")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and NUM_GPUS < 2:
            item.add_marker(skip_multigpu)
    if config.getoption("shard"):
        part, parts = _shard(config.getoption("shard"))
        start, stop = (part - 1) * len(items) // parts, part * len(items) // parts
        config.hook.pytest_deselected(items=items[:start] + items[stop:])
        items[:] = items[start:stop]


def _shard(value: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N), 1 <= K <= N."""
    try:
        part, parts = (int(x) for x in value.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard expects K/N (two integers), got {value!r}") from None
    if not 1 <= part <= parts:
        raise pytest.UsageError(f"--shard K/N needs 1 <= K <= N, got {value!r}")
    return part, parts


PARITY_REASON = ("needs torch and transformers, the [parity] extra (pip install -e \".[test,parity]\", "
                 "a CPU torch is enough): a transformers parity test")


def require_parity():
    """Skips the calling test (or fixture, or module) unless torch and transformers are installed;
    returns the transformers module."""
    pytest.importorskip("torch", reason=PARITY_REASON)
    return pytest.importorskip("transformers", reason=PARITY_REASON)


def unpacked_flashinfer_data(tmp_path_factory, prefixes: tuple[str, ...]) -> Path:
    """``flashinfer/data`` with the parts under ``prefixes`` unpacked from the pinned
    flashinfer-python wheel, fetched from PyPI without dependencies; skips if it cannot be fetched."""
    tmp = tmp_path_factory.mktemp("flashinfer")
    fetch = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                            "-d", str(tmp), f"flashinfer-python=={_nvcc.FLASHINFER_VERSION}"],
                           capture_output=True, text=True, timeout=300)
    wheels = list(tmp.glob("flashinfer_python-*.whl"))
    if fetch.returncode != 0 or not wheels:
        pytest.skip(f"flashinfer-python is not installed and its wheel could not be fetched: {fetch.stderr[-300:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wanted = tuple("flashinfer/data/" + p for p in prefixes)
        wheel.extractall(tmp, [n for n in wheel.namelist() if n.startswith(wanted)])
    return tmp / "flashinfer" / "data"
