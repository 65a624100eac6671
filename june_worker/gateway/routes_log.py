"""``GET .../sessions/{session}/log``: a session's committed structural events, read from Postgres.

Where a follower reloads what its event stream no longer holds: an SSE ``stream.gap`` event names
this route with the ``after_seq`` to read from. The events are the store's outbox (each with its
``seq``), in the same JSON shape as the stream's entries; deltas are live only and never here.
Pages of at most ``limit`` events: ask again with ``after_seq=next_after_seq`` while it is set.
"""

from __future__ import annotations

from typing import Annotated, Any

import psycopg
from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, Field

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


class SessionLog(BaseModel):
    agent: str
    session: str
    events: list[dict[str, Any]] = Field(description="Structural events after after_seq, in seq order.")
    next_after_seq: int | None = Field(description="More events follow: ask again with after_seq set to this.")


@router.get(SESSION + "/log", response_model=SessionLog, responses=_ERRORS, summary="A session's committed events")
async def session_log(
    request: Request, agent: AgentName, session: SessionId, principal: Authenticated, backend: Backend,
    after_seq: Annotated[int, Query(ge=0, description="Only events with a greater seq.")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="At most this many events.")] = 500,
) -> SessionLog:  # fmt: skip
    """The session's structural events after ``after_seq`` from Postgres: what a follower told of a gap
    (SSE ``stream.gap``) reloads. Pages of ``limit``; ``next_after_seq`` is set while more follow."""
    ref = await use_session(request, principal, agent, session, "follow")

    def read() -> list[Any]:
        try:
            return backend.store.events(ref, after_seq=after_seq)
        except psycopg.errors.UndefinedTable:
            return []

    events = await backend.blocking(read)
    page = events[:limit]
    body = [{"agent": agent, "session": session, **e.model_dump(mode="json", by_alias=True)} for e in page]
    more = len(events) > limit and page[-1].seq is not None
    return SessionLog(agent=agent, session=session, events=body, next_after_seq=page[-1].seq if more else None)
