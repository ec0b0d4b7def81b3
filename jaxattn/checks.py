"""Argument checks shared by the public API: static numbers, and int arrays given as arrays or lists."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np


def is_int(x) -> bool:
    """A static Python or NumPy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def is_positive_int(x) -> bool:
    return is_int(x) and x >= 1


def is_real(x) -> bool:
    """A static Python or NumPy number, not a bool (a traced array cannot be a static option)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def int_array(where: str, name: str, value, expected: str, shape: tuple[int, ...] | None = None) -> jax.Array:
    """``value`` (an array or a nested list of ints) as int32; ValueError naming ``name`` when it
    is not integer-valued or, with ``shape``, not of that shape."""
    try:
        array = jnp.asarray(value)
    except (TypeError, ValueError):
        array = None
    if array is None or not jnp.issubdtype(array.dtype, jnp.integer) or (shape is not None and array.shape != shape):
        got = f"{array.dtype}{list(array.shape)}" if array is not None else type(value).__name__
        raise ValueError(f"{where}: {name} must be {expected}, got {got}")
    return array.astype(jnp.int32)
