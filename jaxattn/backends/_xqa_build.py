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
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# The flashinfer-python release whose XQA sources jaxattn is tested with.
FLASHINFER_VERSION = "0.7.2.post1"
ARCH = "90a"  # XQA's Hopper kernel uses wgmma/TMA, so SM90 builds need the "a" target.
FP8 = "float8_e4m3fn"
_C_TYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half"}
SYSTEM_NVCC = Path("/usr/local/cuda/bin/nvcc")
# The wheel ships the handler sources in jaxattn/ffi (see CMakeLists.txt); a source checkout
# (editable install) has them in ffi/ at the repository root.
_FFI_DIR_CANDIDATES = (Path(__file__).resolve().parents[1] / "ffi", Path(__file__).resolve().parents[2] / "ffi")
_load_lock = threading.Lock()


class BuildError(RuntimeError):
    """The XQA kernels cannot be built here (no nvcc, no flashinfer sources, compile failure)."""


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


def find_nvcc() -> str:
    """nvcc from ``CUDA_HOME``/``CUDA_PATH``, PATH, /usr/local/cuda or the nvidia-cuda-nvcc wheel."""
    candidates = [Path(os.environ[v]) / "bin" / "nvcc" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(SYSTEM_NVCC)
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(Path(root).glob("*/bin/nvcc"))     # nvidia/cuda_nvcc, nvidia/cu13
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise BuildError("nvcc (CUDA >= 12.8) not found: the trtllm backend compiles XQA kernels on first use. "
                     "Set CUDA_HOME, put nvcc on PATH, or `pip install nvidia-cuda-nvcc`")


def xqa_source_dir() -> Path:
    """XQA's sources: ``$JAXATTN_XQA_SOURCES`` if set, else ``flashinfer/data/csrc/xqa`` of the
    installed flashinfer-python (located, not imported: importing it needs torch)."""
    override = os.environ.get("JAXATTN_XQA_SOURCES")
    if override:
        path = Path(override)
    else:
        spec = importlib.util.find_spec("flashinfer")
        if spec is None or not spec.submodule_search_locations:
            raise BuildError(f"flashinfer-python is not installed: the trtllm backend compiles the XQA kernels "
                             f"from its sources (`pip install flashinfer-python=={FLASHINFER_VERSION}`, or set "
                             f"JAXATTN_XQA_SOURCES to a copy of its data/csrc/xqa)")
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / "csrc" / "xqa"
    if not (path / "mha.cu").is_file():
        raise BuildError(f"no XQA sources (mha.cu) in {path}")
    return path


def ffi_source_dir() -> Path:
    for path in _FFI_DIR_CANDIDATES:
        if (path / "xqa_kernel.cu").is_file():
            return path
    raise BuildError(f"jaxattn's XQA handler sources (ffi/xqa_*.cu) were not found in {_FFI_DIR_CANDIDATES}")


def cache_dir() -> Path:
    root = os.environ.get("JAXATTN_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxattn"
    return Path(root) / "xqa"


def check_toolchain() -> str:
    """The nvcc to use, after checking it and the XQA sources; BuildError naming what is missing."""
    xqa_source_dir()
    ffi_source_dir()
    nvcc = find_nvcc()
    _nvcc_version(nvcc)
    return nvcc


@functools.cache
def _nvcc_version(nvcc: str) -> tuple[int, int]:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise BuildError(f"`{nvcc} --version` failed: {err}") from err
    match = re.search(r"release (\d+)\.(\d+)", out)
    if not match:
        raise BuildError(f"cannot parse `{nvcc} --version`: {out[-200:]}")
    version = (int(match.group(1)), int(match.group(2)))
    if version < (12, 8):
        raise BuildError(f"{nvcc} is CUDA {version[0]}.{version[1]}; the XQA kernels need CUDA >= 12.8")
    return version


def _ffi_include_dir() -> Path:
    import jax.ffi
    return Path(jax.ffi.include_dir())


def _commands(variant: Variant, nvcc: str, xqa_dir: Path, ffi_dir: Path, out: Path) -> tuple[list[list[str]], list[str]]:
    """nvcc compile commands (independent, run in parallel) and the link command."""
    common = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
              "-Xcompiler=-fPIC,-fvisibility=hidden", f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}",
              "-I", str(xqa_dir), "-I", str(ffi_dir), "-w"]
    kernel = common + variant.defines() + ["-use_fast_math", "-static-global-template-stub=false",
                                           "-Xfatbin=-compress-all"]
    sources = {"kernel.o": (kernel, ffi_dir / "xqa_kernel.cu"),
               "ffi.o": (common + ["-I", str(_ffi_include_dir())], ffi_dir / "xqa_ffi.cu")}
    if variant.hopper:
        sources["tensor_map.o"] = (kernel, xqa_dir / "tensorMap.cpp")
    compiles = [flags + ["-c", str(src), "-o", str(out / obj)] for obj, (flags, src) in sources.items()]
    link = [nvcc, "-shared", "-Xcompiler=-fvisibility=hidden", "-o", str(out / "libjaxattn_xqa.so")]
    return compiles, link + [str(out / obj) for obj in sources]


