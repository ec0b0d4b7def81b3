"""Bazel's CPU test target (//:cpu_tests): pytest, in the runfiles, against the jaxattn of this
build (the handler library Bazel built, when it was built). By default it runs the tests that
check what Bazel builds: the configure step, the cuDNN handler module and its build info, the
backend report, the registry's checks and the xla backend end to end (``BUILD_CHECKS``). The
README's pytest command runs the whole suite; running it twice made CI twice as long. Arguments
go to pytest; those that name a path under tests/ replace the default selection:
    bazel test //:cpu_tests --test_arg=test_page_table.py --test_arg=-x
    bazel test //:cpu_tests --test_arg=.          # the whole CPU suite
"""

import os
import sys

import pytest

BUILD_CHECKS = ("bazel", "test_info.py", "backends/test_cudnn.py", "backends/test_xla.py", "test_layout.py")


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    import jaxattn
    where = os.path.dirname(os.path.abspath(jaxattn.__file__))
    if where != os.path.join(root, "jaxattn"):
        print(f"jaxattn was imported from {where}, not from this build's runfiles {root}", file=sys.stderr)
        return 1
    tmp = os.environ.get("TEST_TMPDIR")
    if tmp:  # hypothesis keeps its database under the working directory; keep it out of the runfiles
        os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tmp, ".hypothesis"))
    tests = os.path.join(root, "tests")
    args = [os.path.join(tests, a) if os.path.exists(os.path.join(tests, a)) else a for a in sys.argv[1:]]
    if not any(a.startswith(tests) for a in args):
        args += [os.path.join(tests, path) for path in BUILD_CHECKS]
    status = pytest.main(["-p", "no:cacheprovider", "-m", "not gpu and not slow",
                          "-c", os.path.join(root, "pyproject.toml"), "--rootdir", root, *args])
    return 0 if status == pytest.ExitCode.NO_TESTS_COLLECTED else int(status)


if __name__ == "__main__":
    sys.exit(main())
