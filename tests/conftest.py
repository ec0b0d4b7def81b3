"""Shared test setup: the `gpu` marker skips without a CUDA device, `multigpu` with fewer than 2."""

from __future__ import annotations

import pytest

from jaxattn.backends.base import gpu_devices

HAS_GPU = bool(gpu_devices())
NUM_GPUS = len(gpu_devices())


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (run with -m gpu on the device machine)")
    skip_multigpu = pytest.mark.skip(reason=f"needs 2 or more NVIDIA GPUs, found {NUM_GPUS}")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and NUM_GPUS < 2:
            item.add_marker(skip_multigpu)
