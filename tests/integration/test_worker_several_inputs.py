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

pytestmark = [pytest.mark.integration, pytest.mark.modes("prefork", "threads")]


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> None:
    PostgresStore(stack.db_url).close()
    stack.worker("desks", concurrency=2)  # two processes: two answers apply at the same time
    stack.beat()  # the sweeper: relays what a killed worker committed but did not publish


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


def test_a_worker_killed_after_the_park_committed_leaves_both_requests_to_the_relay_and_both_answers_apply(
    stack: Stack,
) -> None:
    session = f"desks-crash-{uuid.uuid4().hex[:6]}"
    # Given a worker (on a queue of its own) that dies right after a park on two requests committed, before
    # its events were published
    queue = f"{stack.queue}.{session}"
    doomed = stack.worker(
        f"doomed-{session[-6:]}", pool="solo", queues=queue, env={"JUNE_CRASH_AT": "before-publish@turn:end"}
    )
    turn_id = f"t_{uuid.uuid4().hex}"
    stack.send("june.turn", {"turn_id": turn_id, "agent": "desks", "session": session, "text": "desks 2"}, queue=queue)
    wait_for(lambda: doomed.popen.poll() is not None, what="the worker to kill itself at the park")
    doomed.kill()

    # Then the relay publishes both requests, once each
    def requested() -> list[str] | None:
        ids = [e["request"]["id"] for e in stack.structural("desks", session) if e["type"] == "input.requested"]
        return ids if len(ids) == 2 else None

    assert wait_for(requested, what="both requests relayed") == ["desk1", "desk2"]
    # and the park takes both answers, and the turn goes on once
    for i in (1, 2):
        assert _resume(stack, session, turn_id, f"desk{i}", i, f"owner-{i}").get(timeout=30)["status"] == "accepted"
    ended = _ended(stack, session, turn_id)
    assert ended["text"] == f"signed: {[{'desk': 1, 'answer': 1}, {'desk': 2, 'answer': 2}]}"
    types = [e["type"] for e in stack.structural("desks", session)]
    assert types.count("input.requested") == 2 and types.count("turn.completed") == 1


def test_one_request_of_a_park_expires_through_the_sweeper_and_the_turn_waits_for_the_other(stack: Stack) -> None:
    # Given a turn parked on two requests, the first with a timeout of a second
    session = f"desks-{uuid.uuid4().hex[:8]}"
    turn_id = stack.turn("desks", session, "desks 2 expire")
    assert stack.wait_terminal("desks", session, turn_id)["type"] == "input.requested"

    # When its time passes with nobody answering (nothing touches the session: the sweeper answers it with a
    # timeout), and only it
    def answered() -> dict[str, Any] | None:
        found = [e for e in stack.structural("desks", session) if e["type"] == "input.answered"]
        return found[0] if found else None

    expired = wait_for(answered, timeout_s=30, what="the sweeper to expire desk1")
    assert (expired["input_id"], expired["open"]) == ("desk1", 1)
    row = stack.turn_row("desks", session, turn_id)
    assert row is not None and row["status"] == "suspended"  # still parked, on the other request
    assert (row["result"]["request"]["id"], row["result"].get("more", [])) == ("desk2", [])
    late = _resume(stack, session, turn_id, "desk1", "too late", "owner-1").get(timeout=30)
    assert late["status"] == "conflict" and "not 'desk1'" in late["reason"]  # it was closed by its timeout

    # Then the other is answered, and the turn goes on once, with the timeout as the first call's answer
    assert _resume(stack, session, turn_id, "desk2", "yes-2", "owner-2").get(timeout=30)["status"] == "accepted"
    done = _ended(stack, session, turn_id)
    assert done["type"] == "turn.completed"
    assert done["text"] == "signed: [{'desk': 1, 'answer': 'timed out'}, {'desk': 2, 'answer': 'yes-2'}]"
    resumed = [e for e in stack.structural("desks", session) if e["type"] == "turn.started"]
    assert [e["trigger"]["kind"] for e in resumed] == ["proactive", "resume"]
