"""Compiles, caches and registers TensorRT-LLM XQA decode kernels as XLA FFI targets.

The kernel sources come from the installed ``flashinfer-python`` package
(``flashinfer/data/csrc/xqa``; never copied into jaxattn). Each variant (dtypes, page size,
head dim, group size, sliding window, speculative decode) becomes one shared library:
``ffi/xqa_kernel.cu`` (a unity build of XQA's ``mha.cu`` or ``mha_sm90.cu``) linked with the
handler ``ffi/xqa_ffi.cu``, built
by nvcc on first use against the XLA FFI headers of the running jaxlib, and cached on disk under
a key of the variant, every source and header, the compiler and the FFI headers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
from pathlib import Path

from jaxattn.backends import _nvcc
from jaxattn.backends._nvcc import ARCH, BuildError, find_nvcc

FP8 = "float8_e4m3fn"
_C_TYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half"}
_load_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled XQA kernel: everything XQA fixes at compile time."""

    dtype: str          # q/out: "bfloat16" or "float16"
    cache_dtype: str    # KV pages: ``dtype`` or "float8_e4m3fn"
    page_size: int      # 16, 32, 64 or 128
    head_dim: int       # 64, 128 or 256
    group_size: int     # query heads per KV head
    sliding_window: bool
    # Speculative decode: a ``SPEC_DEC=1`` build of mha.cu, one request per sequence with up to
    # q_len query tokens (ragged, by cumulative offsets) and a bit mask over its last q_len keys.
    # The length is not a compile-time constant of mha.cu (only mha_sm90.cu's SWAP_AB path,
    # ``SPEC_Q_SEQ_LEN``, fixes it), so one build serves every q_len.
    spec_dec: bool = False

    @property
    def hopper(self) -> bool:
        """fp8 decode runs XQA's SM90 TMA/GMMA kernel (as flashinfer does); the rest, fp8
        speculative decode included, mha.cu (flashinfer's own choice for ragged q)."""
        return self.cache_dtype == FP8 and not self.spec_dec

    @property
    def name(self) -> str:
        kv = "e4m3" if self.cache_dtype == FP8 else self.cache_dtype
        window = "_window" if self.sliding_window else ""
        spec = "_spec" if self.spec_dec else ""
        return (f"{self.dtype}_kv_{kv}_page{self.page_size}_d{self.head_dim}"
                f"_g{self.group_size}{window}{spec}")

    @property
    def target_name(self) -> str:
        return f"jaxattn_xqa_{self.name}"

    def defines(self) -> list[str]:
        return [
            "-DNDEBUG=1", "-DBEAM_WIDTH=1", "-DUSE_INPUT_KV=0", "-DUSE_CUSTOM_BARRIER=1",
            f"-DTOKENS_PER_PAGE={self.page_size}",
            f"-DHEAD_ELEMS={self.head_dim}",
            f"-DINPUT_FP16={int(self.dtype == 'float16')}",
            f"-DDTYPE={_C_TYPES[self.dtype]}",
            f"-DCACHE_ELEM_ENUM={2 if self.cache_dtype == FP8 else 0}",
            f"-DHEAD_GRP_SIZE={self.group_size}",
            f"-DSLIDING_WINDOW={int(self.sliding_window)}",
            "-DLOW_PREC_OUTPUT=0", f"-DSPEC_DEC={int(self.spec_dec)}", "-DIS_SPEC_DEC_TREE=0",
            "-DMLA_WRAPPER=0",
            f"-DUSE_SM90_MHA={int(self.hopper)}",
            f"-DJAXATTN_XQA_HOPPER={int(self.hopper)}",
        ]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A loaded variant: its FFI target (registered for platform CUDA) and trace-time queries."""

    variant: Variant
    library: ctypes.CDLL

    @property
    def target_name(self) -> str:
        return self.variant.target_name

    def workspace(self, sm_count: int, batch: int, num_kv_heads: int, max_pages_per_seq: int,
                  q_seq_len: int = 1) -> tuple[int, int]:
        """(semaphores, scratch bytes) of one launch, both 0 unless XQA splits sequences over
        CTAs; ValueError past XQA's 32-bit scratch offsets. ``q_seq_len``: the bound on query
        tokens per request (1 unless ``spec_dec``)."""
        semaphores, scratch = ctypes.c_int64(), ctypes.c_int64()
        status = self.library.jaxattn_xqa_workspace(sm_count, batch, num_kv_heads, max_pages_per_seq, q_seq_len,
                                                    ctypes.byref(semaphores), ctypes.byref(scratch))
        if status == -2:
            raise ValueError(f"paged_attention: backend 'trtllm': XQA variant {self.variant.name} cannot take "
                             f"q_seq_len={q_seq_len}")
        if status != 0:
            raise ValueError(f"paged_attention: backend 'trtllm': the XQA scratch for batch={batch}, "
                             f"num_kv_heads={num_kv_heads}, max_pages_per_seq={max_pages_per_seq} "
                             f"exceeds the kernel's 32-bit offsets; use a smaller batch or fewer pages")
        return semaphores.value, scratch.value

    def variant_info(self) -> dict[str, int]:
        """The compile-time constants the library reports (a check of the build)."""
        values = (ctypes.c_uint32 * 8)()
        self.library.jaxattn_xqa_variant_info(values)
        keys = ("head_dim", "group_size", "page_size", "input_fp16", "cache_fp8", "sliding_window",
                "hopper_kernel", "spec_dec")
        return dict(zip(keys, values))


def xqa_source_dir() -> Path:
    """XQA's sources: ``$JAXATTN_XQA_SOURCES`` if set, else ``flashinfer/data/csrc/xqa`` of the
    installed flashinfer-python."""
    override = os.environ.get("JAXATTN_XQA_SOURCES")
    if override:
        path = Path(override)
    else:
        path = _nvcc.flashinfer_data_dir("the trtllm backend compiles the XQA kernels from its sources (or set "
                                         "JAXATTN_XQA_SOURCES to a copy of its data/csrc/xqa)") / "csrc" / "xqa"
    if not (path / "mha.cu").is_file():
        raise BuildError(f"no XQA sources (mha.cu) in {path}")
    return path


def check_toolchain() -> str:
    """The nvcc to use, after checking it and the XQA sources; BuildError naming what is missing."""
    xqa_source_dir()
    _nvcc.ffi_source_dir("xqa_kernel.cu")
    nvcc = find_nvcc()
    _nvcc.nvcc_version(nvcc)
    return nvcc


def _commands(variant: Variant, nvcc: str, xqa_dir: Path, ffi_dir: Path,
              out: Path) -> tuple[list[list[str]], list[str]]:
    """nvcc compile commands (independent, run in parallel) and the link command."""
    common = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
              "-Xcompiler=-fPIC,-fvisibility=hidden", f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}",
              "-I", str(xqa_dir), "-I", str(ffi_dir), "-w"]
    kernel = common + variant.defines() + ["-use_fast_math", "-static-global-template-stub=false",
                                           "-Xfatbin=-compress-all"]
    sources = {"kernel.o": (kernel, ffi_dir / "xqa_kernel.cu"),
               "ffi.o": (common + ["-I", str(_nvcc.ffi_include_dir())], ffi_dir / "xqa_ffi.cu")}
    if variant.hopper:
        sources["tensor_map.o"] = (kernel, xqa_dir / "tensorMap.cpp")
    compiles = [flags + ["-c", str(src), "-o", str(out / obj)] for obj, (flags, src) in sources.items()]
    link = [nvcc, "-shared", "-Xcompiler=-fvisibility=hidden", "-o", str(out / "libjaxattn_xqa.so")]
    return compiles, link + [str(out / obj) for obj in sources]


def build(variant: Variant, *, quiet: bool = False) -> Path:
    """Path of the variant's shared library, compiling it (a few seconds to a minute) if not cached."""
    nvcc = check_toolchain()
    xqa_dir, ffi_dir = xqa_source_dir(), _nvcc.ffi_source_dir("xqa_kernel.cu")
    files = sorted(p for p in xqa_dir.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    files += sorted(ffi_dir.glob("xqa*"))
    final_dir = _nvcc.cache_root() / "xqa" / f"{variant.name}-{_nvcc.source_key(nvcc, variant, files)}"
    return _nvcc.build_cached(final_dir, "libjaxattn_xqa.so", f"XQA decode kernel {variant.name} with {nvcc}",
                              lambda out: _commands(variant, nvcc, xqa_dir, ffi_dir, out), quiet=quiet)


_kernels: dict[Variant, Kernel] = {}


def load(variant: Variant) -> Kernel:
    """The variant's kernel, built if needed and registered with ``jax.ffi`` (once per process)."""
    with _load_lock:
        kernel = _kernels.get(variant)
        if kernel is None:
            import jax.ffi
            library = ctypes.CDLL(str(build(variant)))
            library.jaxattn_xqa_workspace.restype = ctypes.c_int32
            library.jaxattn_xqa_workspace.argtypes = [ctypes.c_int32] * 5 + [ctypes.POINTER(ctypes.c_int64)] * 2
            library.jaxattn_xqa_variant_info.argtypes = [ctypes.POINTER(ctypes.c_uint32)]
            for symbol in ("jaxattn_xqa_state_type_id", "jaxattn_xqa_state_type_info"):
                getattr(library, symbol).restype = ctypes.c_void_p
            # The per-call semaphore state's type must be known before the target that uses it,
            # and JAX replays queued targets before queued types when it creates a backend:
            # create the backends first so that both registrations apply at once, in order.
            jax.devices()
            jax.ffi.register_ffi_type(
                f"{variant.target_name}_semaphores",
                {"type_id": jax.ffi.pycapsule(library.jaxattn_xqa_state_type_id()),
                 "type_info": jax.ffi.pycapsule(library.jaxattn_xqa_state_type_info())},
                platform="CUDA")
            jax.ffi.register_ffi_target(
                variant.target_name,
                {"instantiate": jax.ffi.pycapsule(library.JaxattnXqaInstantiate),
                 "initialize": jax.ffi.pycapsule(library.JaxattnXqaInitialize),
                 "execute": jax.ffi.pycapsule(library.JaxattnXqaSpecExecute if variant.spec_dec
                                              else library.JaxattnXqaExecute)},
                platform="CUDA")
            kernel = _kernels[variant] = Kernel(variant, library)
        return kernel
