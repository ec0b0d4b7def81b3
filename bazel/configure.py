#!/usr/bin/env python3
"""Configure step of jaxattn's Bazel build: finds the machine's local dependencies and writes
them to bazel/local_config.bzl (git-ignored), which WORKSPACE loads to point local repositories at
them. Nothing is downloaded; re-run it after changing the Python environment.

    python3 bazel/configure.py                  # everything from this interpreter's environment
    python3 bazel/configure.py --python-headers-from /path/to/python3.12   # module for another Python

Found (each may be overridden with an option):
  python                 the interpreter Bazel's py_binary/py_test use (with its site-packages: jax, ...)
  python headers         Python.h of --python-headers-from (default: that interpreter)
  xla_ffi_include,       found by ffi/cudnn/find_deps.py, exactly as the pip build (CMakeLists.txt) does:
  cudnn_include,           jaxlib/include, nvidia-cudnn-cu13, nvidia-cudnn-frontend, nvidia-cuda-nvrtc
  cudnn_frontend_include,
  nvrtc_include
  nanobind               the installed nanobind package (its sources are compiled into the module)
  cudnn_library,         libcudnn.so.9 and libnvrtc.so.13 beside those headers (../lib), which the
  nvrtc_library            handler links, as the pip build does
  cuda                   the CUDA toolkit: $CUDA_HOME or /usr/local/cuda (nvcc, cuda_runtime_api.h,
                         libcudart_static.a)
When any of the cuDNN handler's dependencies is missing, the build still succeeds without the
handler library, and jaxattn._cudnn_build says why (as with the pip build).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUTPUT = os.path.join(HERE, "local_config.bzl")

# "executable" keeps symlinks: a virtualenv's bin/python links to the base interpreter, and only
# the link finds the venv's site-packages (resolving it loses jax and the rest).
_PROBE = r"""
import json, os, sys, sysconfig
out = {"include": sysconfig.get_paths()["include"], "version": "%d.%d" % sys.version_info[:2],
       "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"), "executable": os.path.abspath(sys.executable)}
try:
    import nanobind
    out["nanobind"] = os.path.dirname(os.path.abspath(nanobind.__file__))
except ImportError:
    pass
print(json.dumps(out))
"""


def probe(python: str) -> dict:
    return json.loads(subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, check=True).stdout)


def find_deps(python: str) -> dict:
    out = subprocess.run([python, os.path.join(ROOT, "ffi", "cudnn", "find_deps.py")], capture_output=True,
                         text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter for py targets and for finding the pip packages (default: this one)")
    parser.add_argument("--python-headers-from", metavar="PYTHON",
                        help="build the extension module for this interpreter's Python (headers only)")
    parser.add_argument("--cuda", default=os.environ.get("CUDA_HOME") or "/usr/local/cuda", help="CUDA toolkit root")
    for name in ("xla_ffi_include", "cudnn_include", "cudnn_frontend_include", "nvrtc_include", "cudnn_library",
                 "nvrtc_library", "nanobind"):
        parser.add_argument("--" + name.replace("_", "-"), help=f"override {name}")
    args = parser.parse_args()

    py = probe(args.python)
    headers = probe(args.python_headers_from) if args.python_headers_from else py
    found = find_deps(args.python)
    config = {
        "PYTHON": py["executable"],
        "PYTHON_INCLUDE": headers["include"],
        "PYTHON_VERSION": headers["version"],
        "CUDA": os.path.realpath(args.cuda),
        "NVCC": os.path.join(os.path.realpath(args.cuda), "bin", "nvcc"),
        "NANOBIND": args.nanobind or py.get("nanobind", ""),
    }
    for name in ("xla_ffi_include", "cudnn_include", "cudnn_frontend_include", "nvrtc_include"):
        config[name.upper()] = getattr(args, name) or found.get(name, "")
    if not config["NVRTC_INCLUDE"] and os.path.isfile(os.path.join(config["CUDA"], "include", "nvrtc.h")):
        config["NVRTC_INCLUDE"] = os.path.join(config["CUDA"], "include")

    markers = {"XLA_FFI_INCLUDE": "xla/ffi/api/ffi.h", "CUDNN_INCLUDE": "cudnn.h",
               "CUDNN_FRONTEND_INCLUDE": "cudnn_frontend.h", "NVRTC_INCLUDE": "nvrtc.h"}
    for name, marker in markers.items():
        if config[name] and not os.path.isfile(os.path.join(config[name], marker)):
            print(f"warning: no {marker} in {config[name]} ({name})", file=sys.stderr)
            config[name] = ""

    # The pip build links cuDNN and NVRTC (CMakeLists.txt: find_library next to the headers).
    for name, include, sonames in (("CUDNN_LIBRARY", "CUDNN_INCLUDE", ("libcudnn.so.9", "libcudnn.so")),
                                   ("NVRTC_LIBRARY", "NVRTC_INCLUDE", ("libnvrtc.so.13", "libnvrtc.so"))):
        config[name] = getattr(args, name.lower()) or next(
            (os.path.join(config[include], "..", sub, so) for sub in ("lib", "lib64") for so in sonames
             if config[include] and os.path.isfile(os.path.join(config[include], "..", sub, so))), "")
        config[name] = os.path.normpath(config[name]) if config[name] else ""

    checks = {
        "nvcc (CUDA toolkit)": os.path.isfile(config["NVCC"]),
        "CUDA toolkit headers/cudart": os.path.isfile(os.path.join(config["CUDA"], "include", "cuda_runtime_api.h"))
        and os.path.isfile(os.path.join(config["CUDA"], "lib64", "libcudart_static.a")),
        "Python development headers": os.path.isfile(os.path.join(config["PYTHON_INCLUDE"], "Python.h")),
        "nanobind": bool(config["NANOBIND"]) and os.path.isdir(os.path.join(config["NANOBIND"], "src")),
    }
    missing = [what for what, ok in checks.items() if not ok]
    missing += ["JAXATTN_" + name for name in (*markers, "CUDNN_LIBRARY", "NVRTC_LIBRARY") if not config[name]]
    config["CUDNN_BUILT"] = not missing
    config["CUDNN_REASON"] = "" if not missing else (
        "the build did not find: " + ", ".join(missing) + " (pip install nvidia-cudnn-cu13 nvidia-cudnn-frontend "
        "nvidia-cuda-nvrtc nanobind, then re-run bazel/configure.py)")

    lines = ['"""Generated by bazel/configure.py; do not edit (re-run it instead). '
             'Loaded by WORKSPACE and BUILD."""', ""]
    for key, value in config.items():
        lines.append(f"{key} = {value}" if isinstance(value, bool) else f"{key} = {json.dumps(value)}")
    with open(OUTPUT, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {os.path.relpath(OUTPUT, os.getcwd())}:")
    for key, value in config.items():
        print(f"  {key} = {value}")
    if missing:
        print(f"warning: the cuDNN paged-prefill handler will not be built: {config['CUDNN_REASON']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
