"""``GET .../sessions/{session}/log``: a session's committed structural events, read from Postgres.

Where a follower reloads what its event stream no longer holds: an SSE ``stream.gap`` event names
this route with the ``after_seq`` to read from. The events are the store's outbox (each with its
``seq``), in the same JSON shape as the stream's entries; deltas are live only and never here.
Pages of at most ``limit`` events: ask again with ``after_seq=next_after_seq`` while it is set.

The outbox is pruned (``JUNE_OUTBOX_RETENTION_S``): it holds a gap-free run of the session's latest
events. When the events right after ``after_seq`` are gone, ``first_kept_seq`` says from which seq on
the store still holds them, so that a reader is never handed a later start without being told.
"""

from __future__ import annotations

from typing import Annotated, Any

import psycopg
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

from ..stores._pg_conn import pooled
from .deps import AgentName, Authenticated, Backend, SessionId, use_session
from .routes import SESSION
from .schemas import ErrorBody

__all__ = ["SessionLog", "router"]

router = APIRouter(prefix="/v1")

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "No bearer token, or an unknown one."},
    404: {"model": ErrorBody, "description": "Unknown agent (or not granted to this token), or session."},
    503: {"model": ErrorBody, "description": "Postgres is unavailable."},
}
MAX_LIMIT = 1000

_COMMITTED = "select event_seq from june_sessions where agent = %s and session = %s"


class SessionLog(BaseModel):
    agent: str
    session: str
    events: list[dict[str, Any]] = Field(description="Structural events after after_seq, in seq order.")
    next_after_seq: int | None = Field(description="More events follow: ask again with after_seq set to this.")
    first_kept_seq: int | None = Field(
        default=None,
        description="Set when events right after after_seq were pruned from the store (JUNE_OUTBOX_RETENTION_S): "
        "the first seq it still holds, or the next seq to be committed when it holds none after after_seq. Events "
        "after_seq+1 to first_kept_seq-1 can no longer be read. Null: nothing after after_seq is missing.",
    )


@router.get(SESSION + "/log", response_model=SessionLog, responses=_ERRORS, summary="A session's committed events")
async def session_log(
    request: Request, agent: AgentName, session: SessionId, principal: Authenticated, backend: Backend,
    after_seq: Annotated[int, Query(ge=0, description="Only events with a greater seq.")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="At most this many events.")] = 500,
) -> SessionLog:  # fmt: skip
    """The session's structural events after ``after_seq`` from Postgres: what a follower told of a gap
    (SSE ``stream.gap``) reloads. Pages of ``limit``; ``next_after_seq`` is set while more follow."""
    ref = await use_session(request, principal, agent, session, "follow")

    def read() -> tuple[list[Any], int | None]:
        try:
            # What was committed is read before the events: one committed between the two reads is then among
            # the events (or after the count), never taken for one pruned
            with pooled(backend.store.pool) as conn:
                row = conn.execute(_COMMITTED, (ref.agent, ref.session)).fetchone()
            committed = int(row[0]) if row else after_seq
            events = backend.store.events(ref, after_seq=after_seq)
            if events and events[0].seq is not None:
                first = events[0].seq
            else:  # none kept after after_seq: those committed by then are gone; the next one to come is the first
                first = committed + 1
            return events, first if first > after_seq + 1 else None
        except psycopg.errors.UndefinedTable:
            return [], None

    events, first_kept = await backend.read(read)
    page = events[:limit]
    body = [{"agent": agent, "session": session, **e.model_dump(mode="json", by_alias=True)} for e in page]
    more = len(events) > limit and page[-1].seq is not None
    return SessionLog(
        agent=agent, session=session, events=body, next_after_seq=page[-1].seq if more else None,
        first_kept_seq=first_kept,
    )  # fmt: skip
