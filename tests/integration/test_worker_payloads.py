"""Bad input is rejected once, with a reason that says what was wrong; nothing is retried or lost."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from .conftest import Stack

pytestmark = [pytest.mark.integration, pytest.mark.modes("prefork", "threads")]


@pytest.fixture(scope="module", autouse=True)
def worker(stack: Stack) -> None:
    stack.worker("payloads", pool="solo")


def _good(session: str, **over: Any) -> dict[str, Any]:
    return {"turn_id": f"t_{uuid.uuid4().hex}", "agent": "ops", "session": session, "text": "hi", **over}


@pytest.mark.parametrize(
    ("args", "kwargs", "reason"),
    [
        (["hello"], {}, "expected a JSON object, got str"),
        ([[1, 2]], {}, "expected a JSON object, got list"),
        ([{}, {}], {}, "expected exactly one JSON object argument, got 2 positional"),
        ([], {"turn_id": "t1"}, "got 0 positional and 1 keyword"),
        ([{"agent": "ops", "session": "s"}], {}, "turn_id: Field required"),
        ([{"turn_id": "t1", "agent": "ops", "session": "s", "text": 5}], {}, "text: Input should be a valid string"),
        ([{"turn_id": "t1", "agent": "ops", "session": "s", "text": "x", "colour": "red"}], {}, "colour: Extra inputs"),
        ([{"turn_id": "t 1\n", "agent": "ops", "session": "s", "text": "x"}], {}, "turn_id: String should match"),
        ([{"turn_id": "t1", "agent": "ops", "session": "bad\r\nkey", "text": "x"}], {}, "session: String should match"),
        ([{"turn_id": "t1", "agent": "ops", "session": "s", "text": "x", "trigger": {"kind": "x"}}], {}, "trigger must be"),
    ],
    ids=["string", "list", "two-args", "kwargs", "missing", "wrong-type", "unknown-field", "bad-turn-id",
         "bad-session", "bad-trigger"],
)  # fmt: skip
def test_an_unusable_turn_message_is_rejected_once_with_a_reason(
    stack: Stack, args: list[Any], kwargs: dict[str, Any], reason: str
) -> None:
    result = stack.client.send_task("june.turn", args=args, kwargs=kwargs)
    out = stack.outcome(result)  # it succeeded: acknowledged, never redelivered, never retried
    assert out["status"] == "rejected"
    assert reason in out["reason"]
    log = stack.procs[0].log.read_text()
    assert log.count(f"june.turn[{result.id}] received") == 1


def test_an_unknown_agent_is_recorded_as_a_rejected_turn_and_its_stream_ends(stack: Stack, session_id: str) -> None:
    payload = _good(session_id, agent="nobody")
    out = stack.outcome(stack.send("june.turn", payload))
    assert out["status"] == "rejected" and "unknown agent 'nobody'" in out["reason"]
    assert stack.turn_row("nobody", session_id, payload["turn_id"])["status"] == "rejected"  # type: ignore[index]
    events = stack.structural("nobody", session_id)
    assert [(e["type"], e["phase"]) for e in events] == [("turn.failed", "intake")]
    assert "unknown agent" in events[0]["error"]["message"]


def test_an_invalid_message_that_names_a_turn_ends_that_turns_stream(stack: Stack, session_id: str) -> None:
    payload = _good(session_id, text=["not", "text"])
    out = stack.outcome(stack.send("june.turn", payload))
    assert out["status"] == "rejected" and out["turn_id"] == payload["turn_id"]
    events = stack.structural("ops", session_id)
    assert [e["type"] for e in events] == ["turn.failed"] and events[0]["turn_id"] == payload["turn_id"]


def test_a_pickled_message_is_refused_and_the_worker_goes_on(stack: Stack, session_id: str) -> None:
    refused = stack.client.send_task("june.turn", args=[_good(session_id)], serializer="pickle")
    good = _good(session_id, text="after the pickle")
    assert stack.outcome(stack.send("june.turn", good))["status"] == "completed"
    assert refused.state == "PENDING"  # it never ran
    log = stack.procs[0].log.read_text()
    assert "pickle" in log and "untrusted" in log.lower()


@pytest.mark.parametrize(
    ("task", "payload", "reason"),
    [
        ("june.resume", {"agent": "ops", "session": "s"}, "turn_id: Field required"),
        ("june.cancel", {"agent": "ops"}, "session: Field required"),
        ("june.reset", {"agent": "ops", "session": "s", "now": True}, "now: Extra inputs"),
        ("june.proactive", {"agent": "ops", "session": "s", "text": "x"}, "by: Field required"),
        ("june.sweep", {"limit": 0}, "limit: Input should be greater than or equal to 1"),
    ],
)
def test_every_task_rejects_a_bad_payload_with_a_reason(
    stack: Stack, task: str, payload: dict[str, Any], reason: str
) -> None:
    result = stack.send(task, payload)
    out = stack.outcome(result) if task in ("june.proactive", "june.sweep") else result.get(timeout=30)
    assert out["status"] == "rejected" and reason in out["reason"]


def test_resume_of_an_unknown_agent_is_rejected(stack: Stack, session_id: str) -> None:
    out = stack.send(
        "june.resume", {"agent": "nobody", "session": session_id, "turn_id": "t1", "input_id": "a", "value": True}
    ).get(timeout=30)
    assert out == {"turn_id": "t1", "input_id": "a", "status": "rejected", "reason": "unknown agent 'nobody'"}


def test_a_tools_failed_write_rolls_back_and_becomes_an_error_the_model_reads(stack: Stack, session_id: str) -> None:
    # a quantity beyond Postgres' integer: the tool's insert fails inside the step's transaction
    out = stack.outcome(stack.send("june.turn", _good(session_id, text="order 99999999999 x")))
    assert out["status"] == "completed"
    done = [e for e in stack.structural("ops", session_id) if e["type"] == "action.completed"]
    assert len(done) == 1 and "out of range" in done[0]["error"]
    assert stack.sql("select count(*) from it_orders where turn_id = %s", out["turn_id"]) == [(0,)]


def test_a_rejected_proactive_message_still_ends_its_turns_stream(stack: Stack, session_id: str) -> None:
    # no `by`: invalid; the turn id comes from the task id (ULID-shaped), and a follower of it sees the end
    from june_worker.worker.control import proactive_turn_id

    result = stack.client.send_task("june.proactive", args=[{"agent": "ops", "session": session_id, "text": "x"}])
    out = stack.outcome(result)
    assert out["status"] == "rejected" and out["turn_id"] == proactive_turn_id(result.id)
    assert [(e["type"], e["turn_id"]) for e in stack.structural("ops", session_id)] == [("turn.failed", out["turn_id"])]
