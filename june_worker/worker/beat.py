"""``june beat``'s scheduler: in memory (no ``celerybeat-schedule.*`` files), and every proactive turn with its own id.

Celery's default scheduler keeps its schedule in a shelve file in the working directory; june's schedule is
all in ``beat_schedule`` (celeryconfig.py), so a restarted beat starts each entry's period afresh, and nothing
is written. Each time it sends ``june.proactive`` for an entry without a ``turn_id``, it mints one (a ULID, as
every other turn id: :func:`june_wire.ids.new_turn_id`) and shows it, with the agent and session, as the
task's arguments in Flower (``argsrepr``: never the text). The sweeper's ``june.sweep`` is sent without a
``task-sent`` event (and its task sends none either: ``send_events=False``), so it does not fill Flower's list.
"""

from __future__ import annotations

from typing import Any

from celery.beat import ScheduleEntry
from celery.beat import Scheduler as _CeleryScheduler

from june_wire.ids import new_turn_id

__all__ = ["Scheduler", "proactive_argsrepr"]

_QUIET_TASKS = frozenset({"june.sweep"})


def proactive_argsrepr(payload: dict[str, Any]) -> str:
    """What Flower shows of a ``june.proactive`` message: its address and who started it, never its text."""
    fields = ("turn_id", "agent", "session", "by")  # the id first: Flower cuts a long arguments cell at its end
    return "{" + " ".join(f"{k}={payload[k]}" for k in fields if isinstance(payload.get(k), str)) + "}"


class Scheduler(_CeleryScheduler):  # type: ignore[misc]
    """Celery's in-memory scheduler, with a fresh turn id for each proactive turn it sends."""

    def apply_async(self, entry: ScheduleEntry, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        entry = self.reserve(entry) if advance else entry  # (the schedule keeps the entry as written, not our copy)
        if entry.task == "june.proactive" and entry.args and isinstance(entry.args[0], dict):
            payload = dict(entry.args[0])
            payload.setdefault("turn_id", new_turn_id())
            options = {**entry.options, "argsrepr": proactive_argsrepr(payload), "kwargsrepr": ""}
            entry = _with(entry, args=[payload, *entry.args[1:]], options=options)
        if entry.task in _QUIET_TASKS:
            conf = self.app.conf
            before = conf.task_send_sent_event
            conf.task_send_sent_event = False  # (beat sends from one thread: nothing else publishes meanwhile)
            try:
                return super().apply_async(entry, producer=producer, advance=False, **kwargs)
            finally:
                conf.task_send_sent_event = before
        return super().apply_async(entry, producer=producer, advance=False, **kwargs)


def _with(entry: ScheduleEntry, **changes: Any) -> ScheduleEntry:
    """A copy of ``entry`` with ``changes``, to send once (the schedule keeps the entry as it is)."""
    copy = ScheduleEntry(
        name=entry.name, task=entry.task, last_run_at=entry.last_run_at, total_run_count=entry.total_run_count,
        schedule=entry.schedule, args=entry.args, kwargs=entry.kwargs, options=entry.options,
        relative=False, app=entry.app,
    )  # fmt: skip
    for key, value in changes.items():
        setattr(copy, key, value)
    return copy
