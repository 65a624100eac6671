"""What each task does, on a :class:`~june_worker.worker.host.WorkerHost`: intake, resume, cancel, reset, proactive.

Every function returns a small JSON summary (it becomes the Celery task result): the turn
id and a status, plus a reason when something was refused. Nothing here raises for bad
input: a refusal is a result, recorded where the turn id is known, never a retry loop.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from june_wire.ids import CROCKFORD

from ..engine.agent import Agent
from ..engine.children import cancel_children, cancel_parked, child_grant, refuse_reserved
from ..engine.events import TurnResult
from ..engine.loop import reject_turn
from ..engine.resume import (
    RESUME_RACES,
    Grant,
    check_parked,
    grant_answer,
    race_tries,
    race_wait_s,
    resume_commit,
    still_open,
)
from ..engine.secrets import scrub, scrubbed_logger
from ..engine.session import parked_reason
from ..engine.store import UNFINISHED_TURN_STATUSES, SessionRef, TurnPayload, TurnRecord
from ..errors import InvalidAnswerError, ResumeAuthorizationError, ResumeConflictError
from ..observe.logs import transition
from ..observe.metrics import metrics
from . import rendering
from .host import WorkerHost
from .payloads import CancelMessage, ProactiveMessage, ResetMessage, ResumeMessage, TurnMessage

__all__ = [
    "Dispatch",
    "cancel_children_of",
    "cancel",
    "intake",
    "proactive",
    "proactive_turn_id",
    "reset",
    "resume",
    "summary",
    "turn_message",
]

log = scrubbed_logger("june_worker.worker")

Dispatch = Callable[[TurnRecord], None]
"""Sends ``june.turn`` for a recorded turn (the tasks module provides it; the host knows no Celery)."""


def summary(ref: SessionRef, turn_id: str, result: TurnResult | None, status: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"turn_id": turn_id, "agent": ref.agent, "session": ref.session}
    if result is None:
        out["status"] = status or "queued"
        return out
    out["status"] = result.status
    if result.status == "rejected":
        out["reason"] = result.reason
    elif result.status == "failed":
        out["reason"] = result.error.message
    elif result.status == "cancelled":
        out["reason"] = result.reason
    elif result.status == "suspended":
        out["input_id"] = result.request.id
    return out


def turn_message(rec: TurnRecord) -> dict[str, Any]:
    """The ``june.turn`` payload that re-delivers a recorded turn."""
    p = rec.payload
    return {
        "turn_id": rec.turn_id,
        "agent": rec.agent,
        "session": rec.session,
        "text": p.text,
        "event": p.event.model_dump(mode="json") if p.event else None,
        "trigger": {"kind": "proactive", "by": p.trigger_by} if p.trigger_by else None,
        "replace": False,
        **({"target": p.target} if p.target else {}),
        **({"sent_at": p.sent_at} if p.sent_at else {}),  # a re-send is no new enqueue: the wait counts from the first
    }


def _reject(host: WorkerHost, ref: SessionRef, turn_id: str, payload: TurnPayload, reason: str) -> dict[str, Any]:
    result = reject_turn(host.store, host.sink, ref, turn_id, reason, payload=payload, new_only=True)
    log.warning("rejected turn %s of %s: %s", turn_id, ref, reason)
    agent = host.agent(ref.agent)
    if payload.target is not None and agent is not None and result is not None:
        rendering.notify(agent, payload.target, f"Not started: {reason}")  # a channel's speaker hears why
    if result is not None and result.status == "rejected":
        host.observer.rejected(ref, turn_id)
    return summary(ref, turn_id, result)


def intake(
    host: WorkerHost,
    msg: TurnMessage | ProactiveMessage,
    *,
    turn_id: str | None = None,
    trace: dict[str, str] | None = None,
    queue: str | None = None,
) -> dict[str, Any]:
    """Record the turn (idempotent by turn id), then run the session if nobody else is.

    ``trace``: the sender's trace context from the message's headers, kept with the turn (``TurnPayload.trace``);
    ``queue``: the queue the message came from, kept with the turn (``TurnPayload.queue``) unless it was recorded
    before (a durable producer's record keeps the queue it chose).
    """
    ref = SessionRef(msg.agent, msg.session)
    if isinstance(msg, TurnMessage):
        turn_id = msg.turn_id
        payload = TurnPayload(
            text=msg.text,
            event=msg.event,
            trigger_by=msg.trigger_by(),
            replace=msg.replace,
            target=msg.target,
            trace=trace,
            sent_at=msg.sent_at,
            queue=queue,
        )
        replace = msg.replace
    else:
        assert turn_id is not None
        payload = TurnPayload(text=msg.text, trigger_by=msg.by, target=msg.target, trace=trace, queue=queue)
        replace = False
    agent = host.agent(ref.agent)
    if agent is not None and not replace and (payload.target is None or agent.deliver is not None):
        # The common case: record the turn and take the session's lease in one statement.
        got, ran = host.intake(ref, turn_id, payload)
        if not got.recorded and got.existing is None and got.parked is not None and host.expire_park(ref, got.parked):
            # The park it found had expired (no sweeper came by yet): it goes on without an answer, and this
            # turn queues behind it.
            got, ran = host.intake(ref, turn_id, payload)
        if got.recorded or (got.existing is not None and got.existing.status in UNFINISHED_TURN_STATUSES):
            # A turn to run: ours if the lease was free (it ran), else its holder's (nothing to do here).
            return _after_drain(host, ref, turn_id, ran)
        existing, parked = got.existing, got.parked  # a finished turn, a park, or a copy recorded concurrently
    else:
        existing, parked = host.queue.intake_view(ref, turn_id)  # get_turn and pending, in one round trip
        if existing is None and parked is not None and parked.turn_id != turn_id and host.expire_park(ref, parked):
            # it expired: it goes on without an answer and this turn queues behind it (unless the park had
            # requests that expire later: then it is still parked)
            parked = host.store.pending(ref)
    if existing is None:
        if agent is None:
            return _reject(
                host, ref, turn_id, payload, f"unknown agent {ref.agent!r}; this worker serves {sorted(host.agents)}"
            )
        if payload.target is not None and agent.deliver is None:
            return _reject(
                host, ref, turn_id, payload, f"agent {agent.name} has no deliver hook, so a target cannot be rendered"
            )
        if parked is not None and parked.turn_id != turn_id:
            return _reject(host, ref, turn_id, payload, parked_reason(ref, parked))
        if replace:  # never this turn itself: a copy of its message (Slack's mention twin) may have recorded it
            others = [t.turn_id for t in host.store.unfinished_turns(ref) if t.turn_id != turn_id]
            cancelled = host.store.request_cancel(ref, "replaced", turn_ids=others) if others else []
            if cancelled:
                host.signal_cancel(ref, cancelled, "replaced")
        host.store.enqueue_turn(ref, turn_id, payload)
    elif existing.status not in UNFINISHED_TURN_STATUSES and existing.result is not None:
        if existing.payload.target is not None and agent is not None:
            host.deliver(ref, existing, agent, existing.result)  # if its delivery is still due (a crash, a failure)
        return summary(ref, turn_id, existing.result)
    return _after_drain(host, ref, turn_id, host.drain(ref))


def _after_drain(host: WorkerHost, ref: SessionRef, turn_id: str, ran: dict[str, TurnResult]) -> dict[str, Any]:
    """The summary of ``turn_id``: its result if it ran here or has ended, else its status."""
    if turn_id in ran:
        return summary(ref, turn_id, ran[turn_id])
    rec = host.store.get_turn(ref, turn_id)
    if rec is not None and rec.result is not None and rec.status not in UNFINISHED_TURN_STATUSES:
        return summary(ref, turn_id, rec.result)
    return summary(ref, turn_id, None, rec.status if rec else "queued")


def proactive_turn_id(task_id: str) -> str:
    """A proactive message without a turn id gets one from its Celery task id: a redelivery is the same turn.

    June's beat scheduler mints a ULID for every proactive turn it sends (worker/beat.py); this is for one sent
    without, by hand: the task id's 128 bits (a UUID) written as a ULID is, ``t_`` and 26 Crockford characters
    (a task id that is no UUID: its hex digits, as before)."""
    try:
        value = uuid.UUID(task_id).int
    except ValueError:
        return f"t_{task_id.replace('-', '')}"
    return "t_" + "".join(CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))


def proactive(
    host: WorkerHost,
    msg: ProactiveMessage,
    task_id: str,
    *,
    trace: dict[str, str] | None = None,
    queue: str | None = None,
) -> dict[str, Any]:
    return intake(host, msg, turn_id=msg.turn_id or proactive_turn_id(task_id), trace=trace, queue=queue)


def resume(
    host: WorkerHost,
    msg: ResumeMessage,
    dispatch: Dispatch,
    *,
    child_turn: str | None = None,
    cancel: str | None = None,
) -> dict[str, Any]:
    """Apply an answer to a parked turn and re-send the turn; the outcome says accepted or why not.

    ``child_turn``: for the system only (:mod:`~june_worker.worker.children`), never from a message: the child
    turn whose end answers its parent's reserved ``child:...`` request, which refuses every other answer.
    ``cancel``, also the system's: the parked turn's cancel the answer carries. Any answer carries a cancel stored
    with the park (:func:`cancel`): the turn is queued, whatever else it waits for, and ends ``cancelled``.
    """
    ref = SessionRef(msg.agent, msg.session)
    out: dict[str, Any] = {"turn_id": msg.turn_id, "input_id": msg.input_id}
    agent = host.agent(ref.agent)
    if agent is None:
        return {**out, "status": "rejected", "reason": f"unknown agent {ref.agent!r}"}
    waited: float | None = None  # how long the park had waited when the answer applied (june_input_wait_seconds)
    try:
        refuse_reserved(msg.input_id, child_turn)
        stored = host.store.get_turn(ref, msg.turn_id)
        cancel = (stored.cancel_reason if stored is not None else None) or cancel
        attempt, tries = 0, RESUME_RACES
        while True:
            attempt += 1
            pending = host.store.pending(ref)
            if pending is not None and host.expire_park(ref, pending):
                rec = host.store.get_turn(ref, pending.turn_id)
                if rec is not None and rec.status == "queued":
                    dispatch(rec)
                pending = still_open(host.store.pending(ref), pending, msg.turn_id, msg.input_id)
            parked = check_parked(pending, msg.turn_id, msg.input_id, reset_pending=host.queue.reset_pending(ref))
            tries = max(tries, race_tries(parked))
            granted: Grant | None
            if child_turn is not None:
                granted = child_grant(child_turn)
            else:
                granted = host.run_async(
                    grant_answer(agent, parked, session=ref.session, by=msg.by, principal=msg.principal)
                )
            commit = resume_commit(parked, msg.value, by=msg.by, granted=granted, cancel=cancel)
            waited = host.park_age(ref)
            try:
                events = host.store.commit(ref, commit)
                break
            except ResumeConflictError:
                if attempt >= tries:
                    raise
            # another request of the park was answered meanwhile: read it again (ours may still be open)
            time.sleep(race_wait_s(attempt))
    # A reason is published (the result backend, the gateway, the answerer's channel): scrubbed, as an error report.
    except ResumeAuthorizationError as exc:
        return _refused(agent, msg, {**out, "status": "forbidden", "reason": scrub(str(exc))})
    except InvalidAnswerError as exc:
        return _refused(agent, msg, {**out, "status": "invalid", "reason": scrub(str(exc))})
    except ResumeConflictError as exc:
        return _refused(agent, msg, {**out, "status": "conflict", "reason": scrub(str(exc))})
    except Exception as exc:  # the authorize_answer hook (or the store) failed: nothing applied, retry later
        log.exception("resume of %s %s failed before the answer was applied", ref, msg.turn_id)
        return {**out, "status": "error", "reason": scrub(f"{type(exc).__name__}: {exc}")}
    if waited is not None:
        metrics().input_waited(ref.agent, "answered", waited)
    host.sink.publish(ref, events)
    left = [i.request.id for i in commit.suspended.inputs()] if commit.suspended is not None else []
    if left:  # other requests of the park are still open: the turn waits for them
        return {**out, "status": "accepted", "open": left}
    transition("turn.resumed", turn_id=msg.turn_id, agent=ref.agent, session=ref.session, step=None, attempt=None)
    rec = host.store.get_turn(ref, msg.turn_id)
    if rec is not None:
        dispatch(rec)  # a lost message is found by the sweeper: the turn is queued in Postgres
    return {**out, "status": "accepted"}


def _refused(agent: Agent, msg: ResumeMessage, out: dict[str, Any]) -> dict[str, Any]:
    """A refused answer, told to the answerer where they answered (``reply_to``), and to them only."""
    if msg.reply_to is not None:
        rendering.notify(agent, msg.reply_to, f"Your answer was not applied: {out['reason']}")
    return out


def cancel_children_of(host: WorkerHost, ref: SessionRef, turn_ids: list[str]) -> list[str]:
    """Cancel the unfinished child turns (``ctx.delegate``) of these turns, all the way down, and signal them;
    the child turn ids marked."""
    marked: list[str] = []
    for child_ref, ids in cancel_children(host.store, ref, turn_ids, host.agents):
        host.signal_cancel(child_ref, ids, "parent")
        marked.extend(ids)
    return marked


def cancel(host: WorkerHost, msg: CancelMessage) -> dict[str, Any]:
    ref = SessionRef(msg.agent, msg.session)
    ids = host.store.request_cancel(ref, "requested", turn_ids=[msg.turn_id] if msg.turn_id else None)
    if ids:
        host.signal_cancel(ref, ids, "requested")
    children = cancel_children_of(host, ref, ids) if ids else []
    parked = host.store.pending(ref)
    if parked is not None and (msg.turn_id is None or parked.turn_id == msg.turn_id):
        # parked on a running child: its cancel is stored with the park, the child is cancelled, and the child's
        # answer wakes it to end cancelled
        for child_ref, marked in cancel_parked(host.store, ref, parked.turn_id, "requested", host.agents):
            host.signal_cancel(child_ref, marked, "parent")
            children.extend(marked)
    out: dict[str, Any] = {
        "status": "cancel-requested" if ids or children else "nothing-to-cancel",
        "turn_ids": ids,
        "turn_id": msg.turn_id,
    }
    if children:
        out["child_turn_ids"] = children  # a child parked on a person is not among them: answer or reset it
    return out


def reset(host: WorkerHost, msg: ResetMessage, dispatch: Dispatch) -> dict[str, Any]:
    """Make the reset pending and cancel unfinished turns (reason reset); perform it now if the session is free.

    Answers at once: ``reset`` (performed, with the archived address) or ``pending`` (the session is busy:
    its holder performs the reset when the running turn ends, or the sweeper if the holder dies). A
    pending reset is durable work in Postgres; no control process waits for it.
    """
    ref = SessionRef(msg.agent, msg.session)
    ids = host.queue.request_reset(ref)
    if ids:
        host.signal_cancel(ref, ids, "reset")
    parked = host.store.pending(ref)
    parents = ids + ([parked.turn_id] if parked is not None else [])
    if parents:
        cancel_children_of(host, ref, parents)  # the reset cancels their children too
    held, result = host.reset_now(ref, dispatch)
    if not held:
        return {"status": "pending", "reason": "the session is busy; the reset happens when its running turn ends"}
    if result is None:
        return {"status": "reset", "reason": "performed meanwhile by the process that held the session"}
    return {"status": "reset", "previous_session": result.previous_session, "generation": result.generation}
