"""Every Python snippet of the README runs as written, and prints what its comment says.

Each ```python block of README.md comes right after a comment that says how it runs and what it
prints last: ``<!-- readme-snippet: in-process; prints: Order placed. -->`` (a script of its own, in an
empty directory, with no server) or ``<!-- readme-snippet: workers ...; prints: accepted -->`` (against
workers on the default agents, with the workers' variables set: ``demo_kit.demo_stack``). A block without
such a comment fails here: a snippet nobody runs drifts from the code it shows.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, Stack

from .cli_kit import cli_env
from .demo_kit import demo_stack

__all__ = ["demo_stack"]  # the fixture, imported for pytest

KINDS = ("in-process", "workers")
_BLOCK = re.compile(r"^(?P<indent> *)```python\n(?P<code>.*?)\n(?P=indent)```", re.S | re.M)
_MARK = re.compile(r"<!-- readme-snippet: (?P<kind>[a-z-]+)[^;>]*; prints: (?P<prints>.+?) -->\n *$")


@dataclass(frozen=True)
class Snippet:
    line: int
    kind: str
    prints: str
    code: str

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.kind})"


def readme_snippets() -> list[Snippet | str]:
    """Each python block of the README, or for one without its comment, the line that says so."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found: list[Snippet | str] = []
    for block in _BLOCK.finditer(text):
        line = text.count("\n", 0, block.start()) + 1
        before = text[: block.start()].rsplit("\n", 2)[-2] + "\n"
        mark = _MARK.search(before)
        if mark is None or mark.group("kind") not in KINDS:
            found.append(
                f"README.md:{line}: a python block without <!-- readme-snippet: {'|'.join(KINDS)}; prints: ... -->"
            )
            continue
        found.append(Snippet(line, mark.group("kind"), mark.group("prints"), textwrap.dedent(block.group("code"))))
    return found


SNIPPETS = readme_snippets()


def test_every_python_snippet_of_the_readme_says_how_it_runs() -> None:
    assert [s for s in SNIPPETS if isinstance(s, str)] == []
    assert {s.kind for s in SNIPPETS if isinstance(s, Snippet)} == set(KINDS)


def run(snippet: Snippet, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = cwd / "snippet.py"
    script.write_text(snippet.code, encoding="utf-8")
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=90)


def check(snippet: Snippet, done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, f"{snippet} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr, f"{snippet}:\n{done.stderr}"
    lines = done.stdout.strip().splitlines()
    assert lines and snippet.prints in lines[-1], f"{snippet} should print {snippet.prints!r} last:\n{done.stdout}"


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if isinstance(s, Snippet) and s.kind == "in-process"], ids=str)
def test_an_in_process_snippet_of_the_readme_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    check(snippet, run(snippet, tmp_path, {**env, "PYTHONPATH": str(ROOT)}))


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if isinstance(s, Snippet) and s.kind == "workers"], ids=str)
def test_a_snippet_of_the_readme_runs_as_written_against_workers(
    snippet: Snippet, demo_stack: Stack, tmp_path: Path
) -> None:
    check(snippet, run(snippet, tmp_path, cli_env(demo_stack)))


def test_every_name_the_readme_imports_from_the_package_is_there() -> None:
    # Given every "from june_worker... import ..." and "from producers... import ..." the README shows (in code or in
    # its sentences, as for ContextPolicy)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    imports = re.findall(r"from ((?:june_worker|producers)[\w.]*) import ([\w, ]+)", text)
    assert ("june_worker", "ContextPolicy") in imports
    # Then each one imports
    missing = []
    for module, names in imports:
        loaded = importlib.import_module(module)
        missing += [f"{module}.{n.strip()}" for n in names.split(",") if n.strip() and not hasattr(loaded, n.strip())]
    assert missing == []
