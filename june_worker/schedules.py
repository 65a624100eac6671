"""Turns started by a schedule: :func:`schedule` builds the ``beat_schedule`` entry of a ``june.proactive`` turn.

Add it to your celeryconfig.py (a copy of the repository's), and ``june beat`` starts the turn at each
period; each one gets its own turn id (a ULID, minted by june's beat scheduler, :mod:`june_worker.worker.beat`)::

    from datetime import timedelta
    from celery.schedules import crontab
    from june_worker import schedule
    from june_worker.worker.defaultconfig import *  # noqa: F403
    from june_worker.worker.defaultconfig import beat_schedule

    beat_schedule.update(schedule("digest", agent="ops", session="daily-digest",
                                  text="Summarize today's open threads.", every=crontab(hour=7, minute=0)))
    beat_schedule.update(schedule("tick", agent="ops", session="ticks", text="Anything new?",
                                  every=timedelta(minutes=5)))

This module imports nothing of Celery: ``every`` is a :class:`~datetime.timedelta`, a number of seconds, or a
Celery schedule (``crontab(...)``, ``solar(...)``) you made.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from june_wire.ids import AGENT_NAME, SESSION_ID

__all__ = ["schedule"]


def schedule(
    name: str,
    *,
    agent: str,
    session: str,
    text: str,
    every: timedelta | float | Any,
    by: str | None = None,
    target: dict[str, Any] | None = None,
    queue: str | None = None,
) -> dict[str, dict[str, Any]]:
    """``{name: entry}``, the ``beat_schedule`` entry that starts a proactive turn of ``agent`` in ``session``
    with ``text`` at each period of ``every``.

    ``by``: who the turn says started it (``trigger.by``; default ``schedule:<name>``); ``target``: where the
    agent's deliver hook sends the answer (e.g. ``{"channel": "slack", "channel_id": "C024BE91L"}``); ``queue``:
    the turn queue (default: the workers' ``JUNE_QUEUE``, Celery's default queue). Raises ValueError naming what
    is wrong."""
    AGENT_NAME.check(agent, "agent")
    SESSION_ID.check(session, "session")
    if not isinstance(text, str) or not text:
        raise ValueError("schedule text must be a non-empty string")
    if isinstance(every, timedelta):
        every = every.total_seconds()
    if isinstance(every, (int, float)) and not every > 0:
        raise ValueError(f"schedule every={every!r}: expected a positive period")
    payload: dict[str, Any] = {"agent": agent, "session": session, "text": text, "by": by or f"schedule:{name}"}
    if target is not None:
        payload["target"] = target
    options: dict[str, Any] = {"argsrepr": f"{{agent={agent} session={session} by={payload['by']}}}"}
    if queue is not None:
        options["queue"] = queue
    return {name: {"task": "june.proactive", "schedule": every, "args": [payload], "options": options}}
