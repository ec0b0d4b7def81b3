"""The Triton kernels a function launches, compiled for a GPU architecture without a GPU (the
installed Triton's own ptxas), for tests that inspect what a GPU would run: its MMA instructions,
registers and spills. Call it in a fresh process: Triton's interpreter, which the CPU tests run,
leaves Triton's language module patched."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jaxattn.kernels.triton_call import _compile


def compiled_kernels(fn: Callable, *args, capability: int = 90) -> dict:
    """``{kernel name: triton's compiled kernel}`` of each ``triton_call`` in ``fn(*args)``'s jaxpr
    (its top level), compiled for compute capability ``capability``."""
    compiled = {}
    for eqn in (e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "jaxattn_triton_call"):
        dtypes = tuple(np.dtype(v.aval.dtype) for v in [*eqn.invars, *eqn.outvars])
        compiled[eqn.params["kernel"].fn.__name__] = _compile(eqn.params["kernel"], dtypes, eqn.params["metaparams"],
                                                              eqn.params["num_warps"], eqn.params["num_stages"],
                                                              capability)
    return compiled
