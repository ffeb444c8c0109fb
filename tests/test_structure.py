"""The layering docs/architecture.md describes, checked on the source: kernels are leaves,
the engine stands without the tooling, files stay small enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvforge"
MAX_LINES = 400


def _imports(path: Path) -> set[str]:
    """Every kvforge module a file imports, at any depth (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("kvforge")}


def _python_files(*parts: str) -> list[Path]:
    return sorted((SRC.joinpath(*parts)).rglob("*.py"))


@pytest.mark.parametrize("forbidden", ["kvforge.models", "kvforge.cache"])
def test_kernels_are_leaves(forbidden):
    """A kernel takes tensors and plain parameters; it never reaches up into a model or a
    cache method (the model picks the fused op, the cache hands it its storage)."""
    offenders = {str(path.relative_to(SRC)): sorted(name for name in _imports(path)
                                                    if name == forbidden or name.startswith(forbidden + "."))
                 for path in _python_files("kernels")}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_engine_never_imports_the_tooling():
    engine = [path for part in ("engine", "cache", "models", "kernels", "serve") for path in _python_files(part)]
    engine += [path for path in SRC.glob("*.py") if path.name not in ("cli.py", "__main__.py")]
    offenders = {str(path.relative_to(SRC)): sorted(name for name in _imports(path)
                                                    if name.startswith("kvforge.tools"))
                 for path in engine}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_no_python_file_is_longer_than_one_sitting():
    long = {str(path.relative_to(SRC)): count for path in _python_files()
            if (count := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
