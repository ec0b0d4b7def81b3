"""bazel/configure.py: the interpreter it records for Bazel's py targets keeps a virtualenv."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import venv

_CONFIGURE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "bazel", "configure.py")


def _configure_module():
    spec = importlib.util.spec_from_file_location("bazel_configure", _CONFIGURE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_keeps_a_virtualenv_interpreter(tmp_path):
    env = tmp_path / "venv"
    venv.create(env, with_pip=False, symlinks=True)
    python = os.path.join(env, "bin", "python")
    recorded = _configure_module().probe(python)["executable"]
    assert recorded == python
    prefix = subprocess.run([recorded, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert os.path.realpath(prefix) == os.path.realpath(env)  # the venv, not the base interpreter