def _run(commands: list[list[str]], variant: Variant, start: float, quiet: bool) -> None:
    """Runs the commands in parallel; BuildError with the log of the first failure."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    logs = [proc.communicate()[0] for proc in procs]
    for cmd, proc, log in zip(commands, procs, logs):
        if proc.returncode != 0:
            raise BuildError(f"building XQA variant {variant.name} failed:\n{' '.join(cmd)}\n{log[-4000:]}")
        if not quiet:
            print(f"jaxattn:   [{time.perf_counter() - start:5.1f}s] {Path(cmd[cmd.index('-o') + 1]).name}",
                  file=sys.stderr, flush=True)


def _source_key(variant: Variant, nvcc: str) -> str:
    """Hash of everything the library depends on: variant, sources, headers, compiler, FFI API."""
    xqa_dir, ffi_dir = xqa_source_dir(), ffi_source_dir()
    h = hashlib.sha256()
    h.update(repr((variant, _nvcc_version(nvcc), str(nvcc), _installed_flashinfer_version())).encode())
    files = sorted(p for p in xqa_dir.iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp"))
    files += sorted(ffi_dir.glob("xqa*"))
    files += sorted((_ffi_include_dir() / "xla" / "ffi" / "api").glob("*.h"))
    for path in files:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _installed_flashinfer_version() -> str:
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build(variant: Variant, *, quiet: bool = False) -> Path:
    """Path of the variant's shared library, compiling it (a few seconds to a minute) if not cached."""
    nvcc = check_toolchain()
    xqa_dir, ffi_dir = xqa_source_dir(), ffi_source_dir()
    final_dir = cache_dir() / f"{variant.name}-{_source_key(variant, nvcc)}"
    library = final_dir / "libjaxattn_xqa.so"
    if library.is_file():
        return library
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(final_dir.parent / f"{final_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)              # another process may be building it
        if library.is_file():
            return library
        start = time.perf_counter()
        if not quiet:
            print(f"jaxattn: compiling XQA decode kernel {variant.name} with {nvcc} "
                  f"(first use; cached in {final_dir.parent})", file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(dir=final_dir.parent, prefix=f".{variant.name}-"))
        try:
            compiles, link = _commands(variant, nvcc, xqa_dir, ffi_dir, tmp)
            _run(compiles, variant, start, quiet)
            _run([link], variant, start, quiet)
            tmp.chmod(0o755)
            os.replace(tmp, final_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not quiet:
            print(f"jaxattn: XQA decode kernel {variant.name} built in {time.perf_counter() - start:.1f}s",
                  file=sys.stderr, flush=True)
    return library


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
