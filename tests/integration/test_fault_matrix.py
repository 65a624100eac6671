"""The fault matrix (issue 10): every step kind x every fault ends in a terminal status, writes once, and moves on.

Step kinds: a model step, a sync tool, an async tool, a park, a resume, a cancel, a reset. Faults:
the worker's database connections killed, a statement error the tool catches (sync tools only:
only they have a statement to fail), the worker process SIGKILLed, Redis (the event store)
unreachable for a few seconds, and a value nothing can store (NUL, lone surrogates). The
``faulty`` agent (:mod:`.faulty`) stops at the step; the test injects the fault and lets it go.

For every cell: the turn reaches its terminal status and its terminal event is in the stream,
every sync write committed exactly once, the stream holds each structural event once and in
order (by seq, and by meaning: one opening and one ending per turn, each message, action and
input once), and the session serves its next turn.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from bench._harness import repeated_events
from june_worker.stores.postgres import PostgresStore
from tests._services import RedisServer

from .conftest import Stack, _database, wait_for

pytestmark = pytest.mark.integration

STEPS = ["model", "sync", "async", "park", "resume", "cancel", "reset"]
FAULTS = ["connection-killed", "statement-error", "sigkill", "redis-down", "unstorable"]
CELLS = [(step, fault) for step in STEPS for fault in FAULTS if fault != "statement-error" or step == "sync"]
TERMINAL = {"turn.completed", "turn.failed", "turn.cancelled", "input.requested"}


@pytest.fixture(scope="module")
def matrix(
    database_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, RedisServer, Path]]:
    """A worker (two processes: a turn and a control task at once) whose event Redis the tests may stop."""
    from tests import _services

    tmp = tmp_path_factory.mktemp("matrix")
    faults = tmp / "faults"
    faults.mkdir()
    with _services.private_redis() as events_redis:
        db = _database(database_url)
        db_url = next(db)
        try:
            PostgresStore(db_url).close()
            stack = Stack(db_url, events_redis.url, tmp)
            stack.sql("create table it_faults (key text not null, call_id text not null)")
            stack.env.update(
                {"CELERY_BROKER_URL": redis_url, "CELERY_RESULT_BACKEND": redis_url, "JUNE_IT_FAULT_DIR": str(faults)}
            )
            stack.client = Celery("june-it-matrix", broker=redis_url, backend=redis_url)
            stack.client.conf.update(
                task_serializer="json",
                accept_content=["json"],
                result_accept_content=["json"],
                task_default_queue=stack.queue,
                task_routes={
                    name: {"queue": stack.control_queue}
                    for name in ("june.resume", "june.cancel", "june.reset", "june.sweep")
                },
            )
            stack.worker("matrix", concurrency=2)
            stack.beat()
            try:
                yield stack, events_redis, faults
            finally:
                stack.stop()
        finally:
            db.close()


def _status(stack: Stack, session: str, turn_id: str) -> str | None:
    return (stack.turn_row("faulty", session, turn_id) or {}).get("status")


def _kill_connections(stack: Stack) -> None:
    stack.sql(
        "select pg_terminate_backend(pid) from pg_stat_activity "
        "where datname = current_database() and pid <> pg_backend_pid() and backend_type = 'client backend'"
    )


def _inject(
    stack: Stack, events_redis: RedisServer, fault: str, at: Path, session: str, turn_id: str, done: str
) -> None:
    """Inject ``fault`` while the turn waits at ``at``, then let it go on (the ``go`` file)."""
    go = at.with_suffix(".go")
    if fault == "connection-killed":
        _kill_connections(stack)
    elif fault == "sigkill":
        os.kill(int(at.read_text().split()[0]), signal.SIGKILL)
    elif fault == "redis-down":
        events_redis.stop()
        go.write_text("go")
        try:  # a few seconds without Redis, or until the turn got where it goes
            wait_for(lambda: _status(stack, session, turn_id) == done, timeout_s=3, what="the turn, Redis down")
        except AssertionError:
            pass
        events_redis.start()
        return
    go.write_text("go")


def _terminal(stack: Stack, session: str, turn_id: str, expected: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        for e in stack.structural("faulty", session):
            if (
                e["turn_id"] == turn_id
                and e["type"] in TERMINAL
                and (e["type"] == expected or e["type"] != "input.requested")
            ):
                return e
        return None

    return wait_for(found, timeout_s=60, every_s=0.05, what=f"{expected} of {turn_id}")


@pytest.mark.parametrize(("step", "fault"), CELLS, ids=[f"{s}-{f}" for s, f in CELLS])
def test_a_fault_at_any_step_ends_the_turn_writes_once_and_the_session_goes_on(
    matrix: tuple[Stack, RedisServer, Path], step: str, fault: str
) -> None:
    stack, events_redis, faults = matrix
    key = f"{step}-{fault}-{uuid.uuid4().hex[:6]}"
    session = f"fm-{key}"
    at = faults / f"{key}.at"
    short = {"connection-killed": "connkill", "statement-error": "stmt", "redis-down": "redis"}.get(fault, fault)
    turn_id = stack.turn("faulty", session, f"fault {step} {short} {key}")
    if step == "resume":
        assert _terminal(stack, session, turn_id, "input.requested")["type"] == "input.requested"
        out = stack.send(
            "june.resume", {"agent": "faulty", "session": session, "turn_id": turn_id, "input_id": "ok", "value": True}
        ).get(timeout=30)
        assert out["status"] == "accepted", out
    wait_for(at.exists, timeout_s=30, what=f"the turn to stop at its {step} step")
    if step == "cancel":
        stack.send("june.cancel", {"agent": "faulty", "session": session, "turn_id": turn_id})
        wait_for(
            lambda: stack.sql("select cancel_reason from june_turns where turn_id = %s", turn_id) == [("requested",)],
            what="the cancel",
        )
    if step == "reset":
        stack.send("june.reset", {"agent": "faulty", "session": session})
        wait_for(
            lambda: stack.sql("select cancel_reason from june_turns where turn_id = %s", turn_id) == [("reset",)],
            what="the reset",
        )
    expected = {"park": "input.requested", "cancel": "turn.cancelled", "reset": "turn.cancelled"}.get(
        step, "turn.completed"
    )
    done = {"input.requested": "suspended", "turn.cancelled": "cancelled"}.get(expected, "completed")
    _inject(stack, events_redis, fault, at, session, turn_id, done)

    # The turn ends, in Postgres and in the stream.
    ended = _terminal(stack, session, turn_id, expected)
    assert ended["type"] == expected, ended
    wait_for(lambda: _status(stack, session, turn_id) == done, timeout_s=30, what=f"turn {done}")
    if step == "reset":
        wait_for(
            lambda: stack.sql("select generation from june_sessions where session = %s", session) == [(1,)],
            timeout_s=60,
            what="the reset to happen",
        )
    if step == "park":  # answer it, so that the session can serve its next turn
        out = stack.send(
            "june.resume", {"agent": "faulty", "session": session, "turn_id": turn_id, "input_id": "ok", "value": True}
        ).get(timeout=30)
        assert out["status"] == "accepted", out
        assert _terminal(stack, session, turn_id, "turn.completed")["type"] == "turn.completed"

    # Every sync write once; each structural event once, in order.
    rows = stack.sql("select call_id, count(*) from it_faults where key = %s group by call_id order by call_id", key)
    assert rows == ([("c1", 1), ("c1-after", 1)] if step == "sync" else []), rows

    # The session serves its next turn.
    after = stack.turn("faulty", session, "hello again")
    assert _terminal(stack, session, after, "turn.completed")["type"] == "turn.completed"
    events = stack.structural("faulty", session)
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # (a reset's archive keeps the numbering going)
    assert len({(e["turn_id"], e["seq"]) for e in events}) == len(events)
    # ... and by meaning: the same event committed twice would carry two seqs and pass the checks above.
    assert repeated_events(events) == []
    for t in (turn_id, after):
        kinds = [e for e in events if e["turn_id"] == t]
        opened = [e for e in kinds if e["type"] == "turn.started" and e["trigger"]["kind"] != "resume"]
        ended_events = [e for e in kinds if e["type"] in ("turn.completed", "turn.failed", "turn.cancelled")]
        assert (len(opened), len(ended_events)) == (1, 1), (t, [e["type"] for e in kinds])
