"""The shape docs/architecture.md describes, checked on the source: files stay small enough
to read in one sitting (the import layering: test_import_graph.py)."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvforge"
MAX_LINES = 400


def _python_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_no_python_file_is_longer_than_one_sitting():
    long = {str(path.relative_to(SRC)): count for path in _python_files()
            if (count := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}
