"""The import graph of src/kvforge, read from the source (nothing is imported): no circles
among the modules in scope, and the engine never imports the tooling.

An edge is every `import kvforge.X` and `from kvforge.X import ...` in a file, wherever it
stands (module level, under `if TYPE_CHECKING:`, inside a function): an import moved into a
function still makes a circle, one that only shows later. `from P import n` is an edge to
the module P.n when n is a module, else to P.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
# Packages whose modules the circle check skips for now (the cache-boundary refactor owns
# them); empty this tuple to check the whole package.
CIRCLE_CHECK_SKIPS = ("kvforge.cache", "kvforge.models", "kvforge.kernels", "kvforge.engine")
ENGINE = ("kvforge.engine", "kvforge.cache", "kvforge.models", "kvforge.kernels", "kvforge.serve")
TOOLS = "kvforge.tools"

Graph = Mapping[str, frozenset[str]]


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def _imported(tree: ast.AST, package: str) -> Iterator[str]:
    """Dotted names `tree` imports: `import a.b` gives a.b; `from a import b, c` gives a.b
    and a.c (each resolved to a module or its package later). `package` resolves relative
    imports."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> Graph:
    """Module -> the kvforge modules it imports."""
    files = {_module_name(path): path for path in (SRC / "kvforge").rglob("*.py")}
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for name in _imported(ast.parse(path.read_text(), str(path)), package):
            while name not in files and "." in name:  # `from P import n` with n not a module: P
                name = name.rpartition(".")[0]
            if name in files and name != module:
                targets.add(name)
        graph[module] = frozenset(targets)
    return graph


def circles(graph: Graph, scope: set[str]) -> list[list[str]]:
    """One shortest circle through each module of `scope` that is on one, each circle once;
    a circle is the list of its modules, the first repeated at the end."""
    found: dict[frozenset[str], list[str]] = {}
    for start in sorted(scope):
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue:
            module = queue.popleft()
            for target in sorted(graph[module] & scope):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    circle = [*reversed(path), start]
                    found.setdefault(frozenset(circle), circle)
                    queue.clear()
                    break
                if target not in came_from:
                    came_from[target] = module
                    queue.append(target)
    return list(found.values())


def test_the_graph_sees_imports_wherever_they_stand():
    graph = import_graph()
    assert "kvforge.tools.report.provenance" in graph["kvforge.cli"]  # module level
    assert "kvforge.tools.bench.merge_all_layers" in graph["kvforge.tools.bench.common"]  # inside a method
    assert "kvforge.tools.report.pareto" in graph["kvforge.tools.report.cli"]  # `from package import module`
    assert "kvforge.tools.analysis" in graph["kvforge.tools.analysis.cli"]  # a name of a package's __init__


def test_circles_are_found_and_reported_once():
    graph = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a", "d"}), "d": frozenset(),
             "e": frozenset({"e"})}
    assert circles(graph, set(graph)) == [["a", "b", "c", "a"], ["e", "e"]]
    assert circles(graph, {"a", "b", "d"}) == []  # a module out of scope breaks the circle


def test_no_import_circles():
    graph = import_graph()
    scope = {module for module in graph if not _within(module, CIRCLE_CHECK_SKIPS)}
    assert "kvforge.cli" in scope and "kvforge.tools.bench.common" in scope
    found = circles(graph, scope)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in found)


def test_the_engine_imports_nothing_from_the_tools():
    graph = import_graph()
    wrong = {module: sorted(target for target in targets if _within(target, (TOOLS,)))
             for module, targets in graph.items() if _within(module, ENGINE)}
    assert any(_within(module, ("kvforge.serve",)) for module in wrong)  # the engine's modules were read
    assert not {module: targets for module, targets in wrong.items() if targets}
