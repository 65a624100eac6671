"""The Celery tasks: thin shells. Validate the one JSON object, call the host, return a small summary.

A payload that cannot be used is rejected once: the reason is in the log and, when the message
names a turn, in the turn's row and stream (``turn.failed``); control tasks also return it as
their result. Turn, proactive and sweep tasks store no result (``ignore_result``): nobody reads
them, the turn's row and stream say everything, and storage stays bounded.
Nothing is retried for bad input; only the database being unavailable (the failure policy's
transient class) is retried, with backoff.
"""

from __future__ import annotations

import math
import time
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Reject

from june_wire.ids import SENT_AT_HEADER
from june_wire.storable import storable_text

from ..engine.loop import reject_turn
from ..engine.secrets import scrubbed_logger
from ..engine.store import SessionRef, TurnPayload
from ..errors import PayloadError, StoreUnavailableError
from ..observe import tracing
from ..observe.metrics import metrics
from . import control
from .app import app, kill_worker
from .host import WorkerHost
from .payloads import (
    CancelMessage,
    ProactiveMessage,
    ResetMessage,
    ResumeMessage,
    SweepMessage,
    TurnMessage,
    parse_payload,
)
from .process import dispatch
from .process import get_host as _get_host
from .sweeper import sweep

__all__ = ["PARKED", "cancel_task", "proactive_task", "reset_task", "resume_task", "sweep_task", "turn_task"]

log = scrubbed_logger("june_worker.worker")

_RETRY = {
    "autoretry_for": (StoreUnavailableError,),
    "retry_backoff": True,
    "retry_backoff_max": 30,
    "max_retries": 8,
}
_BROKEN_HOST_WAIT_S = 1.0
"""How long a task of a process that cannot make its host waits before handing its message back."""


def get_host() -> WorkerHost:
    """This process's host. One that cannot be made (and not for a database that is down: the task retries then)
    hands the message back to the broker, for a worker that can serve it, instead of acknowledging it unserved."""
    try:
        return _get_host()
    except StoreUnavailableError:
        raise
    except Exception as exc:
        log.error("this worker process cannot serve turns (%s: %s); the message goes back to the queue",
                  type(exc).__name__, exc)  # fmt: skip
        time.sleep(_BROKEN_HOST_WAIT_S)  # (not a busy loop of one broken worker and the queue)
        raise Reject(f"{type(exc).__name__}: {exc}", requeue=True) from exc


PARKED = "PARKED"
"""The state Flower shows for a ``june.turn`` / ``june.proactive`` task whose turn parked (waits for an answer):
not SUCCESS. The task sends a ``task-parked`` event (Flower shows a custom event's type as the state) and ends
with Celery's :class:`~celery.exceptions.Ignore`: its message is acknowledged as after any run (``acks_late``), no
``task-succeeded`` event follows to paint it green, and (``ignore_result``) no result is stored either way."""


def _parked_or(task: Task, out: dict[str, Any]) -> dict[str, Any]:
    """``out``, the summary of a turn task; for a turn that parked, the PARKED state in Flower instead."""
    if out.get("status") != "suspended":
        return out
    if task.app.conf.worker_send_task_events:
        try:
            fields = {k: out[k] for k in ("turn_id", "agent", "session", "input_id") if k in out}
            task.send_event("task-parked", result=repr(out), **fields)
        except Exception:  # monitoring only: the turn is parked all the same
            log.warning("could not send the task-parked event of turn %s", out.get("turn_id"), exc_info=True)
    log.info("turn %s parked: %s", out.get("turn_id"), out)
    raise Ignore()


def _rejected(task: str, args: tuple[Any, ...], exc: PayloadError, task_id: str | None = None) -> dict[str, Any]:
    """Record what we can of an unusable message; a turn id we can read gets a rejected row and event."""
    reason = str(exc)
    log.warning("rejected %s message: %s", task, reason)
    metrics().message_rejected(task)
    out: dict[str, Any] = {"status": "rejected", "reason": reason}
    raw = args[0] if len(args) == 1 and isinstance(args[0], dict) else None
    if raw is None:
        return out
    turn_id, agent, session = raw.get("turn_id"), raw.get("agent"), raw.get("session")
    if task == "june.proactive" and turn_id is None and task_id:
        turn_id = control.proactive_turn_id(task_id)
    # echoed only when printable: the summary is logged as it is (no line breaks or escapes of ours in a log)
    out["turn_id"] = turn_id if not isinstance(turn_id, str) or turn_id.isprintable() else repr(turn_id)[:300]
    if task not in ("june.turn", "june.proactive"):
        return out
    if not all(isinstance(v, str) and 0 < len(v) <= 256 for v in (turn_id, agent, session)):
        return out  # nothing we could address a turn by
    assert isinstance(turn_id, str) and isinstance(agent, str) and isinstance(session, str)
    if any(storable_text(v) != v for v in (turn_id, agent, session)):
        return out  # an address the store cannot hold: nothing to record it under
    ref = SessionRef(agent, session)
    host = get_host()
    text = raw.get("text")
    payload = TurnPayload(text=storable_text(text[:1000]) if isinstance(text, str) else "")
    try:
        # one write: recorded as rejected, never queued; a copy of a turn recorded already leaves it alone,
        # unless that record is no more usable than this message (a durable producer's: see the store's reject_turn)
        reject_turn(host.store, host.sink, ref, turn_id, reason, payload=payload, new_only=True)
    except StoreUnavailableError:
        raise  # the task is retried: the rejection must reach the turn's row and stream
    except Exception:
        log.exception("could not record the rejection of turn %s", turn_id)
    return out


