"""Local repositories of jaxattn's Bazel build, at the paths bazel/configure.py found (nothing is fetched)."""

load("//bazel:local_config.bzl", "CUDA", "CUDNN_FRONTEND_INCLUDE", "CUDNN_INCLUDE", "CUDNN_LIBRARY", "NANOBIND",
     "NVRTC_INCLUDE", "NVRTC_LIBRARY", "PYTHON", "PYTHON_INCLUDE", "XLA_FFI_INCLUDE")

def _headers_build(patterns):
    return """package(default_visibility = ["//visibility:public"])

cc_library(
    name = "headers",
    hdrs = glob({patterns}),
    includes = ["."],
)
""".format(patterns = repr(patterns))

def _library_repository(name, path):
    """@name//:lib, the shared library at `path` (linked by soname; jaxattn loads the wheel's copy first)."""
    directory, _, filename = path.rpartition("/")
    native.new_local_repository(
        name = name,
        path = directory,
        build_file_content = """package(default_visibility = ["//visibility:public"])

cc_import(
    name = "lib",
    shared_library = "{filename}",
)
""".format(filename = filename),
    )

def jaxattn_local_repositories():
    """Declares @jaxattn_{python,xla_ffi,cuda,cudnn,cudnn_lib,cudnn_frontend,nvrtc,nvrtc_lib,nanobind}
    and the Python toolchain."""

    # The interpreter (its site-packages provide jax, flax, pytest, ...) and the headers of the
    # Python the extension module is built for.
    native.new_local_repository(
        name = "jaxattn_python",
        path = PYTHON_INCLUDE,
        build_file_content = _headers_build(["**/*.h"]) + """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{python}",
    stub_shebang = "#!{python}",
    python_version = "PY3",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)
""".format(python = PYTHON),
    )
    native.register_toolchains("@jaxattn_python//:toolchain")

    if XLA_FFI_INCLUDE:
        native.new_local_repository(
            name = "jaxattn_xla_ffi",
            path = XLA_FFI_INCLUDE,
            build_file_content = _headers_build(["xla/ffi/api/*.h"]),
        )
    if CUDNN_INCLUDE:
        native.new_local_repository(
            name = "jaxattn_cudnn",
            path = CUDNN_INCLUDE,
            build_file_content = _headers_build(["*.h"]),
        )
    if CUDNN_LIBRARY:
        _library_repository("jaxattn_cudnn_lib", CUDNN_LIBRARY)
    if NVRTC_LIBRARY:
        _library_repository("jaxattn_nvrtc_lib", NVRTC_LIBRARY)
    if CUDNN_FRONTEND_INCLUDE:
        # From the folder above: cudnn_frontend_Errata.h includes "../include/cudnn_frontend_Logging.h".
        parent, _, sub = CUDNN_FRONTEND_INCLUDE.rstrip("/").rpartition("/")
        native.new_local_repository(
            name = "jaxattn_cudnn_frontend",
            path = parent,
            build_file_content = """package(default_visibility = ["//visibility:public"])

cc_library(
    name = "headers",
    hdrs = glob(["{sub}/cudnn_frontend*.h", "{sub}/cudnn_backend_base.h", "{sub}/cudnn_frontend/**"]),
    includes = ["{sub}"],
)
""".format(sub = sub),
        )
    if NVRTC_INCLUDE:
        native.new_local_repository(
            name = "jaxattn_nvrtc",
            path = NVRTC_INCLUDE,
            build_file_content = _headers_build(["nvrtc.h"]),
        )
    if CUDA:
        native.new_local_repository(
            name = "jaxattn_cuda",
            path = CUDA,
            build_file = "//bazel:cuda.BUILD",
        )
    if NANOBIND:
        native.new_local_repository(
            name = "jaxattn_nanobind",
            path = NANOBIND,
            build_file = "//bazel:nanobind.BUILD",
        )
