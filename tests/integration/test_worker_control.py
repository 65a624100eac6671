"""Resume, cancel, replace, reset and proactive turns through real Celery workers; events read from Redis."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from .conftest import Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.brokers("redis", "amqp"), pytest.mark.modes("prefork", "threads")]


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> None:
    stack.worker("turns", concurrency=2, queues=stack.queue)
    stack.worker("control", pool="solo", queues=stack.control_queue)
    stack.beat()


def _types(stack: Stack, agent: str, session: str, turn_id: str | None = None) -> list[str]:
    return [e["type"] for e in stack.structural(agent, session) if turn_id is None or e["turn_id"] == turn_id]


def _resume(
    stack: Stack, session: str, turn_id: str, value: Any, by: str | None, input_id: str = "approve-refund"
) -> Any:
    payload = {"agent": "ops", "session": session, "turn_id": turn_id, "input_id": input_id, "value": value, "by": by}
    return stack.send("june.resume", payload).get(timeout=30)


def _parked(stack: Stack, session: str) -> str:
    turn_id = stack.turn(
        "ops", session, "refund order 42", event={"source": "slack", "user": {"id": "U1", "attested": True}}
    )
    assert stack.wait_terminal("ops", session, turn_id)["type"] == "input.requested"
    return turn_id


def test_a_parked_turn_is_resumed_by_an_allowed_user_and_refused_for_another(stack: Stack, session_id: str) -> None:
    turn_id = _parked(stack, session_id)
    assert stack.turn_row("ops", session_id, turn_id)["status"] == "suspended"  # type: ignore[index]
    forbidden = _resume(stack, session_id, turn_id, True, by="mallory")
    assert forbidden["status"] == "forbidden" and "not authorized" in forbidden["reason"]
    assert _resume(stack, session_id, turn_id, True, by="op-ann")["status"] == "accepted"
    done = stack.wait_terminal("ops", session_id, turn_id)
    wait_for(lambda: _types(stack, "ops", session_id)[-1] == "turn.completed", what="completion")
    types = _types(stack, "ops", session_id)
    assert types.count("input.requested") == 1 and types.count("turn.started") == 2  # opening + resume
    resumed = [e for e in stack.structural("ops", session_id) if e["type"] == "turn.started"][1]
    assert resumed["trigger"] == {"kind": "resume", "call_id": "c1", "input_id": "approve-refund"}
    assert done is not None
    assert _resume(stack, session_id, turn_id, True, by="op-ann")["status"] == "conflict"  # never applied twice


def test_resume_conflicts_and_bad_answers_leave_the_turn_parked(stack: Stack, session_id: str) -> None:
    turn_id = _parked(stack, session_id)
    wrong_input = _resume(stack, session_id, turn_id, True, by="op-ann", input_id="other")
    assert wrong_input["status"] == "conflict" and "waiting for input 'approve-refund'" in wrong_input["reason"]
    assert _resume(stack, session_id, "t_nope", True, by="op-ann")["status"] == "conflict"
    invalid = _resume(stack, session_id, turn_id, "yes", by="op-ann")
    assert invalid["status"] == "invalid" and "does not satisfy the schema's 'type' rule" in invalid["reason"]
    assert stack.turn_row("ops", session_id, turn_id)["status"] == "suspended"  # type: ignore[index]


def test_a_resume_whose_authorize_hook_raises_answers_error_and_applies_nothing(stack: Stack, session_id: str) -> None:
    turn_id = _parked(stack, session_id)
    outage = _resume(stack, session_id, turn_id, True, by="op-outage")
    assert outage["status"] == "error" and outage["reason"] == "RuntimeError: operator directory unavailable"
    assert stack.turn_row("ops", session_id, turn_id)["status"] == "suspended"  # type: ignore[index]
    assert _resume(stack, session_id, turn_id, True, by="op-ann")["status"] == "accepted"  # the same answer, later
    wait_for(lambda: _types(stack, "ops", session_id)[-1] == "turn.completed", what="completion")


def test_two_resumes_racing_for_one_park_apply_once(stack: Stack, session_id: str) -> None:
    turn_id = _parked(stack, session_id)
    payload = {"agent": "ops", "session": session_id, "turn_id": turn_id, "input_id": "approve-refund", "by": "op-a"}
    a = stack.send("june.resume", {**payload, "value": True})
    b = stack.send("june.resume", {**payload, "value": False})
    outcomes = sorted([a.get(timeout=30)["status"], b.get(timeout=30)["status"]])
    assert outcomes == ["accepted", "conflict"]


def test_a_new_turn_is_rejected_while_the_session_is_parked(stack: Stack, session_id: str) -> None:
    _parked(stack, session_id)
    other = f"t_{uuid.uuid4().hex}"
    out = stack.outcome(
        stack.send("june.turn", {"turn_id": other, "agent": "ops", "session": session_id, "text": "hi"})
    )
    assert out["status"] == "rejected" and "suspended awaiting input" in out["reason"]
    assert _types(stack, "ops", session_id, other) == ["turn.failed"]


def test_an_unanswered_park_with_a_timeout_is_expired_by_the_sweeper(stack: Stack, session_id: str) -> None:
    turn_id = stack.turn("ops", session_id, "quick")
    assert stack.wait_terminal("ops", session_id, turn_id)["type"] == "input.requested"
    wait_for(lambda: _types(stack, "ops", session_id)[-1] == "turn.completed", timeout_s=20, what="expiry")
    done = [e for e in stack.structural("ops", session_id) if e["type"] == "action.completed"][-1]
    assert done["result"] == {"approved": False, "timed_out": True}


def _streaming(stack: Stack, session: str) -> None:
    wait_for(lambda: any(e["type"] == "message.delta" for e in stack.events("dribble", session)), what="streaming")


def test_cancel_stops_a_streaming_turn_at_the_next_delta(stack: Stack, session_id: str) -> None:
    turn_id = stack.turn("dribble", session_id, "long talk")
    _streaming(stack, session_id)
    out = stack.send("june.cancel", {"agent": "dribble", "session": session_id, "turn_id": turn_id}).get(timeout=30)
    assert out["status"] == "cancel-requested" and out["turn_ids"] == [turn_id]
    end = stack.wait_terminal("dribble", session_id, turn_id)
    assert (end["type"], end["reason"]) == ("turn.cancelled", "requested")
    assert "message.completed" not in _types(stack, "dribble", session_id)


def test_a_queued_turn_cancelled_before_it_starts_never_runs(stack: Stack, session_id: str) -> None:
    first = stack.turn("dribble", session_id, "long one")
    _streaming(stack, session_id)
    second = stack.turn("dribble", session_id, "two")
    wait_for(lambda: stack.turn_row("dribble", session_id, second), what="the second turn to be recorded")
    stack.send("june.cancel", {"agent": "dribble", "session": session_id, "turn_id": second}).get(timeout=30)
    stack.send("june.cancel", {"agent": "dribble", "session": session_id, "turn_id": first}).get(timeout=30)
    end = stack.wait_terminal("dribble", session_id, second)
    assert end["type"] == "turn.cancelled"
    assert _types(stack, "dribble", session_id, second) == ["turn.cancelled"]  # it never opened


def test_replace_cancels_the_running_turn_and_the_new_one_completes(stack: Stack, session_id: str) -> None:
    old = stack.turn("dribble", session_id, "long old question")
    _streaming(stack, session_id)
    new = stack.turn("dribble", session_id, "corrected question", replace=True)
    assert stack.wait_terminal("dribble", session_id, old)["reason"] == "replaced"
    wait_for(lambda: (stack.turn_row("dribble", session_id, new) or {}).get("status") == "completed", timeout_s=60)


def test_replace_never_cancels_a_parked_approval(stack: Stack, session_id: str) -> None:
    parked = _parked(stack, session_id)
    out = stack.outcome(
        stack.send(
            "june.turn",
            {"turn_id": f"t_{uuid.uuid4().hex}", "agent": "ops", "session": session_id, "text": "x", "replace": True},
        )
    )
    assert out["status"] == "rejected"
    assert stack.turn_row("ops", session_id, parked)["status"] == "suspended"  # type: ignore[index]


def test_reset_cancels_archives_and_starts_a_new_generation(stack: Stack, session_id: str) -> None:
    first = stack.turn("ops", session_id, "order 1 a")
    wait_for(lambda: (stack.turn_row("ops", session_id, first) or {}).get("status") == "completed")
    out = stack.send("june.reset", {"agent": "ops", "session": session_id}).get(timeout=60)
    assert out == {"status": "reset", "previous_session": f"{session_id}#g0", "generation": 0}
    assert stack.sql("select count(*) from june_messages where agent = 'ops' and session = %s", session_id) == [(0,)]
    archived = stack.sql(
        "select count(*), min(generation) from june_archived_messages where agent = 'ops' and session = %s", session_id
    )
    assert archived == [(4, 0)]
    again = stack.turn("ops", session_id, "hello again")
    wait_for(lambda: (stack.turn_row("ops", session_id, again) or {}).get("status") == "completed")
    second = stack.send("june.reset", {"agent": "ops", "session": session_id}).get(timeout=60)
    assert second["previous_session"] == f"{session_id}#g1"


def test_reset_of_a_parked_session_ends_the_park_and_resume_is_refused(stack: Stack, session_id: str) -> None:
    turn_id = _parked(stack, session_id)
    stack.send("june.reset", {"agent": "ops", "session": session_id}).get(timeout=60)
    assert stack.turn_row("ops", session_id, turn_id)["status"] == "cancelled"  # type: ignore[index]
    assert _types(stack, "ops", session_id, turn_id)[-1] == "turn.cancelled"
    assert _resume(stack, session_id, turn_id, True, by="op-ann")["status"] == "conflict"


def test_reset_while_a_turn_streams_cancels_it_with_reason_reset(stack: Stack, session_id: str) -> None:
    turn_id = stack.turn("dribble", session_id, "long")
    _streaming(stack, session_id)
    out = stack.send("june.reset", {"agent": "dribble", "session": session_id}).get(timeout=60)
    assert out["status"] == "pending"  # answered at once: the worker running the turn performs it
    end = stack.wait_terminal("dribble", session_id, turn_id)
    assert (end["type"], end["reason"]) == ("turn.cancelled", "reset")
    wait_for(
        lambda: (
            stack.sql("select generation, reset_pending from june_sessions where session = %s", session_id)
            == [(1, False)]
        ),
        what="the reset",
    )


def test_a_proactive_turn_opens_with_a_trigger_and_is_delivered(stack: Stack, session_id: str) -> None:
    out = stack.outcome(
        stack.send(
            "june.proactive",
            {
                "agent": "ops",
                "session": session_id,
                "text": "daily digest",
                "by": "cron:daily",
                "target": {"channel": "C-ops"},
            },
        )
    )
    assert out["status"] == "completed"
    started = stack.structural("ops", session_id)[0]
    assert started["trigger"] == {"kind": "proactive", "by": "cron:daily"}
    ((role, first),) = stack.sql(
        "select role, body::text from june_messages where agent = 'ops' and session = %s and idx = 0", session_id
    )
    assert role == "trigger" and "cron:daily" in first
    wait_for(lambda: stack.redis.lrange(f"it:delivered:{session_id}", 0, -1), what="delivery")
    assert stack.redis.lrange(f"it:delivered:{session_id}", 0, -1) == ["C-ops|ok: daily digest"]
    # delivered on the first attempt and no longer due: the sweeper will not send it again
    assert stack.sql(
        "select deliver_due, delivery_attempts from june_turns where agent = 'ops' and session = %s", session_id
    ) == [(False, 1)]


def test_a_proactive_message_delivered_twice_is_one_turn(stack: Stack, session_id: str) -> None:
    payload = {"agent": "ops", "session": session_id, "text": "digest", "by": "cron:daily"}
    task_id = str(uuid.uuid4())
    for _ in range(2):
        stack.client.send_task("june.proactive", args=[payload], task_id=task_id)
    wait_for(
        lambda: sum(p.log.read_text().count(f"[{task_id}] succeeded in ") for p in stack.procs) == 2,
        what="both copies to be handled",
    )
    assert _types(stack, "ops", session_id).count("turn.started") == 1
