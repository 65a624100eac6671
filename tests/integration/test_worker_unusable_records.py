"""Queued turns whose stored record no worker can use are rejected, their streams ended; nothing else stalls.

Workers record only what they validated, but a durable producer records from outside them, and
Postgres' ``json`` takes what no worker can use: a ``\\u0000`` escape (a NUL no store holds, which
every worker refuses in a message) and a lone surrogate escape (the record cannot be read at all).
Such rows are written here directly, as an older producer or a hand-made insert would leave them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from june_worker.stores.postgres import PostgresStore

from .conftest import Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.modes("prefork", "threads")]

NUL = '{"text": "order\\u0000 2"}'
SURROGATE = '{"text": "caf\\udce9"}'


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> None:
    PostgresStore(stack.db_url).close()  # the schema, as `june migrate` leaves it, before any row is written here
    stack.worker("records", pool="solo")
    stack.beat()


def _record(stack: Stack, session: str, payload: str, *, age_s: float) -> str:
    """A queued turn as ``june_enqueue_turn`` records it, with the payload as given, recorded ``age_s`` ago."""
    turn_id = f"t_{uuid.uuid4().hex}"
    stack.sql(
        "select recorded from june_enqueue_turn('ops', %s::text, %s::text, %s::json, true)", session, turn_id, payload
    )
    stack.sql(
        "update june_turns set created_at = extract(epoch from now()) - %s where agent = 'ops' and turn_id = %s",
        age_s,
        turn_id,
    )
    return turn_id


def _ended(stack: Stack, session: str, turn_id: str) -> dict[str, Any]:
    """The turn's terminal event, once; and the row is rejected with a payload any worker can read."""
    event = stack.wait_terminal("ops", session, turn_id)
    ends = [e for e in stack.structural("ops", session) if e["turn_id"] == turn_id]
    assert [(e["type"], e.get("phase")) for e in ends] == [("turn.failed", "intake")]
    (status, payload), *_ = stack.sql(
        "select status, payload::text from june_turns where agent = 'ops' and session = %s and turn_id = %s",
        session,
        turn_id,
    )
    assert status == "rejected"
    assert "\\u0000" not in payload and "\\udc" not in payload.lower()
    json.loads(payload)
    return event


def test_the_sweeper_rejects_queued_records_no_worker_can_use_and_still_sends_the_other_sessions_turns(
    stack: Stack, session_id: str
) -> None:
    # Given three sessions with a queued turn nobody holds, past the sweeper's grace period: one record with a
    # NUL, one with a lone surrogate (it cannot be read), and a good one, in the same sweep's batch
    nul_s, surrogate_s, good_s = f"{session_id}-a", f"{session_id}-b", f"{session_id}-c"
    nul = _record(stack, nul_s, NUL, age_s=60)
    surrogate = _record(stack, surrogate_s, SURROGATE, age_s=60)
    good = _record(stack, good_s, '{"text": "order 1 bolt"}', age_s=60)

    # Then the good one is sent and runs (the unreadable row used to make every sweep raise before sending any)
    assert stack.wait_terminal("ops", good_s, good)["type"] == "turn.completed"
    # and the sweeper ends the two it cannot send, each with its stream's terminal event saying why
    assert "payload.text: contains a NUL character" in _ended(stack, nul_s, nul)["error"]["message"]
    assert "cannot be read" in _ended(stack, surrogate_s, surrogate)["error"]["message"]
    # and the sessions serve their next turn
    after = stack.turn("ops", surrogate_s, "hello again")
    assert stack.wait_terminal("ops", surrogate_s, after)["type"] == "turn.completed"


@pytest.mark.parametrize(
    ("stored", "text", "named"),
    [(NUL, "order\x00 2", "text: contains a NUL character"), (SURROGATE, "caf\udce9", "lone surrogate (U+DCE9)")],
    ids=["nul", "surrogate"],
)
def test_a_recorded_turn_whose_message_a_worker_refuses_is_rejected_instead_of_left_queued(
    stack: Stack, session_id: str, stored: str, text: str, named: str
) -> None:
    # Given a queued record no worker can use, recorded "in the future" so the sweeper leaves it to its message
    turn_id = _record(stack, session_id, stored, age_s=-3600)

    # When its message (as a durable producer sent it) reaches a worker, which refuses it
    out = stack.outcome(
        stack.send("june.turn", {"turn_id": turn_id, "agent": "ops", "session": session_id, "text": text})
    )

    # Then the recorded turn is rejected and its stream ended: nothing would ever run or end it
    assert out["status"] == "rejected" and named in out["reason"]
    assert named in _ended(stack, session_id, turn_id)["error"]["message"]


def test_a_record_no_worker_can_run_queued_behind_a_running_turn_is_rejected_by_the_holder_and_the_next_runs(
    stack: Stack, session_id: str
) -> None:
    # Given a session whose worker is running a turn, with an unreadable record queued behind it (recorded "in
    # the future", so the sweeper leaves it be), and a good turn behind that
    key = uuid.uuid4().hex
    first = stack.turn("ops", session_id, f"slow {key}")
    wait_for(lambda: stack.redis.llen(f"it:hold:{key}:log") == 1, what="the first turn to hold its worker")
    bad = _record(stack, session_id, SURROGATE, age_s=-3600)
    after = stack.turn("ops", session_id, "order 1 bolt")
    # When the running turn ends, and its worker picks the next turn (counting a start of it as it picks it)
    stack.redis.set(f"it:hold:{key}:release", 1)
    # Then that worker rejects the record under its lease, naming the session (the sweeper's words do not), and
    # runs the turn behind it: the session is not left to a lease expiry, nor stuck on a record counted as started
    assert stack.wait_terminal("ops", session_id, first)["type"] == "turn.completed"
    assert stack.wait_terminal("ops", session_id, after)["type"] == "turn.completed"
    message = _ended(stack, session_id, bad)["error"]["message"]
    assert "cannot be read" in message and session_id in message


def test_a_new_turn_whose_lease_comes_with_a_record_no_worker_can_run_ends_that_record_and_runs(
    stack: Stack, session_id: str
) -> None:
    # Given an idle session whose first queued turn is an unreadable record (recorded "in the future": the
    # sweeper leaves it to a worker)
    bad = _record(stack, session_id, SURROGATE, age_s=-3600)
    # When a new turn's message reaches a worker, whose intake takes the lease for that first turn
    new = stack.turn("ops", session_id, "order 2 bolt")
    # Then the record is rejected there and the new turn runs
    assert stack.wait_terminal("ops", session_id, new)["type"] == "turn.completed"
    assert session_id in _ended(stack, session_id, bad)["error"]["message"]
