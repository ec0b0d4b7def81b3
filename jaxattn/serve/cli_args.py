"""Command-line argument types shared by the demo and the server (``python -m jaxattn.serve.demo``,
``python -m jaxattn.serve``), and the mesh their ``--tp`` makes."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

DTYPES = ("float32", "bfloat16", "float16")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def tp_mesh(devices: Sequence[jax.Device]) -> Mesh | None:
    """The one-axis ("tp", Auto) mesh a ``--tp`` run splits the model over, or None for one device."""
    if len(devices) == 1:
        return None
    return jax.make_mesh((len(devices),), ("tp",), axis_types=(AxisType.Auto,), devices=devices)
