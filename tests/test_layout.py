"""The repository's layout rule (docs/design.md): the op library (``jaxattn`` outside
``jaxattn.serve``) never imports the serving side."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxattn"


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every module an ``import`` or ``from ... import`` of the file names (relative imports resolved
    against the file's package; ``from pkg import name`` also as ``pkg.name``, a submodule perhaps)."""
    package = ".".join(path.relative_to(PACKAGE.parent).parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names.append((node.lineno, base))
            names += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return names


def test_the_library_never_imports_the_serving_side():
    library = [p for p in PACKAGE.rglob("*.py") if "serve" not in p.relative_to(PACKAGE).parts[:1]]
    assert len(library) > 20 and not any(p.is_relative_to(PACKAGE / "serve") for p in library)
    offending = [f"{p.relative_to(PACKAGE.parent)}:{line}: {name}" for p in library
                 for line, name in _imported_modules(p)
                 if name == "jaxattn.serve" or name.startswith("jaxattn.serve.")]
    assert not offending, "the library imports jaxattn.serve:\n" + "\n".join(offending)
