"""A proactive turn started by Celery beat from the schedule in celeryconfig.py (JUNE_EXAMPLE_SCHEDULE=1)."""

from __future__ import annotations

import uuid

import pytest

from .conftest import Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.modes("prefork", "threads")]


def test_the_beat_schedule_starts_a_proactive_turn_whose_events_land_in_the_stream(stack: Stack) -> None:
    session = f"digest-{uuid.uuid4().hex[:6]}"
    stack.worker("scheduled", pool="solo")
    stack.beat(
        env={
            "JUNE_EXAMPLE_SCHEDULE": "1",
            "JUNE_EXAMPLE_SCHEDULE_EVERY_S": "1",
            "JUNE_EXAMPLE_AGENT": "ops",
            "JUNE_EXAMPLE_SESSION": session,
        }
    )

    def first_completed() -> list[dict[str, object]]:
        return [e for e in stack.structural("ops", session) if e["type"] == "turn.completed"]

    wait_for(first_completed, timeout_s=30, what="a scheduled turn to complete")
    events = stack.structural("ops", session)
    assert events[0]["type"] == "turn.started"
    assert events[0]["trigger"] == {"kind": "proactive", "by": "cron:daily"}
    assert first_completed()[0]["text"] == "ok: Summarize today's open threads and post the highlights."
    opening = stack.sql("select role from june_messages where agent = 'ops' and session = %s and idx = 0", session)
    assert opening == [("trigger",)]
