"""The mutation check: does the test suite notice when an invariant breaks?

Each mutation (mutations.py) names a file, an exact snippet that must occur in it once,
its replacement, and the tests that should fail because of it. The runner copies the
repository's `src/` and `tests/` (and what the tests read: `models/`, `examples/`,
`docs/`, `README.md`, `pyproject.toml`) to a scratch directory once, checks that every
selected mutation's tests pass unmutated there, then for each mutation: applies it to the
scratch copy, runs its tests with the scratch `src/` first on the import path, restores
the file, and records "killed" (a test failed or timed out) or "survived" (every test
passed: a bug the suite lets through).

    python mutants/run.py                        # all mutations (`make mutants`)
    python mutants/run.py --only NAME ...        # the named ones
    python mutants/run.py --area serve engine    # those in src/kvforge/serve/, src/kvforge/engine/
    python mutants/run.py --files src/kvforge/engine/detokenizer.py ...  # by path prefix
    python mutants/run.py --area serve --list    # list a selection without running it

--only, --area and --files may be combined: a mutation is run when any of them selects it.
Exit status 1 if any mutation survived or a snippet is missing, so a refactor that moves
the code under a mutation is caught too. Writes mutants/last_run.json; a run of part of
the list says so there ("partial": true, and what selected it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from mutations import MUTATIONS, Mutation  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Everything the tests read from the repository (a test reading a path not copied fails
# unmutated, in the baseline).
COPIED = ("src", "tests", "models", "examples", "docs", "README.md", "pyproject.toml")
PACKAGE = "src/kvforge/"
TIMEOUT_S = 900


def _pytest(scratch: Path, tests: tuple[str, ...]) -> tuple[bool, float, str]:
    env = {**os.environ, "PYTHONPATH": str(scratch / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    # The scratch copy lives in /tmp, where "../shared beside the repository" is not: point the
    # tests that read the held-out text at the repository's own copy.
    shared_text = ROOT.parent / "shared" / "data" / "wikitext-2-raw-test.txt"
    if "KVFORGE_TEXT_FILE" not in env and shared_text.is_file():
        env["KVFORGE_TEXT_FILE"] = str(shared_text)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=scratch, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - start, f"timeout after {TIMEOUT_S} s"
    tail = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, time.perf_counter() - start, tail[-1] if tail else ""


def _check(mutation: Mutation, scratch: Path) -> str | None:
    text = (scratch / mutation.file).read_text()
    count = text.count(mutation.original)
    if count != 1:
        return f"{mutation.name}: the original snippet occurs {count} times in {mutation.file} (must be once)"
    return None


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
    parser.add_argument("--list", action="store_true", help="list the selected mutations and exit")
    args = parser.parse_args()
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"unknown mutations: {sorted(unknown)}", file=sys.stderr)
        return 2
    mutations = select(MUTATIONS, args.only, args.area, args.files)
    if args.list:
        for m in mutations:
            print(f"{m.name:40s} {m.file}: {m.why}")
        return 0
    if not mutations:
        print("no mutation matches the selection", file=sys.stderr)
        return 2
    partial = len(mutations) < len(MUTATIONS)
    selection = {key: value for key, value in (("only", args.only), ("area", args.area), ("files", args.files))
                 if value is not None}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvforge-mutants-") as tmp:
        scratch = Path(tmp)
        for name in COPIED:
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, scratch / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            elif source.exists():
                shutil.copy2(source, scratch / name)
        problems = [p for p in (_check(m, scratch) for m in mutations) if p]
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 1
        tests = tuple(sorted({t for m in mutations for t in m.tests}))
        ok, seconds, last = _pytest(scratch, tests)
        print(f"baseline: the {len(tests)} test targets {'pass' if ok else 'FAIL'} unmutated ({seconds:.0f} s): {last}")
        if not ok:
            return 1
        results = []
        for index, mutation in enumerate(mutations, 1):
            path = scratch / mutation.file
            original = path.read_text()
            path.write_text(original.replace(mutation.original, mutation.replacement))
            try:
                passed, seconds, last = _pytest(scratch, mutation.tests)
            finally:
                path.write_text(original)
            status = "SURVIVED" if passed else "killed"
            results.append({"name": mutation.name, "file": mutation.file, "status": status,
                            "seconds": round(seconds, 1), "tests": list(mutation.tests), "last_line": last})
            print(f"[{index}/{len(mutations)}] {status:8s} {mutation.name} ({seconds:.0f} s): {last}", flush=True)
    survived = [r["name"] for r in results if r["status"] == "SURVIVED"]
    total = time.perf_counter() - started
    print(f"{len(results) - len(survived)} of {len(results)} mutations killed in {total / 60:.1f} min"
          + (f"; survived: {', '.join(survived)}" if survived else ""))
    (ROOT / "mutants" / "last_run.json").write_text(json.dumps(
        {"killed": len(results) - len(survived), "total": len(results), "minutes": round(total / 60, 1),
         "partial": partial, "selection": selection, "list_size": len(MUTATIONS), "results": results},
        indent=2) + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
