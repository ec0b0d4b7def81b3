"""Command-line argument types shared by the demo and the server (``python -m jaxattn.demo``,
``python -m jaxattn.serve``)."""

from __future__ import annotations

import argparse

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
