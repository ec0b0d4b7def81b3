"""Command-line argument types shared by the demo and the server (``python -m jaxattn.serve.demo``,
``python -m jaxattn.serve``), the mesh their ``--tp`` makes, and their compilation cache."""

from __future__ import annotations

import argparse
import os
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


def add_compilation_cache_argument(parser: argparse.ArgumentParser) -> None:
    """``--compilation-cache-dir``: JAX's persistent compilation cache, on by default, so that a
    restart with the same model and engine loads its compiled steps instead of compiling them
    (the serving benchmarks' second H100 run of the same step shapes warmed up in 26 s, the first
    in 224 s)."""
    default = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "jaxattn", "xla")
    parser.add_argument("--compilation-cache-dir", metavar="DIR", default=default,
                        help="keep the compiled steps here for the next start (JAX's persistent compilation cache; "
                             "'' turns it off; default: $JAX_COMPILATION_CACHE_DIR, else %(default)s)")


def use_compilation_cache(directory: str) -> None:
    """Points JAX's persistent compilation cache at ``directory`` ('' leaves it off)."""
    if directory:
        jax.config.update("jax_compilation_cache_dir", directory)
