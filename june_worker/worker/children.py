"""Child turns (subagents, ``ctx.delegate``) on workers: start them on any worker, answer their parents when they end.

A child turn is recorded by the parent's tool, then sent as ``june.turn`` like any turn. When it
ends, the worker that ran it answers the parent's reserved request through the control path's
resume (:func:`~june_worker.worker.control.resume` with ``child_turn``), which re-queues the parent
and sends it to a worker. A worker that dies in between leaves the parent parked on an ended
child: the sweeper (:func:`wake_parents`) finds it in Postgres and answers it. A parent that parks
after its child ended answers itself (:func:`wake_parent`, run by the worker that parked it).
"""

from __future__ import annotations

from collections.abc import Callable

from ..engine.children import (
    ENDS_CHILDREN,
    announce_child_park,
    child_answer,
    child_input_id,
    children_of_park,
    parent_cancel,
)
from ..engine.events import TurnResult
from ..engine.secrets import scrubbed_logger
from ..engine.store import ENDED_TURN_STATUSES, SessionRef, TurnRecord
from . import control
from .host import WorkerHost
from .payloads import ResumeMessage

__all__ = ["answer_parent", "turn_ended", "wake_parent", "wake_parents"]

log = scrubbed_logger("june_worker.worker")

Dispatch = Callable[[TurnRecord], None]


def answer_parent(host: WorkerHost, rec: TurnRecord, result: TurnResult, dispatch: Dispatch) -> bool:
    """Answer the parent of the ended child turn ``rec`` with its result; True if this answer was applied."""
    link = rec.payload.parent
    if link is None:
        return False
    if host.crash is not None:
        host.crash("before-parent-answer", rec.turn_id)

    def send(parent: TurnRecord) -> None:
        if host.crash is not None:
            host.crash("after-parent-answer", rec.turn_id)
        dispatch(parent)

    msg = ResumeMessage(
        agent=link.agent,
        session=link.session,
        turn_id=link.turn_id,
        input_id=child_input_id(SessionRef(rec.agent, rec.session), rec.turn_id),
        value=child_answer(rec, result),
    )
    # A child cancelled with its parent wakes the parent with that cancel, stored in the answer's own commit: the
    # parent is queued already cancelled, whatever else its park waited for, so no worker can run it on.
    out = control.resume(host, msg, send, child_turn=rec.turn_id, cancel=parent_cancel(result))
    if out["status"] != "accepted":
        # not parked on it: not yet (the parent answers itself when it parks), or no longer (reset, answered)
        log.debug("child turn %s did not answer parent %s: %s", rec.turn_id, link.turn_id, out.get("reason"))
        return False
    return True


def wake_parent(host: WorkerHost, ref: SessionRef, dispatch: Dispatch) -> int:
    """Answer each child request ``ref`` is parked on whose child turn has ended; how many were answered here."""
    parked = host.store.pending(ref)
    answered = 0
    for child_ref, child_turn in children_of_park(ref, parked) if parked is not None else []:
        rec = host.store.get_turn(child_ref, child_turn)
        if rec is not None and rec.status in ENDED_TURN_STATUSES and rec.result is not None:
            answered += answer_parent(host, rec, rec.result, dispatch)
    return answered


def turn_ended(host: WorkerHost, ref: SessionRef, rec: TurnRecord, result: TurnResult, dispatch: Dispatch) -> None:
    """What a worker does after running a turn, for the subagents it involves."""
    if result.status == "suspended":
        wake_parent(host, ref, dispatch)  # its child may have ended before it parked
        parked = host.store.pending(ref)
        if rec.payload.parent is not None and parked is not None and parked.turn_id == rec.turn_id:
            for parent_ref, events in announce_child_park(host.store, rec, parked):
                host.sink.publish(parent_ref, events)
        return
    if result.status in ENDS_CHILDREN:
        control.cancel_children_of(host, ref, [rec.turn_id])
    if rec.payload.parent is not None and result.status in ENDED_TURN_STATUSES:
        answer_parent(host, rec, result, dispatch)


def wake_parents(host: WorkerHost, dispatch: Dispatch, *, limit: int) -> int:
    """The sweeper's part: answer parents parked on a child turn that ended (its worker died before answering)."""
    woken = 0
    for ref in host.queue.parked_on_ended_children(limit=limit):
        try:
            woken += wake_parent(host, ref, dispatch)
        except Exception:
            log.exception("could not answer the parent %s of an ended child turn; the next sweep tries again", ref)
    return woken
