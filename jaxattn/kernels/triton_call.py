"""``triton_call``: launches a ``@triton.jit`` kernel from JAX, in jax-triton's calling convention.

The kernel receives one pointer per input array, then one per output (an output aliased to an
input through ``input_output_aliases`` gets its pointer twice), then the ``constexpr`` keyword
arguments. Grids are static.

On CUDA the kernel is compiled at lowering time with the installed ``triton`` and launched through
jaxlib's typed-FFI target ``triton_kernel_call_ffi`` (as jax-triton 0.4 does). That handler is
command-buffer compatible, so XLA captures the launches into CUDA graphs; jax-triton 0.3.1, the
last release for triton 3.6, still emits the legacy ``triton_kernel_call``, which XLA never
captures. On CPU the same call runs the kernel under Triton's interpreter on host copies of the
arrays (for tests); outputs that are not aliased start as NaN (or -1 for integers) there, so rows a
kernel forgets to write show up.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
import triton
from jax.extend.core import Primitive
from jax.interpreters import mlir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

FFI_TARGET = "triton_kernel_call_ffi"

_TRITON_TYPES = {
    np.dtype(np.float32): "fp32",
    np.dtype(np.float16): "fp16",
    np.dtype(ml_dtypes.bfloat16): "bf16",
    np.dtype(ml_dtypes.float8_e4m3fn): "fp8e4nv",
    np.dtype(np.int32): "i32",
}


def triton_call(*args: jax.Array, kernel: JITFunction, out_shape: Sequence[jax.ShapeDtypeStruct],
                grid: tuple[int, ...], num_warps: int = 4, num_stages: int = 2,
                input_output_aliases: dict[int, int] | None = None, **metaparams: Any) -> list[jax.Array]:
    """Runs ``kernel[grid](*args, *outputs, **metaparams)``; returns the outputs.

    Args:
      args: device arrays (pointer arguments). Scalars that vary per call must be arrays too.
      out_shape: shapes and dtypes of the outputs.
      grid: up to three static program counts.
      input_output_aliases: ``{input index: output index}``; the output reuses the input's buffer
        and starts with its contents.
      metaparams: the kernel's ``tl.constexpr`` arguments (static).
    """
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if len(grid) != 3 or min(grid) < 1:
        raise ValueError(f"triton_call: grid must be 1 to 3 positive ints, got {grid}")
    out_shape = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape)
    for x in list(args) + list(out_shape):
        if np.dtype(x.dtype) not in _TRITON_TYPES:
            raise ValueError(f"triton_call: array dtype must be one of "
                             f"{sorted(str(d) for d in _TRITON_TYPES)}, got {x.dtype}")
    return _triton_call_p.bind(
        *args, kernel=kernel, out_shape=out_shape, grid=grid, num_warps=num_warps, num_stages=num_stages,
        aliases=tuple(sorted((input_output_aliases or {}).items())), metaparams=tuple(sorted(metaparams.items())))


_triton_call_p = Primitive("jaxattn_triton_call")
_triton_call_p.multiple_results = True


@_triton_call_p.def_abstract_eval
def _abstract_eval(*avals, out_shape, aliases, **_):
    for i, o in aliases:
        if (avals[i].shape, avals[i].dtype) != (out_shape[o].shape, out_shape[o].dtype):
            raise ValueError(f"triton_call: input {i} is aliased to output {o} but has another shape or dtype")
    return [jax.core.ShapedArray(s.shape, s.dtype) for s in out_shape]


def _pointer_signature(kernel: JITFunction, dtypes: Sequence[np.dtype], metaparams: dict[str, Any]) -> dict[str, str]:
    names = kernel.arg_names
    pointer_names = [n for n in names if n not in metaparams]
    if len(pointer_names) != len(dtypes):
        raise ValueError(f"triton_call: kernel {kernel.fn.__name__} takes pointers {pointer_names} "
                         f"but got {len(dtypes)} arrays (inputs + outputs)")
    types_ = iter(f"*{_TRITON_TYPES[np.dtype(d)]}" for d in dtypes)
    return {n: "constexpr" if n in metaparams else next(types_) for n in names}


@functools.cache
def _compile(kernel: JITFunction, dtypes: tuple[np.dtype, ...], metaparams: tuple, num_warps: int,
             num_stages: int, capability: int):
    """The compiled kernel (PTX and metadata) for one specialization."""
    constexprs = dict(metaparams)
    signature = _pointer_signature(kernel, dtypes, constexprs)
    # Every XLA buffer is at least 16-byte aligned: let Triton vectorize.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n not in constexprs}
    source = ASTSource(kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    if getattr(compiled.metadata, "global_scratch_size", 0):
        raise ValueError(f"triton_call: kernel {kernel.fn.__name__} needs Triton global scratch memory, "
                         f"which jaxlib's launcher does not provide")
    return compiled


def _lower_cuda(ctx, *operands, kernel, out_shape, grid, num_warps, num_stages, aliases, metaparams):
    from jax._src.lib import gpu_triton  # jaxlib's CUDA plugin: only on GPU machines

    capability = gpu_triton.get_compute_capability(0)
    dtypes = tuple(np.dtype(a.dtype) for a in list(ctx.avals_in) + list(ctx.avals_out))
    compiled = _compile(kernel, dtypes, metaparams, num_warps, num_stages, capability)
    name = compiled.metadata.name
    tk = gpu_triton.TritonKernel(name, num_warps, 1, compiled.metadata.shared, compiled.asm["ptx"], "", capability)
    params = [gpu_triton.create_array_parameter(0, 16) for _ in dtypes]
    call = gpu_triton.TritonKernelCall(tk, grid[0], grid[1], grid[2], params)
    rule = jax.ffi.ffi_lowering(FFI_TARGET, api_version=4, operand_output_aliases=dict(aliases))
    return rule(ctx, *operands, opaque=zlib.compress(call.to_proto(name, b"")))


class _HostBuffer:
    """The part of the torch tensor interface Triton's interpreter uses, over a numpy array."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = _TRITON_TYPES[array.dtype]

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    # The interpreter copies "device" storage to the host and back; these buffers are on the host.
    def untyped_storage(self) -> "_HostBuffer":
        return self

    def cpu(self) -> "_HostBuffer":
        return self

    def new_empty(self, *_, **__) -> "_HostBuffer":
        return self

    def set_(self, *_) -> "_HostBuffer":
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def copy_(self, other: "_HostBuffer") -> None:
        assert other is self


