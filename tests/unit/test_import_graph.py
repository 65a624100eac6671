"""The import rules, read off the source: the engine imports no infrastructure, and no runtime import runs in a circle.

An import counts wherever it is written (a module's top or inside a function: both run), except under
``if TYPE_CHECKING:``, which never runs. Relative imports are resolved against the importing module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("june_worker", "producers")
INFRASTRUCTURE = ("celery", "kombu", "redis", "psycopg", "psycopg_pool", "sqlite3", "anthropic")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports at run time (absolute names; ``from . import x`` gives ``pkg.x``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # (a submodule, when it is one)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # (a module's own packages are imported before it by definition: ``from . import x`` is no edge to them)
        graph[name] = {m for m in _imports(path) if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _package_of(module: str) -> str:
    """A module's package, and a package's own ``__init__`` its package: imports of a package's parts run it."""
    return module.rpartition(".")[0]


def test_no_runtime_import_runs_in_a_circle() -> None:
    graph = _graph()
    # importing a.b.c runs a and a.b first: a package's __init__ is an edge of every import of its parts, so a
    # circle through an __init__ that re-exports (june_worker/__init__) counts too
    for name in list(graph):
        for target in list(graph[name]):
            parent = _package_of(target)
            while parent and parent != name and parent in graph and not name.startswith(parent + "."):
                graph[name].add(parent)
                parent = _package_of(parent)
    assert _cycles(graph) == []


def test_the_engine_imports_no_infrastructure() -> None:
    offending = {
        name: sorted(m for m in _imports(path) if m.split(".")[0] in INFRASTRUCTURE)
        for path in (ROOT / "june_worker" / "engine").rglob("*.py")
        if (name := _module_name(path))
    }
    assert {k: v for k, v in offending.items() if v} == {}


def test_the_check_sees_a_circle_when_there_is_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
