"""Ending a turn without a runner: the error report of a failure, and the rejection of a turn that never opened."""

from __future__ import annotations

import traceback

from june_wire.storable import safe_str, storable_text, unstorable_reason

from .events import Rejected, TurnFailed, TurnResult
from .secrets import scrub
from .sink import EventSink
from .store import SessionRef, SessionStore, TurnPayload
from .types import ErrorInfo

__all__ = ["CAUSE_CHAIN_MAX", "STACK_MAX_CHARS", "error_info", "reject_turn", "rejection_event"]

STACK_MAX_CHARS = 8000
CAUSE_CHAIN_MAX = 8
MESSAGE_MAX_CHARS = 4000


def error_info(exc: BaseException) -> ErrorInfo:
    """Message, class, cause chain (``__cause__``, else ``__context__``; at most :data:`CAUSE_CHAIN_MAX`
    entries) and a stack without locals, every string made storable (an exception whose ``__str__``
    raises is reported by its class name).

    Stored and published, so no secret may reach any of it: each string is scrubbed whole, *then* cut
    to its bound. A cut first could split a secret, leaving a piece the scrubber cannot recognise."""
    chain: list[str] = []
    seen = {id(exc)}
    cur = exc.__cause__ or exc.__context__
    while cur is not None and id(cur) not in seen and len(chain) < CAUSE_CHAIN_MAX:
        seen.add(id(cur))
        chain.append(scrub(safe_str(cur))[:MESSAGE_MAX_CHARS])
        cur = cur.__cause__ or cur.__context__
    try:
        stack = scrub(storable_text("".join(traceback.format_exception(exc))))[-STACK_MAX_CHARS:]
    except Exception:  # a traceback that cannot be formatted is left out, never the report
        stack = None
    message = scrub(safe_str(exc))[:MESSAGE_MAX_CHARS]
    return ErrorInfo(message=message, type=type(exc).__name__, cause_chain=chain, stack=stack)


def reject_turn(
    store: SessionStore,
    sink: EventSink,
    ref: SessionRef,
    turn_id: str,
    reason: str,
    *,
    payload: TurnPayload | None = None,
    fence: int | None = None,
    new_only: bool = False,
) -> TurnResult | None:
    """Record a turn as refused before it opened, ending its stream with ``turn.failed`` (phase intake).

    One guarded write (:meth:`SessionStore.reject_turn`): a turn not recorded yet is inserted as
    rejected with ``payload`` (made storable), so no drain can pick it up in between. A follower
    of the turn never waits forever, and the producer can read why. A turn that had already
    ended keeps its own result, which is returned; with ``new_only``, so does one still unfinished
    (its result is None then).
    """
    reason = storable_text(reason)
    payload = payload or TurnPayload(text="")
    if unstorable_reason(payload.model_dump(mode="json")) is not None:
        payload = TurnPayload(text=storable_text(payload.text))
    rec, events = store.reject_turn(ref, turn_id, payload, reason, fence=fence, new_only=new_only)
    sink.publish(ref, events)
    if not events:
        return rec.result
    return Rejected(turn_id=turn_id, reason=reason)


def rejection_event(turn_id: str, reason: str) -> TurnFailed:
    """The event that ends a rejected turn's stream (stores write it with the rejection)."""
    return TurnFailed(turn_id=turn_id, error=ErrorInfo(message=reason, type="TurnRejectedError"), phase="intake")
