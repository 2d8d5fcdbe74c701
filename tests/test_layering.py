"""The package's layering, read from the source (Python's AST; nothing is imported):

(i)   no import circles among freetoken's modules, counting imports inside functions and under
      TYPE_CHECKING as well as those at module level;
(ii)  kernels below everything: no freetoken.kernels module imports the cache, the model, the
      engine, the server, the actors or the loader;
(iii) the bench commands are a leaf: only freetoken.bench itself and the CLI entry point
      (freetoken.__main__) import it;
(iv)  no .py file under freetoken/ is over MAX_LINES lines.

An edge is (importer, imported), both module names. `import freetoken.a.b` and
`from freetoken.a import b` (b a module) name freetoken.a.b; `from freetoken.a.b import f` names
freetoken.a.b. A package's own __init__ running first is not counted as an edge (a package
that imports its submodules would otherwise always be circular with them).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "freetoken"
MAX_LINES = 450
BELOW_KERNELS = ("cache", "moe", "models", "engine", "server", "actors", "loader")  # what kernels must not import


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module that `name` (a module, or a name inside one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {_owner(a.name) for a in node.names if a.name.split(".")[0] == "freetoken"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "freetoken":
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                out.add(full if full in MODULES else _owner(source))
    out.discard(None)
    out.discard(module)
    return out


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}
EDGES = {(a, b) for a, deps in GRAPH.items() for b in deps}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_is_read():
    assert "freetoken.engine.model_runner" in GRAPH
    assert ("freetoken.moe.factory", "freetoken.cache.slot_cache") in EDGES
    assert ("freetoken.kernels.check_cli", "freetoken.kernels.specs") in EDGES  # a package by name
    assert ("freetoken.server.app", "freetoken.server.openai_output") in EDGES  # `from package import module`


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert _cycles(GRAPH) == []


def test_kernels_import_nothing_above_them():
    above = tuple(f"freetoken.{name}" for name in BELOW_KERNELS)
    bad = {(a, b) for a, b in EDGES if a.startswith("freetoken.kernels") and b.startswith(above)}
    assert bad == set()


def test_only_the_cli_imports_bench():
    def allowed(module: str) -> bool:
        return module == "freetoken.__main__" or module == "freetoken.bench" or module.startswith("freetoken.bench.")

    bad = {(a, b) for a, b in EDGES if b.startswith("freetoken.bench") and not allowed(a)}
    assert bad == set()


def test_no_file_over_the_line_limit():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {path: n for path, n in lines.items() if n > MAX_LINES} == {}
