"""The import graph of src/kvforge, read from the source (nothing is imported): no circles,
kernels are leaves (no model, no cache method), and the engine never imports the tooling.

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

SRC = Path(__file__).resolve().parents[1] / "src"
ENGINE = ("kvforge.engine", "kvforge.cache", "kvforge.models", "kvforge.kernels", "kvforge.serve")
# Top-level modules that belong to the tooling's side: the command line dispatches to it.
ABOVE_THE_ENGINE = ("kvforge.cli", "kvforge.__main__", "kvforge.commands")
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
    assert "kvforge.cli" in graph and "kvforge.cache.full.method" in graph
    found = circles(graph, set(graph))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in found)


def _engine_module(module: str) -> bool:
    top_level = module.count(".") == 1 and module not in ABOVE_THE_ENGINE
    return _within(module, ENGINE) or top_level


def test_the_engine_imports_nothing_from_the_tools():
    graph = import_graph()
    wrong = {module: sorted(target for target in targets if _within(target, (TOOLS,)))
             for module, targets in graph.items() if _engine_module(module)}
    assert {"kvforge.serve.app", "kvforge.batch", "kvforge.info"} <= set(wrong)  # the engine's modules were read
    assert not {module: targets for module, targets in wrong.items() if targets}


def test_kernels_are_leaves():
    """A kernel takes tensors and plain parameters; it never reaches up into a model or a
    cache method (the model picks the fused op, the cache hands it its storage)."""
    graph = import_graph()
    wrong = {module: sorted(t for t in targets if _within(t, ("kvforge.models", "kvforge.cache")))
             for module, targets in graph.items() if _within(module, ("kvforge.kernels",))}
    assert "kvforge.kernels.cpu_decode_layer" in wrong
    assert not {module: targets for module, targets in wrong.items() if targets}
