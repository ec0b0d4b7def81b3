"""Shared test setup: the `gpu` marker skips without a CUDA device."""

from __future__ import annotations

import pytest

from jaxattn.backends.base import gpu_devices

HAS_GPU = bool(gpu_devices())


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
