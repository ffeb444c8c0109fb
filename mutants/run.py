"""The mutation check: does the test suite notice when an invariant breaks?

Each mutation (mutations.py) names a file, an exact snippet that must occur in it once,
its replacement, and the tests that should fail because of it. The runner copies the
repository's `src/` and `tests/` (and what the tests read: `mutants/`, `models/`,
`examples/`, `docs/`, `README.md`, `pyproject.toml`) to a scratch directory once, checks that every
selected mutation's tests pass unmutated there, then for each mutation: applies it to the
scratch copy, runs its tests with the scratch `src/` first on the import path, restores
the file, and records "killed" (a test failed or timed out), "survived" (every test
passed: a bug the suite lets through) or "not run here" (every test skipped on this machine,
e.g. the AMX kernel's on a CPU without AMX: the mutation was not judged, and the run says so).

    python mutants/run.py                        # all mutations (`make mutants`)
    python mutants/run.py --only NAME ...        # the named ones
    python mutants/run.py --area serve engine    # those in src/kvforge/serve/, src/kvforge/engine/
    python mutants/run.py --files src/kvforge/engine/detokenizer.py ...  # by path prefix
    python mutants/run.py --since origin/main    # those a change since a commit can affect
    python mutants/run.py --area serve --list    # list a selection without running it

--since REV selects each mutation whose file or test targets changed since REV (commits,
uncommitted edits and untracked files), or whose definition is new or differs (since.py).
--only, --area, --files and --since may be combined: a mutation is run when any of them selects it.
--jobs N (default: one per core, at most 4) runs N mutations side by side, each in its own
scratch copy with its share of the cores (KVFORGE_TEST_THREADS, read by tests/conftest.py):
most of a mutation's time is single-threaded (interpreter start, imports, collection, a
kernel's compile), so two jobs on two cores finish the list sooner than one.
Exit status 1 if any mutation survived or a snippet is missing, so a refactor that moves
the code under a mutation is caught too. A run of the whole list writes the committed
record, mutants/last_run.json; a run of part of it writes mutants/last_partial_run.json
(ignored by git, "partial": true and what selected it), so checking a few mutations never
replaces the record of the whole list.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from mutations import MUTATIONS, Mutation  # noqa: E402
from since import affected, changed_paths, definitions_at  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Everything the tests read from the repository (a test reading a path not copied fails
# unmutated, in the baseline).
COPIED = ("src", "tests", "mutants", "models", "examples", "docs", "README.md", "pyproject.toml")
PACKAGE = "src/kvforge/"
TIMEOUT_S = 900
# The baseline runs every selected mutation's tests at once: most of the suite for a full run.
BASELINE_TIMEOUT_S = 3600


def _pytest(scratch: Path, tests: tuple[str, ...], threads: int,
            timeout: int = TIMEOUT_S) -> tuple[bool, float, str]:
    env = {**os.environ, "PYTHONPATH": str(scratch / "src"), "PYTHONDONTWRITEBYTECODE": "1",
           "KVFORGE_TEST_THREADS": str(threads)}
    # The scratch copy lives in /tmp, where "../shared beside the repository" is not: point the
    # tests that read the held-out text at the repository's own copy.
    shared_text = ROOT.parent / "shared" / "data" / "wikitext-2-raw-test.txt"
    if "KVFORGE_TEXT_FILE" not in env and shared_text.is_file():
        env["KVFORGE_TEXT_FILE"] = str(shared_text)
    start = time.perf_counter()
    try:
        # A mutation names its tests: the slow ones among them run too (the default deselects them).
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               "-m", "slow or not slow", *tests],
                              cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - start, f"timeout after {timeout} s"
    tail = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, time.perf_counter() - start, tail[-1] if tail else ""


def _check(mutation: Mutation, scratch: Path) -> str | None:
    text = (scratch / mutation.file).read_text()
    count = text.count(mutation.original)
    if count != 1:
        return f"{mutation.name}: the original snippet occurs {count} times in {mutation.file} (must be once)"
    return None


def _copy_repository(scratch: Path) -> None:
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, scratch / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif source.exists():
            shutil.copy2(source, scratch / name)


def _status(passed: bool, last_line: str) -> str:
    """killed / SURVIVED / NOT RUN HERE, from pytest's outcome and its summary line."""
    counts = {word.strip(",") for word in last_line.split()}
    if not passed:  # pytest exits 5 when it ran no test (all deselected): that kills nothing
        ran_none = ("deselected" in counts or "no tests ran" in last_line) and not counts & {"failed", "error", "errors"}
        return "NOT RUN HERE" if ran_none else "killed"
    return "NOT RUN HERE" if "skipped" in counts and "passed" not in counts else "SURVIVED"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return {flag for line in info if line.startswith(("flags", "Features")) for flag in line.split()[2:]}
    except OSError:
        return set()


CPU_FLAGS = _cpu_flags()


def _run_one(mutation: Mutation, scratch: Path, threads: int) -> dict:
    """Apply one mutation to `scratch`, run its tests, restore the file."""
    if mutation.cpu_flag and mutation.cpu_flag not in CPU_FLAGS:
        return {"name": mutation.name, "file": mutation.file, "status": "NOT RUN HERE", "seconds": 0.0,
                "tests": list(mutation.tests), "last_line": f"this CPU lacks {mutation.cpu_flag}"}
    path = scratch / mutation.file
    original = path.read_text()
    path.write_text(original.replace(mutation.original, mutation.replacement))
    try:
        passed, seconds, last = _pytest(scratch, mutation.tests, threads)
    finally:
        path.write_text(original)
    return {"name": mutation.name, "file": mutation.file, "status": _status(passed, last),
            "seconds": round(seconds, 1), "tests": list(mutation.tests), "last_line": last}


