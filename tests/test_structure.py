"""The shape docs/architecture.md describes, checked on the source: files stay small enough
to read in one sitting (the import layering: test_import_graph.py)."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvforge"
MAX_LINES = 400


def _python_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_no_python_file_is_longer_than_one_sitting():
    long = {str(path.relative_to(SRC)): count for path in _python_files()
            if (count := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_family_branches_outside_the_models():
    """Per-family facts live in one registry entry per family (models/family.py): code
    outside models/ never branches on which family a model is."""
    branch = re.compile(r"""architecture\s*(==|!=)\s*["'][^"']|architecture\s+(not\s+)?in\s*[(\[{]""")
    found = {str(path.relative_to(SRC)): line.strip() for path in _python_files()
             if path.relative_to(SRC).parts[0] != "models"
             for line in path.read_text().splitlines() if branch.search(line)}
    assert found == {}
