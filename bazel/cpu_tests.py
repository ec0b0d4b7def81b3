"""Bazel's CPU test target (//:cpu_tests): pytest over tests/ in the runfiles, against the jaxattn
of this build (the handler library Bazel built, when it was built), without the tests marked
``slow`` (the README's pytest command runs those). Extra arguments go to pytest:
    bazel test //:cpu_tests --test_arg=-k --test_arg=page_table
"""

import os
import sys

import pytest


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
    status = pytest.main(["-p", "no:cacheprovider", "-m", "not gpu and not slow", "-c", os.path.join(root, "pyproject.toml"),
                          "--rootdir", root, os.path.join(root, "tests"), *sys.argv[1:]])
    return 0 if status == pytest.ExitCode.NO_TESTS_COLLECTED else int(status)


if __name__ == "__main__":
    sys.exit(main())
