"""A producer's reset, then a turn, on real workers whose turn queue is served before the control queue (S90).

``june.reset`` goes to the control queue and ``june.turn`` to the turn queue, so a worker may take them in
either order. The producer's ``reset`` returns only once a control worker recorded the reset, so a turn sent
after it runs on the new generation; a reset no control worker answered in time is withdrawn (it expires),
so it never happens later, behind turns sent since. Only a turn worker runs for this module; each test starts
its control worker late, or not before the reset gave up.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from producers import JuneProducer, ResetOutcome, ResultTimeout

from .conftest import Stack, wait_for

pytestmark = pytest.mark.integration

ATTESTED = {"source": "slack", "user": {"id": "U1", "attested": True}}


@pytest.fixture(scope="module", autouse=True)
def turn_worker(stack: Stack) -> None:
    stack.worker("turns-only", pool="prefork", concurrency=1, queues=stack.queue)


@pytest.fixture
def producer(stack: Stack) -> Iterator[JuneProducer]:
    p = stack.producer()
    yield p
    p.close()


def _parked(stack: Stack, session: str) -> str:
    """A turn of ``session`` that parked for approval."""
    turn_id = stack.turn("ops", session, "refund", event=ATTESTED)
    assert stack.wait_terminal("ops", session, turn_id)["type"] == "input.requested"
    return turn_id


def _generation(stack: Stack, session: str) -> list[tuple[Any, ...]]:
    return stack.sql("select generation, suspended is not null from june_sessions where session = %s", session)


def test_a_turn_sent_after_a_producers_reset_runs_on_the_new_generation_though_the_control_worker_started_late(
    stack: Stack, producer: JuneProducer, session_id: str
) -> None:
    # Given a parked session, and no worker on the control queue yet
    parked = _parked(stack, session_id)
    answer: dict[str, ResetOutcome] = {}
    resetting = threading.Thread(target=lambda: answer.update(out=producer.reset("ops", session_id, timeout_s=60)))
    resetting.start()
    control = None
    try:
        wait_for(lambda: stack.redis.llen(stack.control_queue) == 1, what="june.reset to wait in the control queue")
        control = stack.worker("late-control", pool="solo", queues=stack.control_queue)
        # When the producer's reset returns (once the late control worker recorded it), and a turn is sent after it
        resetting.join(60)
        assert answer["out"].status == "reset", answer
        after = producer.start_turn("ops", session_id, "hello")
        # Then that turn runs on the new generation; the parked one ended, cancelled by the reset
        assert stack.wait_terminal("ops", session_id, after)["type"] == "turn.completed"
        assert _generation(stack, session_id) == [(1, False)]
        assert (stack.turn_row("ops", session_id, parked) or {}).get("status") == "cancelled"
    finally:
        resetting.join(60)
        if control is not None:
            control.stop()


def test_a_reset_no_control_worker_answered_in_time_is_withdrawn_and_never_happens_later(
    stack: Stack, producer: JuneProducer, session_id: str
) -> None:
    # Given a parked session, and no worker on the control queue
    parked = _parked(stack, session_id)
    # When the producer's reset gives up waiting, and a control worker starts afterwards
    with pytest.raises(ResultTimeout) as raised:
        producer.reset("ops", session_id, timeout_s=2)
    control = stack.worker("later-control", pool="solo", queues=stack.control_queue)
    try:
        # Then that worker discards the expired reset instead of performing it behind whatever was sent since
        result = stack.client.AsyncResult(raised.value.task_id)
        wait_for(lambda: result.state in ("REVOKED", "SUCCESS"), what="the worker to take the reset")
        assert result.state == "REVOKED"
        result.forget()
        assert _generation(stack, session_id) == [(0, True)]
        assert (stack.turn_row("ops", session_id, parked) or {}).get("status") == "suspended"
        # and the error had said so
        assert raised.value.withdrawn and "withdrawn" in str(raised.value)
    finally:
        control.stop()
