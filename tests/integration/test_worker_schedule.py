"""A proactive turn started by Celery beat from the schedule in celeryconfig.py (JUNE_EXAMPLE_SCHEDULE=1)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .conftest import ROOT, Stack, wait_for

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


def test_your_own_schedule_entry_runs_through_june_beat_and_a_worker(stack: Stack, tmp_path: Path) -> None:
    """The README's way: a celeryconfig of your own that adds june_worker.schedule(...) to beat_schedule."""
    session = f"pings-{uuid.uuid4().hex[:6]}"
    (tmp_path / "my_celeryconfig.py").write_text(
        "from datetime import timedelta\n"
        "from june_worker import schedule\n"
        "from june_worker.worker.defaultconfig import *  # noqa: F403\n"
        "from june_worker.worker.defaultconfig import beat_schedule\n"
        f"beat_schedule.update(schedule('pings', agent='ops', session={session!r}, text='ping from a schedule',\n"
        "                               every=timedelta(seconds=1)))\n"
    )
    stack.worker("scheduled-own", pool="solo")
    stack.beat(env={"CELERY_CONFIG_MODULE": "my_celeryconfig", "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})

    def completed() -> list[dict[str, object]]:
        return [e for e in stack.structural("ops", session) if e["type"] == "turn.completed"]

    wait_for(lambda: len(completed()) >= 2, timeout_s=30, what="two scheduled turns to complete")
    started = [e for e in stack.structural("ops", session) if e["type"] == "turn.started"]
    assert started[0]["trigger"] == {"kind": "proactive", "by": "schedule:pings"}
    assert completed()[0]["text"] == "ok: ping from a schedule"
    # each run is a turn of its own, with a ULID turn id minted by june's beat scheduler
    ids = [str(e["turn_id"]) for e in started]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"t_[0-9A-HJKMNP-TV-Z]{26}", i) for i in ids), ids


def test_june_beat_writes_no_schedule_file_in_its_working_directory(stack: Stack, tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    log = tmp_path / "beat.log"
    args = [sys.executable, "-m", "june_worker.cli", "beat", "-l", "INFO"]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, env=stack.env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: log.read_text().count("Sending due task june-sweep") >= 2, timeout_s=30, what="two sweeps")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    assert sorted(p.name for p in cwd.iterdir()) == []
