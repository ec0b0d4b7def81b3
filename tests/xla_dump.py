"""Run a snippet in a fresh process with XLA's dumps on, and read which thunks XLA put in
command buffers (CUDA graphs). Used by the GPU capture tests."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

REPO = str(pathlib.Path(__file__).resolve().parents[1])
_TOP_LEVEL = re.compile(r"^(\d+): (\w+)", re.MULTILINE)


def run_with_dump(script: str, dump_dir: os.PathLike, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs ``python -c script dump_dir *args`` from the repository root with
    ``--xla_dump_to=dump_dir``; raises with the tail of stderr if it fails."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} --xla_gpu_graph_min_graph_size=1"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", script, str(dump_dir), *args], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        raise AssertionError(f"capture script failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result


def thunk_sequences(dump_dir: os.PathLike, module: str) -> dict[str, str]:
    """File name -> final thunk sequence, for every compilation of the jitted function ``module``."""
    paths = sorted(p for p in pathlib.Path(dump_dir).iterdir()
                   if module in p.name and "thunk_sequence_after_thunk_passes" in p.name)
    if not paths:
        names = sorted(p.name for p in pathlib.Path(dump_dir).iterdir())
        raise AssertionError(f"no thunk sequence for {module!r} among {names[:50]}")
    texts = {p.name: p.read_text() for p in paths}
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], f"thunks_{module}.txt").write_text(
            "\n".join(f"=== {name}\n{text}" for name, text in texts.items()))
    return texts


def top_level_thunks(text: str) -> list[str]:
    """Kinds of the thunks XLA runs one by one, in order: the unindented lines of the dump's first
    block (commands inside a command buffer are indented under it; later blocks list the
    command buffers' own sequences again)."""
    return [kind for _, kind in _TOP_LEVEL.findall(text.strip("\n").split("\n\n")[0])]
