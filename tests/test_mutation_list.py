"""The mutation list stays applicable: every mutation's snippet occurs exactly once in its
file, and its tests exist. A refactor that moves the code under a mutation fails here, in
`make test`, rather than only when someone runs `make mutants`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "mutants"))
from mutations import MUTATIONS  # noqa: E402


def test_there_are_at_least_25_mutations_with_unique_names():
    names = [m.name for m in MUTATIONS]
    assert len(names) >= 25 and len(set(names)) == len(names)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_snippet_occurs_once_and_its_tests_exist(mutation):
    text = (ROOT / mutation.file).read_text()
    assert text.count(mutation.original) == 1, f"{mutation.name}: snippet found {text.count(mutation.original)} times"
    assert mutation.replacement != mutation.original
    for target in mutation.tests:
        assert (ROOT / target.split("::")[0]).exists(), f"{mutation.name}: no {target}"


def test_a_mutation_whose_tests_all_skip_here_is_neither_killed_nor_survived():
    """The AMX kernel's tests skip on CPUs without AMX: its mutations are reported as not run
    on such a machine, never as killed (nor as survivors that fail the run)."""
    from run import _status

    assert _status(False, "1 failed, 3 passed in 1.20s") == "killed"
    assert _status(False, "timeout after 900 s") == "killed"
    assert _status(False, "1 deselected in 0.17s") == "NOT RUN HERE"  # pytest's exit 5: no test ran
    assert _status(False, "no tests ran in 0.05s") == "NOT RUN HERE"
    assert _status(False, "1 failed, 2 deselected in 0.40s") == "killed"
    assert _status(True, "25 skipped in 18.37s") == "NOT RUN HERE"
    assert _status(True, "3 passed, 2 skipped in 1.02s") == "SURVIVED"
    assert _status(True, "3 passed in 1.02s") == "SURVIVED"


def test_a_mutation_needing_a_cpu_flag_this_cpu_lacks_is_reported_not_run(tmp_path):
    from mutations import Mutation
    from run import _run_one

    needs = Mutation("needs_a_flag", "src/none.py", "a", "b", ("tests/none.py",), "why", cpu_flag="no_such_flag")
    result = _run_one(needs, tmp_path, 1)  # never touches the (absent) file nor runs a test
    assert result["status"] == "NOT RUN HERE" and "no_such_flag" in result["last_line"]
    amx = [m for m in MUTATIONS if "amx" in m.file or "tests/kernels/test_cpu_linear_amx.py" in m.tests]
    assert len(amx) >= 6 and all(m.cpu_flag == "amx_bf16" for m in amx)
