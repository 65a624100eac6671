"""Ending a turn without a runner: the error report of a failure, and the rejection of a turn that never opened."""

from __future__ import annotations

import traceback

from .events import Rejected, TurnFailed
from .secrets import scrubbed
from .sink import EventSink
from .store import Commit, SessionRef, SessionStore
from .types import ErrorInfo

__all__ = ["STACK_MAX_CHARS", "error_info", "reject_turn"]

STACK_MAX_CHARS = 8000


def error_info(exc: BaseException) -> ErrorInfo:
    """Message, class, cause chain (``__cause__``, else ``__context__``) and a stack without locals."""
    chain: list[str] = []
    seen = {id(exc)}
    cur = exc.__cause__ or exc.__context__
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        chain.append(str(cur) or type(cur).__name__)
        cur = cur.__cause__ or cur.__context__
    stack = "".join(traceback.format_exception(exc))[-STACK_MAX_CHARS:]
    info = ErrorInfo(message=str(exc) or type(exc).__name__, type=type(exc).__name__, cause_chain=chain, stack=stack)
    return scrubbed(info)  # stored and published: no secret may reach either


def reject_turn(
    store: SessionStore, sink: EventSink, ref: SessionRef, turn_id: str, reason: str, *, fence: int | None = None
) -> Rejected:
    """Record a turn as refused before it opened, ending its stream with ``turn.failed`` (phase intake).

    A follower of the turn therefore never waits forever, and the producer can read why.
    """
    result = Rejected(turn_id=turn_id, reason=reason)
    event = TurnFailed(turn_id=turn_id, error=ErrorInfo(message=reason, type="TurnRejectedError"), phase="intake")
    events = store.commit(
        ref, Commit(events=[event], turn_id=turn_id, turn_status="rejected", turn_result=result), fence=fence
    )
    sink.publish(ref, events)
    return result
