"""`mutants/run.py --since REV` picks the mutations a change can have affected: those whose
file or tests changed (committed, uncommitted or untracked), and those whose definition is
new or differs from REV's, and no others."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "mutants"))
from since import affected, changed_paths, definitions_at  # noqa: E402

# A list file as mutations.py is one (its Mutation comes from the real mutations.py, on the path).
LIST = """
from mutations import Mutation

MUTATIONS = [
    Mutation("in_a", "src/a.py", "x = 1", "x = 2", ("tests/test_a.py",), ""),
    Mutation("in_b", "src/b.py", "y = 1", "y = 2", ("tests/b/",), ""),
    Mutation("in_c", "src/c.py", "z = 1", "z = 2", ("tests/test_c.py::test_one",), ""),
{extra}]
"""


def _git(repo: Path, *args: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, env=env)


def _write(repo: Path, path: str, text: str) -> None:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)


def _mutations(repo: Path) -> list:
    namespace: dict = {}
    exec((repo / "mutants/mutations.py").read_text(), namespace)
    return namespace["MUTATIONS"]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for path in ("src/a.py", "src/b.py", "src/c.py", "tests/test_a.py", "tests/b/test_b.py", "tests/test_c.py"):
        _write(tmp_path, path, "pass\n")
    _write(tmp_path, "mutants/mutations.py", LIST.format(extra=""))
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "start")
    return tmp_path


def _picked(repo: Path) -> list[str]:
    return affected(_mutations(repo), changed_paths(repo, "HEAD"), definitions_at(repo, "HEAD"))


def test_nothing_changed_picks_nothing(repo):
    assert _picked(repo) == []


def test_a_changed_source_file_picks_its_mutation_only(repo):
    _write(repo, "src/a.py", "x = 1\n")  # uncommitted
    assert _picked(repo) == ["in_a"]


def test_a_committed_change_counts_as_much_as_an_uncommitted_one(repo):
    _write(repo, "src/c.py", "z = 1\n")
    _git(repo, "commit", "-qam", "later")
    assert affected(_mutations(repo), changed_paths(repo, "HEAD~1"), definitions_at(repo, "HEAD~1")) == ["in_c"]


def test_a_file_under_a_folder_target_or_a_test_file_picks_its_mutations(repo):
    _write(repo, "tests/b/test_new.py", "pass\n")  # untracked, under in_b's folder target
    _write(repo, "tests/test_c.py", "def test_one(): pass\n")  # the file of in_c's node id
    assert _picked(repo) == ["in_b", "in_c"]


def test_a_sibling_whose_name_only_starts_like_a_folder_target_is_not_under_it(repo):
    _write(repo, "tests/bb/test_x.py", "pass\n")
    assert _picked(repo) == []


def test_a_new_or_redefined_mutation_is_picked_though_its_files_did_not_change(repo):
    extra = '    Mutation("new_one", "src/a.py", "x", "w", ("tests/test_a.py",), ""),\n'
    text = LIST.format(extra=extra).replace('("tests/test_c.py::test_one",)', '("tests/test_c.py::test_two",)')
    _write(repo, "mutants/mutations.py", text)
    assert _picked(repo) == ["in_c", "new_one"]


def test_an_unknown_revision_is_refused_by_name(repo):
    with pytest.raises(ValueError, match="'no-such-rev' is not a commit"):
        changed_paths(repo, "no-such-rev")


def test_a_revision_before_the_list_existed_makes_every_mutation_new(repo):
    _write(repo, "mutants/mutations.py", LIST.format(extra=""))
    _git(repo, "rm", "-q", "--cached", "mutants/mutations.py")
    _git(repo, "commit", "-qm", "drop")
    assert definitions_at(repo, "HEAD") == {}


def test_a_renamed_file_counts_under_its_old_path_too(repo):
    _git(repo, "mv", "src/a.py", "src/a_renamed.py")  # in_a's file is gone: its mutation is stale
    assert _picked(repo) == ["in_a"]
