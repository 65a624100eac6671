"""Control that always finishes, on real workers (issue 11): a busy reset, S90 over Celery, a park that expires at intake.

No beat runs in this module: what happens here happens without the sweeper.
"""

from __future__ import annotations

import time
import uuid

import pytest

from june_worker.engine.store import SessionRef
from june_worker.stores.postgres import PostgresStore
from june_worker.worker.queue import SessionQueue

from .conftest import Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.modes("prefork", "threads")]

OLD_RESET_WAIT_S = 30  # how long june.reset used to wait for a busy session before giving up for good


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> None:
    stack.worker("turns", concurrency=1, queues=stack.queue)
    stack.worker("control", pool="solo", queues=stack.control_queue)


def _status(stack: Stack, session: str, turn_id: str) -> str | None:
    return (stack.turn_row("ops", session, turn_id) or {}).get("status")


def test_a_reset_of_a_busy_session_answers_pending_at_once_and_happens_when_the_turn_ends(
    stack: Stack, session_id: str
) -> None:
    key = uuid.uuid4().hex
    busy = stack.turn("ops", session_id, f"slow {key}")
    wait_for(lambda: stack.redis.llen(f"it:hold:{key}:log") == 1, what="the tool to hold its worker")
    started = time.monotonic()
    # The reset is answered while the tool still runs (the old reset waited 30 s, then gave up for good).
    out = stack.send("june.reset", {"agent": "ops", "session": session_id}).get(timeout=10)
    assert out["status"] == "pending", out
    assert _status(stack, session_id, busy) == "running"
    after = stack.turn("ops", session_id, "order 2 nut")  # queues behind the reset
    # The tool runs on past the old reset's 30 s wait; the reset stays pending meanwhile, nobody waiting on it. The
    # reset's code is the control worker's, the same in both modes: the threads run waits out five leases, not 30 s.
    hold_s = OLD_RESET_WAIT_S + 1 if stack.mode == "prefork" else 5 * float(stack.env["JUNE_LEASE_S"])
    wait_for(lambda: time.monotonic() - started > hold_s, timeout_s=60, every_s=0.5, what="the long tool")
    assert stack.sql("select generation, reset_pending from june_sessions where session = %s", session_id) == [
        (0, True)
    ]
    assert _status(stack, session_id, busy) == "running"
    stack.redis.set(f"it:hold:{key}:release", 1)
    end = stack.wait_terminal("ops", session_id, busy)
    assert (end["type"], end["reason"]) == ("turn.cancelled", "reset")
    wait_for(lambda: _status(stack, session_id, after) == "completed", what="the turn queued behind the reset")
    assert stack.sql("select generation, reset_pending from june_sessions where session = %s", session_id) == [
        (1, False)
    ]
    live = stack.sql("select distinct turn_id from june_messages where session = %s", session_id)
    assert live == [(after,)]  # it ran on the new generation
    assert stack.sql("select qty from it_orders where turn_id = %s", after) == [(2,)]


def test_s90_a_turn_arriving_while_a_reset_of_a_parked_session_is_pending_runs_after_it(
    stack: Stack, session_id: str
) -> None:
    parked = stack.turn("ops", session_id, "refund", event={"source": "slack", "user": {"id": "U1", "attested": True}})
    assert stack.wait_terminal("ops", session_id, parked)["type"] == "input.requested"
    store = PostgresStore(stack.db_url, migrate=False)
    try:
        SessionQueue(store.pool, lease_s=2).request_reset(SessionRef("ops", session_id))  # a reset, underway
    finally:
        store.close()
    after = stack.turn("ops", session_id, "hello")  # its intake holds the session: it performs the reset first
    wait_for(lambda: _status(stack, session_id, after) == "completed", what="the turn after the reset")
    assert stack.sql("select generation, reset_pending from june_sessions where session = %s", session_id) == [
        (1, False)
    ]
    assert _status(stack, session_id, parked) == "cancelled"
    live = stack.sql("select distinct turn_id from june_messages where session = %s", session_id)
    assert live == [(after,)]


def test_a_park_that_expired_is_answered_by_the_next_turns_intake_without_a_sweeper(
    stack: Stack, session_id: str
) -> None:
    parked = stack.turn("ops", session_id, "quick")  # parks for one second
    assert stack.wait_terminal("ops", session_id, parked)["type"] == "input.requested"
    wait_for(
        lambda: (
            stack.sql(
                "select park_expires_at < extract(epoch from now()) from june_sessions where session = %s", session_id
            )
            == [(True,)]
        ),
        what="the park to expire by the database's clock",
    )
    after = stack.turn("ops", session_id, "hello")
    wait_for(lambda: _status(stack, session_id, after) == "completed", what="the next turn")
    assert _status(stack, session_id, parked) == "completed"
    done = [e for e in stack.structural("ops", session_id) if e["type"] == "action.completed"]
    assert done[-1]["result"] == {"approved": False, "timed_out": True}
