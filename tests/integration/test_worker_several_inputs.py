"""Several pending inputs per turn on real workers (issue 17): a turn parks on every request its parallel calls
asked; answers sent at the same moment to different requests are both applied (by two worker processes,
racing in Postgres), answers to the same request once; the turn goes on after the last one.

The ``desks`` agent (tests/integration/agents.py) asks n desks to sign off at once.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from june_worker.stores.postgres import PostgresStore

from .conftest import Stack, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> None:
    PostgresStore(stack.db_url).close()
    stack.worker("desks", pool="prefork", concurrency=2)  # two processes: two answers apply at the same time


def _parked(stack: Stack, n: int) -> tuple[str, str]:
    session = f"desks-{uuid.uuid4().hex[:8]}"
    turn_id = stack.turn("desks", session, f"desks {n}")
    assert stack.wait_terminal("desks", session, turn_id)["type"] == "input.requested"
    return session, turn_id


def _ended(stack: Stack, session: str, turn_id: str) -> dict[str, Any]:
    """The turn's last terminal event once it is not a park (wait_terminal stops at the first park)."""

    def found() -> dict[str, Any] | None:
        ends = [e for e in stack.structural("desks", session) if e["turn_id"] == turn_id]
        last = ends[-1] if ends else None
        return last if last is not None and last["type"] in ("turn.completed", "turn.failed") else None

    return wait_for(found, what=f"the end of {turn_id}")


def _resume(stack: Stack, session: str, turn_id: str, input_id: str, value: Any, by: str) -> Any:
    payload = {"agent": "desks", "session": session, "turn_id": turn_id, "input_id": input_id, "value": value, "by": by}
    return stack.send("june.resume", payload)


def test_a_turn_parks_on_every_request_and_racing_answers_to_different_requests_both_apply(stack: Stack) -> None:
    for _ in range(4):  # a few rounds: the two answers meet in Postgres in some of them
        # Given a turn parked on three requests, each with its own answerer
        session, turn_id = _parked(stack, 3)
        requested = [e["request"]["id"] for e in stack.structural("desks", session) if e["type"] == "input.requested"]
        assert requested == ["desk1", "desk2", "desk3"]
        # When the first two are answered at the same moment, by their own answerers
        sent = [_resume(stack, session, turn_id, f"desk{i}", f"yes-{i}", f"owner-{i}") for i in (1, 2)]
        outcomes = [r.get(timeout=30) for r in sent]
        # Then both apply, and the turn still waits for the third
        assert [o["status"] for o in outcomes] == ["accepted", "accepted"], outcomes
        parked = stack.sql("select suspended->'request'->>'id', json_array_length(suspended->'more') "
                           "from june_sessions where session = %s", session)  # fmt: skip
        assert parked == [("desk3", 0)]
        # and a wrong answerer cannot answer it
        refused = _resume(stack, session, turn_id, "desk3", "yes", "owner-1").get(timeout=30)
        assert refused["status"] == "forbidden"
        # When the last one is answered, the turn goes on with all three answers, in call order
        assert _resume(stack, session, turn_id, "desk3", "yes-3", "owner-3").get(timeout=30)["status"] == "accepted"
        ended = _ended(stack, session, turn_id)
        assert ended["type"] == "turn.completed"
        expected = [{"desk": i, "answer": f"yes-{i}"} for i in (1, 2, 3)]
        assert ended["text"] == f"signed: {expected}"
        types = [e["type"] for e in stack.structural("desks", session)]
        assert types.count("input.answered") == 2 and types.count("turn.started") == 2  # the opening, one resume


def test_two_answers_to_the_same_request_apply_once(stack: Stack) -> None:
    session, turn_id = _parked(stack, 2)
    sent = [_resume(stack, session, turn_id, "desk1", value, "owner-1") for value in ("first", "second")]
    statuses = sorted(r.get(timeout=30)["status"] for r in sent)
    assert statuses == ["accepted", "conflict"]
    answers = stack.sql(
        "select data->>'answer' from june_steps where session = %s and step_id like 'input:%%'", session
    )
    assert len(answers) == 1
    assert _resume(stack, session, turn_id, "desk2", "ok", "owner-2").get(timeout=30)["status"] == "accepted"
    assert _ended(stack, session, turn_id)["type"] == "turn.completed"