@app.task(name="june.turn", bind=True, ignore_result=True, **_RETRY)
def turn_task(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        msg = parse_payload(TurnMessage, args, kwargs)
        msg.trigger_by()
    except PayloadError as exc:
        return _rejected("june.turn", args, exc)
    if msg.sent_at is None and (stamp := sent_at_of(self.request)) is not None:
        msg = msg.model_copy(update={"sent_at": stamp})
    host = get_host()
    if host.crash is not None and host.crash.fires("before-intake", msg.turn_id):
        kill_worker()  # tests only: the message is taken, the turn not recorded
    out = control.intake(host, msg, trace=tracing.from_request(self.request), queue=turn_queue(host, self.request))
    return _parked_or(self, out)


def delivered_on(request: Any) -> str | None:
    """The queue this task's message came from, as its delivery info says; None if it does not say.

    Celery sends a message for a named queue to the default (nameless) exchange with the queue's name as its
    routing key (june's workers and producers always do; so does Celery's own retry); a message sent to a named
    exchange came from the queue of this worker's that is bound to that exchange under its routing key."""
    info = getattr(request, "delivery_info", None) or {}
    exchange, routing_key = info.get("exchange"), info.get("routing_key")
    if not isinstance(routing_key, str) or not routing_key or storable_text(routing_key) != routing_key:
        return None
    if not exchange:
        return routing_key
    for queue in app.amqp.queues.consume_from.values():
        if queue.routing_key == routing_key and queue.exchange is not None and queue.exchange.name == exchange:
            return str(queue.name)
    return None


def turn_queue(host: WorkerHost, request: Any) -> str | None:
    """The queue to keep with a turn this message records (``TurnPayload.queue``): the one it came from, unless that
    is the isolation worker's (a turn only goes there once recorded, with its own queue kept)."""
    queue = delivered_on(request)
    return None if queue is None or queue == host.settings.isolation_queue else queue


def sent_at_of(request: Any) -> float | None:
    """When the producer sent this ``june.turn`` (its ``june_sent_at`` header); None without one or for one that is
    not a positive finite number of seconds (a stamp only measures: a bad one is dropped, the turn still runs)."""
    text = tracing.message_header(request, SENT_AT_HEADER)
    try:
        value = float(text) if isinstance(text, str) and len(text) <= 64 else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) and value > 0 else None


@app.task(name="june.proactive", bind=True, ignore_result=True, **_RETRY)
def proactive_task(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        msg = parse_payload(ProactiveMessage, args, kwargs)
    except PayloadError as exc:
        return _rejected("june.proactive", args, exc, str(self.request.id))
    host = get_host()
    trace, queue = tracing.from_request(self.request), turn_queue(host, self.request)
    return _parked_or(self, control.proactive(host, msg, str(self.request.id), trace=trace, queue=queue))


@app.task(name="june.resume", bind=True, **_RETRY)
def resume_task(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        msg = parse_payload(ResumeMessage, args, kwargs)
    except PayloadError as exc:
        return _rejected("june.resume", args, exc)
    return control.resume(get_host(), msg, dispatch)


@app.task(name="june.cancel", bind=True, **_RETRY)
def cancel_task(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        msg = parse_payload(CancelMessage, args, kwargs)
    except PayloadError as exc:
        return _rejected("june.cancel", args, exc)
    return control.cancel(get_host(), msg)


@app.task(name="june.reset", bind=True, **_RETRY)
def reset_task(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        msg = parse_payload(ResetMessage, args, kwargs)
    except PayloadError as exc:
        return _rejected("june.reset", args, exc)
    return control.reset(get_host(), msg, dispatch)


# no task events: it runs every JUNE_SWEEP_S and would push every turn off Flower's first page (june's beat
# scheduler sends it without a task-sent event either: worker/beat.py)
@app.task(name="june.sweep", bind=True, ignore_result=True, send_events=False, **_RETRY)
def sweep_task(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        msg = parse_payload(SweepMessage, args or ({},), kwargs)
    except PayloadError as exc:
        return _rejected("june.sweep", args, exc)
    summary = sweep(get_host(), dispatch, limit=msg.limit)
    metrics().sweep(summary)
    return summary
