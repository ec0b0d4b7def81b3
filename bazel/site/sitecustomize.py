"""On PYTHONPATH of jaxattn's Bazel py targets (//bazel:site): drops the import hook of an editable
pip install of jaxattn (scikit-build-core puts it first on sys.meta_path from a .pth file), so that
`import jaxattn` finds the package in Bazel's runfiles, with the library Bazel built."""

import sys

sys.meta_path[:] = [finder for finder in sys.meta_path
                    if not (type(finder).__name__ == "ScikitBuildRedirectingFinder"
                            and "jaxattn" in getattr(finder, "known_source_files", {}))]
