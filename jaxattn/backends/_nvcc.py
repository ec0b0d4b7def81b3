"""Shared by the FFI kernels jaxattn compiles on first use from flashinfer-python's sources
(``_xqa_build``: TensorRT-LLM XQA decode; ``_mla_build``: FlashInfer's SM90 MLA): finding nvcc,
the installed flashinfer package and the XLA FFI headers, and building a shared library once
into an on-disk cache keyed by a hash of everything it depends on."""

from __future__ import annotations

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
import time
from pathlib import Path
from typing import Callable, Iterable

# The flashinfer-python release whose sources jaxattn is tested with.
FLASHINFER_VERSION = "0.7.2.post1"
ARCH = "90a"  # XQA's Hopper kernel and FlashInfer's MLA kernel use wgmma, so SM90 needs the "a" target.
MIN_CUDA = (12, 8)
SYSTEM_NVCC = Path("/usr/local/cuda/bin/nvcc")
# The wheel ships the handler sources in jaxattn/ffi (see CMakeLists.txt); a source checkout
# (editable install) has them in ffi/ at the repository root.
_FFI_DIR_CANDIDATES = (Path(__file__).resolve().parents[1] / "ffi", Path(__file__).resolve().parents[2] / "ffi")


class BuildError(RuntimeError):
    """A kernel cannot be built here (no nvcc, no flashinfer sources, compile failure)."""


def toolchain_reason(check_toolchain: Callable[[], object]) -> str | None:
    """Why ``check_toolchain`` cannot build kernels here (its ``BuildError``), or None."""
    try:
        check_toolchain()
    except BuildError as err:
        return str(err)
    return None


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
    raise BuildError("nvcc (CUDA >= 12.8) not found: the trtllm and flashinfer backends compile their kernels on "
                     "first use. Set CUDA_HOME, put nvcc on PATH, or `pip install nvidia-cuda-nvcc`")


@functools.cache
def nvcc_version(nvcc: str) -> tuple[int, int]:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise BuildError(f"`{nvcc} --version` failed: {err}") from err
    match = re.search(r"release (\d+)\.(\d+)", out)
    if not match:
        raise BuildError(f"cannot parse `{nvcc} --version`: {out[-200:]}")
    version = (int(match.group(1)), int(match.group(2)))
    if version < MIN_CUDA:
        raise BuildError(f"{nvcc} is CUDA {version[0]}.{version[1]}; the kernels need CUDA >= 12.8")
    return version


def flashinfer_data_dir(purpose: str) -> Path:
    """``flashinfer/data`` of the installed flashinfer-python (located, not imported: importing
    it needs torch), or ``$JAXATTN_FLASHINFER_DATA``; ``purpose`` says which kernels need it,
    for the error."""
    override = os.environ.get("JAXATTN_FLASHINFER_DATA")
    if override:
        return Path(override)
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(f"flashinfer-python is not installed: {purpose} "
                         f"(`pip install flashinfer-python=={FLASHINFER_VERSION}`)")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def installed_flashinfer_version() -> str:
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def ffi_source_dir(marker: str) -> Path:
    """jaxattn's handler sources (the ``ffi`` directory holding ``marker``)."""
    for path in _FFI_DIR_CANDIDATES:
        if (path / marker).is_file():
            return path
    raise BuildError(f"jaxattn's handler source {marker} was not found in {_FFI_DIR_CANDIDATES}")


def ffi_include_dir() -> Path:
    import jax.ffi
    return Path(jax.ffi.include_dir())


def cache_root() -> Path:
    root = (os.environ.get("JAXATTN_CACHE_DIR")
            or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxattn")
    return Path(root)


def source_key(nvcc: str, config: object, files: Iterable[Path]) -> str:
    """Hash of a build's configuration, compiler, flashinfer version, the XLA FFI headers and
    ``files`` (names and contents)."""
    h = hashlib.sha256()
    h.update(repr((config, nvcc_version(nvcc), str(nvcc), installed_flashinfer_version())).encode())
    for path in list(files) + sorted((ffi_include_dir() / "xla" / "ffi" / "api").glob("*.h")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _run(commands: list[list[str]], what: str, start: float, quiet: bool) -> None:
    """Runs the commands in parallel; BuildError with the log of the first failure."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    logs = [proc.communicate()[0] for proc in procs]
    for cmd, proc, log in zip(commands, procs, logs):
        if proc.returncode != 0:
            raise BuildError(f"building {what} failed:\n{' '.join(cmd)}\n{log[-4000:]}")
        if not quiet:
            print(f"jaxattn:   [{time.perf_counter() - start:5.1f}s] {Path(cmd[cmd.index('-o') + 1]).name}",
                  file=sys.stderr, flush=True)


def build_cached(final_dir: Path, library_name: str, what: str,
                 commands: Callable[[Path], tuple[list[list[str]], list[str]]], *, quiet: bool = False) -> Path:
    """``final_dir/library_name``, built first if missing: ``commands(out_dir)`` gives the nvcc
    compiles (run in parallel) and the link, into a temporary directory renamed to ``final_dir``
    (a file lock serializes processes building the same library)."""
    library = final_dir / library_name
    if library.is_file():
        return library
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(final_dir.parent / f"{final_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)              # another process may be building it
        if library.is_file():
            return library
        start = time.perf_counter()
        if not quiet:
            print(f"jaxattn: compiling {what} (first use; cached in {final_dir.parent})", file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(dir=final_dir.parent, prefix=f".{final_dir.name}-"))
        try:
            compiles, link = commands(tmp)
            _run(compiles, what, start, quiet)
            _run([link], what, start, quiet)
            tmp.chmod(0o755)
            os.replace(tmp, final_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not quiet:
            print(f"jaxattn: {what} built in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    return library
