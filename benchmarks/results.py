"""benchmarks/RESULTS.md is one file with a marked section per benchmark; each run rewrites its own."""

from __future__ import annotations

import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def write_section(name: str, text: str, *, heading: str, update_results: bool = True) -> str:
    """Puts ``text`` between ``<!-- name:begin/end -->`` markers in RESULTS.md (replacing the
    section, or appending it under ``heading``) and a copy in ``$OUT/<name>_results.md``.
    Returns the section."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    section = f"{begin}\n{text}\n{end}"
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}_results.md"), "w") as f:
            f.write(section + "\n")
    if update_results:
        old = open(RESULTS).read() if os.path.exists(RESULTS) else "# Benchmark results\n"
        if begin in old and end in old:
            new = old[:old.index(begin)] + section + old[old.index(end) + len(end):]
        else:
            new = old.rstrip("\n") + f"\n\n## {heading}\n\n" + section + "\n"
        with open(RESULTS, "w") as f:
            f.write(new)
    return section
