"""june_worker.schedule builds a beat_schedule entry for june.proactive; june's beat scheduler gives each run a
ULID turn id shown in Flower; a proactive message sent without one gets a ULID-shaped id from its task id."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import pytest

from june_worker import schedule
from june_worker.worker.beat import proactive_argsrepr
from june_worker.worker.control import proactive_turn_id
from june_worker.worker.payloads import ProactiveMessage

pytestmark = pytest.mark.unit

ULID_ID = re.compile(r"t_[0-9A-HJKMNP-TV-Z]{26}")


def test_schedule_builds_a_proactive_entry_whose_payload_a_worker_accepts() -> None:
    entry = schedule("digest", agent="ops", session="daily", text="Summarize.", every=timedelta(minutes=5))
    assert list(entry) == ["digest"]
    built = entry["digest"]
    assert (built["task"], built["schedule"]) == ("june.proactive", 300.0)
    msg = ProactiveMessage.model_validate(built["args"][0])
    assert (msg.agent, msg.session, msg.text, msg.by, msg.turn_id) == (
        "ops",
        "daily",
        "Summarize.",
        "schedule:digest",
        None,
    )
    assert "Summarize" not in built["options"]["argsrepr"]


def test_schedule_passes_a_celery_schedule_through_and_refuses_what_no_worker_would_take() -> None:
    from celery.schedules import crontab

    every = crontab(hour=7, minute=0)
    assert schedule("d", agent="ops", session="s", text="t", every=every, queue="q")["d"]["schedule"] is every
    with pytest.raises(ValueError, match="invalid agent"):
        schedule("d", agent="no spaces", session="s", text="t", every=60)
    with pytest.raises(ValueError, match="positive period"):
        schedule("d", agent="ops", session="s", text="t", every=0)
    with pytest.raises(ValueError, match="non-empty"):
        schedule("d", agent="ops", session="s", text="", every=60)


def test_a_proactive_turn_id_is_ulid_shaped_and_the_same_for_the_same_task() -> None:
    task_id = str(uuid.uuid4())
    assert ULID_ID.fullmatch(proactive_turn_id(task_id)) and proactive_turn_id(task_id) == proactive_turn_id(task_id)
    payload = {"agent": "ops", "session": "s", "turn_id": "t_01ARZ3NDEKTSV4RRFFQ69G5FAV", "by": "b", "text": "secret"}
    assert proactive_argsrepr(payload) == "{turn_id=t_01ARZ3NDEKTSV4RRFFQ69G5FAV agent=ops session=s by=b}"


def test_the_sweep_task_sends_no_task_events_and_beat_keeps_no_schedule_file() -> None:
    from june_worker.worker import defaultconfig
    from june_worker.worker.tasks import sweep_task, turn_task

    assert sweep_task.send_events is False and turn_task.send_events is True
    assert defaultconfig.beat_scheduler == "june_worker.worker.beat:Scheduler"