def select(mutations: list[Mutation], only: list[str] | None, areas: list[str] | None,
           files: list[str] | None) -> list[Mutation]:
    """The mutations named in `only`, in a package area (`serve` -> src/kvforge/serve/), or
    in a file whose path (from the repository root) starts with one of `files`; all of
    them when nothing selects."""
    if only is None and areas is None and files is None:
        return list(mutations)
    prefixes = tuple([PACKAGE + area.strip("/") + "/" for area in areas or ()]
                     + [path.removeprefix("./") for path in files or ()])
    return [m for m in mutations if m.name in (only or ()) or (prefixes and m.file.startswith(prefixes))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME", help="names of the mutations to run")
    parser.add_argument("--area", nargs="+", default=None, metavar="AREA",
                        help=f"package folders under {PACKAGE} (serve, engine, cache/kivi, ...)")
    parser.add_argument("--files", nargs="+", default=None, metavar="PATH",
                        help="path prefixes from the repository root (src/kvforge/engine/sampling.py, ...)")
    parser.add_argument("--since", default=None, metavar="REV",
                        help="the mutations whose file, tests or definition changed since this commit")
    parser.add_argument("--list", action="store_true", help="list the selected mutations and exit")
    cores = os.cpu_count() or 1
    parser.add_argument("--jobs", type=int, default=min(4, cores), metavar="N",
                        help="mutations run side by side, each in its own scratch copy (default: %(default)s)")
    args = parser.parse_args()
    if args.jobs < 1:
        print(f"--jobs must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"unknown mutations: {sorted(unknown)}", file=sys.stderr)
        return 2
    only = args.only
    if args.since is not None:
        try:
            changed = changed_paths(ROOT, args.since)
            only = [*(only or ()), *affected(MUTATIONS, changed, definitions_at(ROOT, args.since))]
        except ValueError as error:
            print(error, file=sys.stderr)
            return 2
    mutations = select(MUTATIONS, only, args.area, args.files)
    if args.list:
        for m in mutations:
            print(f"{m.name:40s} {m.file}: {m.why}")
        return 0
    if not mutations and args.since is not None:
        print(f"nothing to run: no mutation's file, tests or definition changed since {args.since}")
        return 0
    if not mutations:
        print("no mutation matches the selection", file=sys.stderr)
        return 2
    partial = len(mutations) < len(MUTATIONS)
    chosen = (("only", args.only), ("area", args.area), ("files", args.files), ("since", args.since))
    selection = {key: value for key, value in chosen if value is not None}
    started = time.perf_counter()
    jobs = min(args.jobs, len(mutations))
    threads = max(1, cores // jobs)
    with tempfile.TemporaryDirectory(prefix="kvforge-mutants-") as tmp:
        scratches = [Path(tmp) / f"job{index}" for index in range(jobs)]
        for scratch in scratches:
            _copy_repository(scratch)
        problems = [p for p in (_check(m, scratches[0]) for m in mutations) if p]
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 1
        tests = tuple(sorted({t for m in mutations for t in m.tests}))
        ok, seconds, last = _pytest(scratches[0], tests, cores, BASELINE_TIMEOUT_S)
        print(f"baseline: the {len(tests)} test targets {'pass' if ok else 'FAIL'} unmutated ({seconds:.0f} s): {last}")
        if not ok:
            return 1
        # Each job takes the next mutation in the list when it is free; a scratch copy is
        # mutated by its own job only, so at most one mutation is applied to it at a time.
        results: list[dict | None] = [None] * len(mutations)
        pending = iter(range(len(mutations)))
        lock = threading.Lock()
        finished = 0

        def run_share(job: int) -> None:
            nonlocal finished
            while True:
                with lock:
                    index = next(pending, None)
                if index is None:
                    return
                result = _run_one(mutations[index], scratches[job], threads)
                with lock:
                    results[index] = result
                    finished += 1
                    print(f"[{finished}/{len(mutations)}] {result['status']:8s} {result['name']} "
                          f"({result['seconds']:.0f} s): {result['last_line']}", flush=True)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for future in [pool.submit(run_share, job) for job in range(jobs)]:
                future.result()
    results = [r for r in results if r is not None]
    survived = [r["name"] for r in results if r["status"] == "SURVIVED"]
    not_run = [r["name"] for r in results if r["status"] == "NOT RUN HERE"]
    killed = len(results) - len(survived) - len(not_run)
    total = time.perf_counter() - started
    print(f"{killed} of {len(results)} mutations killed in {total / 60:.1f} min"
          + (f"; survived: {', '.join(survived)}" if survived else "")
          + (f"; not run here (every test skipped on this machine): {', '.join(not_run)}" if not_run else ""))
    record = ROOT / "mutants" / ("last_partial_run.json" if partial else "last_run.json")
    record.write_text(json.dumps(
        {"killed": killed, "not_run_here": len(not_run), "total": len(results), "minutes": round(total / 60, 1),
         "partial": partial, "selection": selection, "jobs": jobs, "list_size": len(MUTATIONS), "results": results},
        indent=2) + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
