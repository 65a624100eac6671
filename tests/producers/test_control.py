"""Control calls wait for the worker's answer through the result backend and parse it: resume, cancel,
reset against a real Celery worker process (``stub_worker.py``) that answers with canned summaries.
"""

from __future__ import annotations

import pytest

from producers import JuneProducer, ResetOutcome, ResumeOutcome, TaskFailed, UnexpectedResult

from .kit import WAIT_S

pytestmark = pytest.mark.integration


def test_an_accepted_resume_is_parsed_and_the_worker_got_the_answer(
    control_producer: JuneProducer, session_id: str
) -> None:
    outcome = control_producer.resume(
        "ops", session_id, "t_1", "approve", {"ok": True}, by="U9", principal={"id": "acct-1"}, timeout_s=WAIT_S
    )

    assert outcome == ResumeOutcome(status="accepted", reason=None, turn_id="t_1")
    assert outcome.accepted
    assert outcome.raw["echo"] == {
        "agent": "ops",
        "session": session_id,
        "turn_id": "t_1",
        "input_id": "approve",
        "value": {"ok": True},
        "by": "U9",
        "principal": {"id": "acct-1"},
    }


@pytest.mark.parametrize(("value", "status"), [("deny", "forbidden"), ("stale", "conflict")])
def test_a_refused_resume_carries_its_status_and_reason(
    control_producer: JuneProducer, session_id: str, value: str, status: str
) -> None:
    outcome = control_producer.resume("ops", session_id, "t_1", "approve", value, by="U0", timeout_s=WAIT_S)

    assert outcome.status == status and not outcome.accepted
    assert outcome.reason and outcome.turn_id == "t_1"


def test_a_resume_status_this_client_does_not_know_is_an_unexpected_result(
    control_producer: JuneProducer, session_id: str
) -> None:
    with pytest.raises(UnexpectedResult, match="'maybe'"):
        control_producer.resume("ops", session_id, "t_1", "approve", "bogus", by="U0", timeout_s=WAIT_S)


def test_cancel_returns_the_worker_summary(control_producer: JuneProducer, session_id: str) -> None:
    assert control_producer.cancel("ops", session_id, "t_7", timeout_s=WAIT_S) == {
        "status": "cancelled",
        "turn_ids": ["t_7"],
    }
    assert control_producer.cancel("ops", session_id, timeout_s=WAIT_S)["turn_ids"] == ["t_a", "t_b"]


def test_a_task_that_raises_on_the_worker_is_task_failed_naming_task_and_turn(
    control_producer: JuneProducer, session_id: str
) -> None:
    with pytest.raises(TaskFailed) as caught:
        control_producer.cancel("ops", session_id, "t_boom", timeout_s=WAIT_S)

    text = str(caught.value)
    assert "june.cancel" in text and "t_boom" in text and "stub failure while cancelling" in text


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("s", ResetOutcome(status="reset", previous_session="{session}#g0", generation=1)),
        ("busy", ResetOutcome(status="pending", reason="a turn is running; the reset follows it")),
        ("parked", ResetOutcome(status="rejected", reason="the session waits for input")),
    ],
)
def test_reset_outcomes_are_parsed(
    control_producer: JuneProducer, session_id: str, prefix: str, expected: ResetOutcome
) -> None:
    session = f"{prefix}-{session_id}"
    if expected.previous_session:
        expected = ResetOutcome(status="reset", previous_session=f"{session}#g0", generation=1)

    outcome = control_producer.reset("ops", session, timeout_s=WAIT_S)

    assert outcome == expected
    assert outcome.done is (expected.status == "reset")


def test_control_results_are_removed_from_the_backend_once_read(
    control_producer: JuneProducer, session_id: str
) -> None:
    def results() -> set[str]:
        return set(control_producer.redis.scan_iter(match="celery-task-meta-*", count=1000))

    before = results()
    control_producer.cancel("ops", session_id, "t_7", timeout_s=WAIT_S)
    with pytest.raises(TaskFailed):
        control_producer.cancel("ops", session_id, "t_boom", timeout_s=WAIT_S)

    assert results() <= before