def _interpreted(fn: JITFunction) -> InterpretedFunction:
    # Keyed by id: hashing a JITFunction walks its globals, which the scope below swaps out.
    if id(fn) not in _INTERPRETED:
        _INTERPRETED[id(fn)] = (fn, InterpretedFunction(fn.fn))
    return _INTERPRETED[id(fn)][1]


_INTERPRETED: dict[int, tuple[JITFunction, InterpretedFunction]] = {}


@contextlib.contextmanager
def _interpreter_scope(kernel: JITFunction):
    """While the interpreter runs ``kernel``, the ``@triton.jit`` functions it may call (its module's
    helpers and Triton's own library, e.g. ``tl.zeros``, ``tl.max``) are interpreted too: Triton
    only does that by itself when ``TRITON_INTERPRET=1`` was set before it was imported."""
    # Triton imports this lazily while binding arguments; it must see the unpatched library.
    importlib.import_module("triton.experimental.gluon")
    modules = [m for n, m in list(sys.modules.items()) if m is not None and n.startswith("triton.language")]
    modules.append(sys.modules[kernel.fn.__module__])
    saved = [(m, name, value) for m in modules for name, value in list(vars(m).items())
             if isinstance(value, JITFunction)]
    replacements = [(m, name, _interpreted(value)) for m, name, value in saved + [(None, None, kernel)]]
    # Triton 3.6's interpreter turns scalars (1-element arrays) into loop bounds with int(), which
    # NumPy >= 2.4 refuses for arrays with ndim > 0; .item() takes them.
    replacements.append((interpreter, "_patch_lang_tensor", _patch_lang_tensor))
    saved.append((interpreter, "_patch_lang_tensor", interpreter._patch_lang_tensor))
    with _INTERPRETER_LOCK:
        try:
            for module, name, value in replacements:
                if module is not None:
                    setattr(module, name, value)
            yield
        finally:
            for module, name, value in saved:
                setattr(module, name, value)


def _patch_lang_tensor(tensor, scope) -> None:
    _PATCH_LANG_TENSOR(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: self.handle.data.item())


_INTERPRETER_LOCK = threading.Lock()
_PATCH_LANG_TENSOR = interpreter._patch_lang_tensor


def _poison(shape: tuple[int, ...], dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    fill = -1 if np.issubdtype(dtype, np.integer) else np.nan
    return np.full(shape, fill, np.float32 if fill is np.nan else dtype).astype(dtype)


def _interpret(*args, kernel, out_shape, grid, aliases, metaparams, **_):
    alias_of = {o: i for i, o in aliases}

    def host(*arrays):
        arrays = [np.array(a, copy=True) for a in arrays]
        outs = [np.array(arrays[alias_of[o]], copy=True) if o in alias_of else _poison(s.shape, s.dtype)
                for o, s in enumerate(out_shape)]
        with _interpreter_scope(kernel):
            _interpreted(kernel)[grid](*map(_HostBuffer, arrays + outs), **dict(metaparams))
        return outs

    return jax.pure_callback(host, list(out_shape), *args)


mlir.register_lowering(_triton_call_p, _lower_cuda, platform="cuda")
mlir.register_lowering(_triton_call_p, mlir.lower_fun(_interpret, multiple_results=True), platform="cpu")
