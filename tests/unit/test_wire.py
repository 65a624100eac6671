"""The wire protocol's one home (``june_wire``): what it may import, and rules the workers and producers now share.

``june_wire`` is imported by the engine and by ``producers``; it must stay beneath both (nothing of either,
and no infrastructure but ``redis`` in its Redis URL module), or importing ``producers`` would load the
engine, and the engine would load Redis.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from june_wire.events import DELTA_TYPES, TERMINAL_TYPES
from june_wire.keys import EventKeys
from june_worker.engine.events import MessageDelta, ReasoningDelta, TurnEvent
from june_worker.events.redis_stream import redact as sink_redact
from producers import JuneProducer, ProducerConfigError

REPO = Path(__file__).resolve().parents[2]
WIRE = REPO / "june_wire"
PURE = ["errors", "events", "follow", "gaps", "ids", "keys", "storable"]  # all but redis_url
INFRASTRUCTURE = ("celery", "kombu", "redis", "psycopg", "psycopg_pool", "sqlite3", "anthropic", "pydantic")


def imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_module_of_the_wire_home_imports_june_worker_or_producers() -> None:
    offenders = {
        path.name: sorted(imported_roots(path) & {"june_worker", "producers"}) for path in sorted(WIRE.glob("*.py"))
    }
    assert {name: roots for name, roots in offenders.items() if roots} == {}
    assert {f"{m}.py" for m in PURE} <= set(offenders)  # the scan did see the package


def test_the_wire_modules_the_engine_may_import_load_no_infrastructure() -> None:
    # Given a fresh interpreter, When it imports every module of june_wire but redis_url
    program = (
        "import importlib, json, sys\n"
        f"for name in {PURE!r}: importlib.import_module('june_wire.' + name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False)
    # Then none of celery, redis, psycopg... nor the engine or the producers is loaded
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert loaded & {*INFRASTRUCTURE, "june_worker", "producers"} == set()


def test_the_engines_event_models_keep_to_the_wires_type_names() -> None:
    types = {typing.get_args(model.model_fields["type"].annotation)[0] for model in _members(TurnEvent)}
    assert DELTA_TYPES == {MessageDelta.model_fields["type"].default, ReasoningDelta.model_fields["type"].default}
    assert TERMINAL_TYPES <= types and DELTA_TYPES <= types


def _members(union: object) -> list[type]:
    annotated = typing.get_args(union)[0]  # Annotated[A | B | ..., Field(discriminator=...)]
    return list(typing.get_args(annotated))


def test_a_password_holding_an_at_sign_is_redacted_whole_in_what_the_sink_logs() -> None:
    # Given an error text naming a Redis URL whose password holds an "@" (the producers' rule already hid it whole)
    said = "Error connecting to redis://june:p@ss@word@redis.internal:6379/0 (refused)"
    # When the event sink redacts it for its log line
    # Then no part of the password is left
    assert sink_redact(said) == "Error connecting to redis://***@redis.internal:6379/0 (refused)"


@pytest.mark.parametrize("prefix", ["june\t1", "june\n", "ju ne", "{june}", ""])
def test_workers_refuse_a_key_prefix_a_producer_refuses(prefix: str) -> None:
    # Given a prefix with a tab, a line break, a space or braces (a tab was taken by the workers, refused by producers)
    # When workers and a producer are given it, Then both refuse it, saying what a prefix may be
    with pytest.raises(ValueError, match="expected a non-empty name without braces or spaces"):
        EventKeys(prefix=prefix)
    with pytest.raises(ProducerConfigError, match="expected a non-empty name without braces or spaces"):
        JuneProducer("redis://127.0.0.1:1/0", key_prefix=prefix)
