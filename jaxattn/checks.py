"""Argument checks shared by the public API: static numbers, and int arrays given as arrays or lists."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


def is_int(x) -> bool:
    """A static Python or NumPy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


# Static sizes, lengths and counts end up in int32 arrays (lengths, offsets, slots).
INT32_MAX = int(np.iinfo(np.int32).max)


def is_positive_int(x) -> bool:
    """A static integer in ``[1, INT32_MAX]``."""
    return is_int(x) and 1 <= x <= INT32_MAX


def check_sizes(where: str, **sizes) -> None:
    """ValueError naming the first of ``sizes`` (static ints) that is not in ``[1, 2**31 - 1]``."""
    for name, value in sizes.items():
        if not is_positive_int(value):
            raise ValueError(f"{where}: {name} must be an int in [1, 2**31 - 1], got {value!r}")


def is_real(x) -> bool:
    """A static Python or NumPy number, not a bool (a traced array cannot be a static option)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def is_positive_float32(x) -> bool:
    """A static real number that float32 holds as a positive finite number (the kernels take
    scales and caps as float32: 1e39 would be inf there, 1e-50 zero)."""
    if not is_real(x):
        return False
    try:
        value = float(x)
    except OverflowError:                    # an int too large for a float
        return False
    return math.isfinite(value) and abs(value) <= float(np.finfo(np.float32).max) and float(np.float32(value)) > 0


def int_array(where: str, name: str, value, expected: str, shape: tuple[int, ...] | None = None) -> jax.Array:
    """``value`` (an array or a nested list of ints) as int32; ValueError naming ``name`` when it
    is not integer-valued or, with ``shape``, not of that shape."""
    try:
        array = jnp.asarray(int32_values(value))
    except OverflowError as err:
        raise ValueError(f"{where}: {name} must be {expected} with int32 values, got {err}") from None
    except (TypeError, ValueError):
        array = None
    if array is None or not jnp.issubdtype(array.dtype, jnp.integer) or (shape is not None and array.shape != shape):
        got = f"{array.dtype}{list(array.shape)}" if array is not None else type(value).__name__
        raise ValueError(f"{where}: {name} must be {expected}, got {got}")
    return array.astype(jnp.int32)


def int32_values(value):
    """``value`` unchanged, but OverflowError (``int_array``: a ValueError naming the argument)
    when it is a host array or list of integers outside int32 (JAX would wrap them silently, e.g.
    an int64 id of 2**32 into 0); jax arrays pass."""
    if isinstance(value, jax.Array):
        return value
    try:
        host = np.asarray(value)
    except (TypeError, ValueError):           # e.g. a list of traced scalars: JAX converts those
        return value
    if host.dtype.kind in "iu" and host.size and (host.min() < np.iinfo(np.int32).min or host.max() > INT32_MAX):
        raise OverflowError(f"values outside int32: {host.min()} .. {host.max()}")
    return value
