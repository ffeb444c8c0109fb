"""Which mutations a change since a git revision can have affected (`run.py --since REV`).

A mutation is affected when its mutated file changed, when one of its test targets changed
(a file, or a file under a folder target), or when its own definition in mutations.py is new
or differs from the one at REV. "Changed" is the working tree against REV: commits since it,
uncommitted edits and untracked files alike. Helpers a test imports (conftest.py, shared
fixtures) are not followed, so a whole run stays the record of the list (last_run.json).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol


class _Definition(Protocol):
    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    cpu_flag: str


def _git(root: Path, *args: str) -> str | None:
    """git's output, or None when git fails (a ValueError when there is no git at all)."""
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except FileNotFoundError:
        raise ValueError("--since needs git, which is not on PATH") from None
    return done.stdout if done.returncode == 0 else None


def _git_output(root: Path, *args: str) -> str:
    out = _git(root, *args)
    if out is None:
        raise ValueError(f"--since: `git {' '.join(args)}` failed in {root}")
    return out


def changed_paths(root: Path, revision: str) -> set[str]:
    """Paths (from the repository root) that differ between `revision` and the working tree,
    untracked files included. A revision git does not know raises ValueError naming it."""
    if _git(root, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}") is None:
        raise ValueError(f"--since: {revision!r} is not a commit of this repository")
    # --no-renames: a renamed file counts under its old path too (a mutation naming the old
    # path is stale); -z: paths as they are, not quoted.
    tracked = _git_output(root, "diff", "--name-only", "--no-renames", "-z", revision, "--").split("\0")
    untracked = _git_output(root, "ls-files", "--others", "--exclude-standard", "-z").split("\0")
    return {path for path in tracked + untracked if path}


def definitions_at(root: Path, revision: str) -> dict[str, tuple]:
    """Each mutation's definition in mutations.py as it was at `revision`, by name (empty if
    the file did not exist there)."""
    text = _git(root, "show", f"{revision}:mutants/mutations.py")
    if text is None:
        return {}
    name = "_kvforge_mutations_at_revision"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mutations.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses looks its module up while building the class
        try:
            spec.loader.exec_module(module)
        finally:
            del sys.modules[name]
    return {m.name: definition(m) for m in module.MUTATIONS}


def definition(mutation: _Definition) -> tuple:
    """What decides a mutation's verdict: where it applies, what it changes, what must fail."""
    return (mutation.file, mutation.original, mutation.replacement, tuple(mutation.tests),
            getattr(mutation, "cpu_flag", ""))


def _touches(target: str, changed: set[str]) -> bool:
    path = target.split("::")[0].rstrip("/")
    return path in changed or any(p.startswith(path + "/") for p in changed)


def affected(mutations: Iterable[_Definition], changed: set[str], before: dict[str, tuple]) -> list[str]:
    """Names of the mutations a change can have affected, in list order."""
    return [m.name for m in mutations
            if m.file in changed or any(_touches(t, changed) for t in m.tests)
            or before.get(m.name) != definition(m)]
