"""Producers are imported by other services: nothing under producers/ may import june_worker.

Checked twice: statically (no import statement names it) and for real (a producer sending a turn and
following events in a fresh interpreter ends with no ``june_worker`` module loaded).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, Names

PRODUCERS = REPO / "producers"

PROGRAM = """
import json, sys
from producers import JuneProducer
from producers.cli import main  # the CLI and its rich view too
import producers.render

names = json.loads(sys.argv[1])
with JuneProducer(names["redis_url"], queue=names["queue"], control_queue=names["control_queue"],
                  key_prefix=names["prefix"]) as producer:
    turn_id = producer.start_turn("ops", names["session"], "hello")
    list(producer.follow("ops", names["session"], turn_id=turn_id, timeout_s=0))
print(json.dumps(sorted(m for m in sys.modules if m == "june_worker" or m.startswith("june_worker."))))
"""


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def test_no_module_under_producers_imports_june_worker() -> None:
    offenders = {
        str(path.relative_to(REPO)): sorted(m for m in imported_modules(path) if m.split(".")[0] == "june_worker")
        for path in sorted(PRODUCERS.rglob("*.py"))
    }
    assert {path: mods for path, mods in offenders.items() if mods} == {}
    assert len(offenders) >= 5  # the scan did see the package


@pytest.mark.integration
def test_a_producer_at_work_loads_no_june_worker_module(
    redis_url: str, names: Names, session_id: str, producer: object
) -> None:
    args = {"redis_url": redis_url, "queue": names.queue, "control_queue": names.control_queue}
    args |= {"prefix": names.prefix, "session": session_id}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, json.dumps(args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []
