"""This worker process's host, assembled: the host, what sends its turns (Celery), what follows a turn's end.

The host itself (:mod:`.host`) knows neither Celery nor subagents; this module, above both, wires them:
:func:`dispatch` sends ``june.turn`` through the app, :func:`~.children.turn_ended` answers parents and
cancels children. The tasks (:mod:`.tasks`) reach the host through :func:`get_host`.

How many turns a process runs at once is the pool's: :mod:`.app` says at worker start whether the pool runs
tasks on threads of one process (``june worker --turns-per-process N``: :func:`~.app.many_turns_per_process`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..engine.agent import Agent
from ..engine.store import TurnRecord
from .app import app, many_turns_per_process
from .broker import publish_options
from .children import turn_ended
from .control import turn_message
from .host import WorkerHost
from .settings import WorkerSettings

__all__ = ["current_host", "dispatch", "get_host", "make_host"]

_HOST: WorkerHost | None = None
_HOST_PID: int | None = None
_HOST_LOCK = threading.Lock()


def dispatch(rec: TurnRecord, *, queue: str | None = None) -> None:
    """Send ``june.turn`` for a recorded turn, with a monitoring summary instead of its text: to ``queue`` if given
    (the isolation worker's), else where :func:`resend_queue` says."""
    app.send_task(
        "june.turn",
        args=[turn_message(rec)],
        queue=queue or resend_queue(rec),
        argsrepr=f"{{turn_id={rec.turn_id} agent={rec.agent} session={rec.session}}}",  # (the id first: Flower cuts)
        kwargsrepr="",
        **publish_options(get_host().settings),
    )


def resend_queue(rec: TurnRecord) -> str:
    """The queue a turn sent again goes to (by the sweeper, a resume, a woken parent, its parent for a child turn).

    The queue it was sent on (``TurnPayload.queue``), whose workers serve its agent, unless this process serves the
    agent too and does not consume that queue: then the first turn queue this process consumes, else (a worker of
    the control queue only) ``JUNE_QUEUE``. A queue's workers may all be gone (a worker's queue of its own, a queue a
    deployment dropped) while this process, and the workers of its own queue, can run the turn. The isolation
    worker sends to the kept queue (it was started for that queue's workers). A record without a queue (older than
    the field): this process's default queue."""
    kept, default = rec.payload.queue, str(app.conf.task_default_queue)
    if kept is None:
        return default
    host = get_host()
    return resend_target(
        kept,
        default=default,
        consumed=[str(name) for name in app.amqp.queues.consume_from],
        control=host.settings.control_queue,
        isolation=host.settings.isolation_queue,
        serves_agent=host.agent(rec.agent) is not None,
    )


def resend_target(
    kept: str, *, default: str, consumed: list[str], control: str, isolation: str | None, serves_agent: bool
) -> str:
    """:func:`resend_queue`'s rule, on what it reads from the process: the turn's kept queue, the queues this
    process consumes (``consumed``, the control and isolation queues among them or not), whether it serves the
    turn's agent."""
    own = [q for q in consumed if q not in (control, isolation)]
    if kept in own or not serves_agent or (not own and isolation in consumed):
        return kept
    return own[0] if own else default


def make_host(
    settings: WorkerSettings | None = None, agents: dict[str, Agent] | None = None, *, inflight: bool | None = None
) -> WorkerHost:
    """A host wired as a worker's: it sends turns through the Celery app and follows subagents' turns."""
    settings = settings if settings is not None else WorkerSettings.from_env()
    isolation = settings.isolation_queue
    return WorkerHost(
        settings,
        agents,
        inflight=many_turns_per_process() if inflight is None else inflight,
        dispatch=dispatch,
        after_turn=turn_ended,
        isolate=(lambda rec: dispatch(rec, queue=isolation)) if isolation else None,
    )


def get_host() -> WorkerHost:
    """This process's host, created on first use (and again in a forked child)."""
    global _HOST, _HOST_PID
    with _HOST_LOCK:
        if _HOST is None or _HOST_PID != os.getpid():
            _HOST = make_host()
            _HOST_PID = os.getpid()
        return _HOST


def current_host() -> Any:
    """This process's host if it was made (None otherwise): for a shutdown that must not make one."""
    return _HOST if _HOST_PID == os.getpid() else None
