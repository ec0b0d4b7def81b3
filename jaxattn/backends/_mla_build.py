"""Compiles, caches and registers FlashInfer's SM90 MLA paged attention kernel as an XLA FFI target.

``ffi/mla_ffi.cu`` instantiates ``flashinfer::mla::BatchMLAPageAttentionHopper`` from the headers
of the installed ``flashinfer-python`` (``flashinfer/data/include`` with the CUTLASS and CCCL
copies it ships; nothing is copied into jaxattn). One shared library per variant (query/page
dtype, latent widths), built by nvcc on first use (about 20 s) and cached like the XQA kernels
(``_nvcc.build_cached``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from pathlib import Path

from jaxattn.backends import _nvcc
from jaxattn.backends._nvcc import ARCH, BuildError

_C_TYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float8_e4m3fn": "__nv_fp8_e4m3"}
_HANDLER = "mla_ffi.cu"
_load_lock = threading.Lock()
_loaded: dict["Variant", str] = {}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled kernel: query/output dtype, page dtype, and the latent widths."""

    dtype: str           # q and out: "bfloat16" or "float16"
    cache_dtype: str     # pages: ``dtype`` or "float8_e4m3fn"
    kv_lora_rank: int    # c_kv width (FlashInfer's head_dim_ckv): 512
    rope_dim: int        # k_rope width (head_dim_kpe): 64

    @property
    def name(self) -> str:
        kv = "e4m3" if self.cache_dtype == "float8_e4m3fn" else self.cache_dtype
        return f"{self.dtype}_kv_{kv}_ckv{self.kv_lora_rank}_kpe{self.rope_dim}"

    @property
    def target_name(self) -> str:
        return f"jaxattn_flashinfer_mla_{self.name}"


def include_dirs() -> list[Path]:
    """FlashInfer's headers and the CUTLASS/CCCL copies its JIT compiles them with."""
    data = _nvcc.flashinfer_data_dir("the flashinfer backend compiles FlashInfer's MLA kernel from its headers")
    dirs = [data / "cccl" / "cub", data / "cccl" / "libcudacxx" / "include", data / "cccl" / "thrust",
            data / "include", data / "cutlass" / "include", data / "cutlass" / "tools" / "util" / "include"]
    if not (data / "include" / "flashinfer" / "attention" / "mla_hopper.cuh").is_file():
        raise BuildError(f"no FlashInfer MLA headers (flashinfer/attention/mla_hopper.cuh) in {data / 'include'}")
    return dirs


def check_toolchain() -> str:
    """The nvcc to use, after checking it, FlashInfer's headers and the handler source."""
    include_dirs()
    _nvcc.ffi_source_dir(_HANDLER)
    nvcc = _nvcc.find_nvcc()
    _nvcc.nvcc_version(nvcc)
    return nvcc


def _commands(variant: Variant, nvcc: str, out: Path) -> tuple[list[list[str]], list[str]]:
    source = _nvcc.ffi_source_dir(_HANDLER) / _HANDLER
    compile_ = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-use_fast_math",
                "-Xcompiler=-fPIC,-fvisibility=hidden", f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}", "-w",
                "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED", "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_F16",
                "-DFLASHINFER_ENABLE_FP8_E4M3",
                f"-DJAXATTN_MLA_DTYPE={_C_TYPES[variant.dtype]}",
                f"-DJAXATTN_MLA_KV_DTYPE={_C_TYPES[variant.cache_dtype]}",
                f"-DJAXATTN_MLA_HEAD_DIM_CKV={variant.kv_lora_rank}", f"-DJAXATTN_MLA_HEAD_DIM_KPE={variant.rope_dim}"]
    compile_ += [f"-I{d}" for d in include_dirs()] + [f"-I{_nvcc.ffi_include_dir()}"]
    obj = out / "mla_ffi.o"
    link = [nvcc, "-shared", "-Xcompiler=-fvisibility=hidden", "-o", str(out / "libjaxattn_mla.so"), str(obj)]
    return [compile_ + ["-c", str(source), "-o", str(obj)]], link


def build(variant: Variant, *, quiet: bool = False) -> Path:
    """Path of the variant's shared library, compiled first if not cached."""
    nvcc = check_toolchain()
    attention = include_dirs()[3] / "flashinfer" / "attention"
    files = [_nvcc.ffi_source_dir(_HANDLER) / _HANDLER] + sorted(attention.glob("mla*.cuh"))
    final_dir = _nvcc.cache_root() / "mla" / f"{variant.name}-{_nvcc.source_key(nvcc, variant, files)}"
    return _nvcc.build_cached(final_dir, "libjaxattn_mla.so", f"FlashInfer MLA kernel {variant.name} with {nvcc}",
                              lambda out: _commands(variant, nvcc, out), quiet=quiet)


def load(variant: Variant) -> str:
    """The variant's FFI target name, built if needed and registered (once per process)."""
    with _load_lock:
        if variant not in _loaded:
            import jax.ffi
            library = ctypes.CDLL(str(build(variant)))
            jax.ffi.register_ffi_target(variant.target_name, jax.ffi.pycapsule(library.JaxattnMlaExecute),
                                        platform="CUDA")
            _loaded[variant] = variant.target_name
        return _loaded[variant]
