"""The kernels' tests run twice: under Triton's interpreter on the CPU, and compiled on a GPU
(the ``gpu`` marker: the device suite, ``pytest -m gpu``, runs that half)."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def on_platform(request):
    """Runs the test body with that platform's first device as the default device."""
    with jax.default_device(jax.devices(request.param)[0]):
        yield request.param
