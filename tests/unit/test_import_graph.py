"""The import rules, read off the source (and, for ``import producers``, off a fresh interpreter).

1. The engine imports no infrastructure: nothing it imports, directly or through another module of the
   repository, is a store, the worker, the gateway, or celery / redis / psycopg and the like.
2. Producers import no module of ``june_worker`` that pulls the engine, and ``import producers`` loads no
   ``june_worker.engine`` / ``.stores`` / ``.worker`` module (a service that only enqueues stays light).
3. No runtime import circle among the modules of ``june_worker`` (with ``june_wire`` and ``producers``).

An import counts wherever it runs: at a module's top, and for rules 1 and 2 inside a function too (it
runs when the function is called). Imports under ``if TYPE_CHECKING:`` never run and never count; for
rule 3 an import inside a function does not count either (it runs after every module involved has
loaded: deferring an import into a function is the way to break a load-time circle). Importing
``a.b.c`` runs ``a`` and ``a.b`` first, so a package's ``__init__`` is part of every import of its parts.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("june_wire", "june_worker", "producers")
INFRASTRUCTURE = ("celery", "kombu", "billiard", "redis", "psycopg", "psycopg_pool", "sqlite3", "anthropic")
"""Third-party (and standard-library) infrastructure the engine may not reach."""
INFRASTRUCTURE_MODULES = ("june_worker.stores", "june_worker.worker", "june_worker.gateway", "june_worker.events")
"""The repository's own infrastructure: adapters and hosts that sit beside or above the engine."""
HEAVY = ("june_worker.engine", "june_worker.stores", "june_worker.worker")
"""What a process that only enqueues must never load."""


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


def _imports(path: Path, *, in_functions: bool = True) -> set[str]:
    """Every module ``path`` imports at run time (absolute names; ``from . import x`` gives ``pkg.x``);
    ``in_functions=False``: only those that run while the module loads (not inside a function's body)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if not in_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
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


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _parents(module: str) -> Iterable[str]:
    """The packages importing ``module`` runs first: ``a`` and ``a.b`` for ``a.b.c``."""
    parts = module.split(".")
    return (".".join(parts[:i]) for i in range(1, len(parts)))


def _graph(*, in_functions: bool) -> dict[str, set[str]]:
    """Each module of the repository, with the modules of the repository importing it runs (its imports and
    their packages). A module's own packages are imported before it by definition: no edge to them."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {m for m in _imports(path, in_functions=in_functions) if m in modules}
        targets |= {p for m in targets for p in _parents(m) if p in modules}
        graph[name] = {m for m in targets if m != name and not name.startswith(m + ".")}
    return graph


def _external(*, in_functions: bool) -> dict[str, set[str]]:
    """Each module of the repository, with the top-level names outside the repository it imports."""
    return {
        name: {m.split(".")[0] for m in _imports(path, in_functions=in_functions)} - set(PACKAGES)
        for name, path in _modules().items()
    }


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module importing ``start`` runs: itself, its packages, what they import, and so on."""
    seen: set[str] = set()
    todo = [start, *(p for p in _parents(start) if p in graph)]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def _under(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


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
        for w in sorted(graph.get(v, ())):
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


def test_the_engine_imports_no_infrastructure_directly_or_through_another_module() -> None:
    graph, external = _graph(in_functions=True), _external(in_functions=True)
    engine = [m for m in graph if _under(m, ["june_worker.engine"])]
    assert len(engine) > 20  # the scan did see the engine
    offending = {}
    for name in engine:
        reached = _reach(graph, name)
        bad = sorted(m for m in reached if _under(m, INFRASTRUCTURE_MODULES))
        bad += sorted(f"{m} -> {x}" for m in reached for x in external.get(m, ()) if x in INFRASTRUCTURE)
        if bad:
            offending[name] = bad
    assert offending == {}


def test_producers_import_no_june_worker_module_that_pulls_the_engine() -> None:
    graph = _graph(in_functions=True)
    producers = [m for m in graph if _under(m, ["producers"])]
    assert len(producers) > 5
    offending = {name: sorted(m for m in _reach(graph, name) if _under(m, HEAVY)) for name in producers}
    assert {k: v for k, v in offending.items() if v} == {}


def test_import_producers_loads_no_module_of_the_engine_the_stores_or_the_worker() -> None:
    program = (
        "import json, sys\nimport producers, producers.cli, producers.render\nprint(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT, check=True)
    loaded = json.loads(done.stdout)
    assert "producers" in loaded
    assert [m for m in loaded if _under(m, HEAVY)] == []


def test_no_runtime_import_runs_in_a_circle() -> None:
    assert _cycles(_graph(in_functions=False)) == []


def test_the_check_sees_a_circle_when_there_is_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
