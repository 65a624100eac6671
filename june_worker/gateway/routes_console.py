"""``/v1/console``: the operator console's reads (paginated lists, a turn's timeline) and its live feed (SSE).

Operators only: a principal with ``"role": "operator"`` in the token map (:mod:`.auth`); anyone
else gets 403. Lists show the sessions of the agents the token sees; a route that names a
session goes through :func:`~.deps.use_session` like every other. Answering from the inbox uses
the ordinary resume route, as the caller (the worker decides who may answer).

The live feed (``GET /v1/console/events``) follows the firehose of structural events and sends
one small ``change`` per event (its type, agent, session, turn id and seq; never its text), so
the page refreshes what changed instead of polling.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import psycopg
from fastapi import APIRouter, HTTPException, Query, Request, Response
from pydantic import BaseModel, Field

from june_wire.redis_url import UNAVAILABLE, is_cluster

from ..engine.secrets import scrubbed_logger
from . import console
from .auth import Principal
from .backend import GatewayBackend
from .deps import AgentName, Authenticated, Backend, SessionId, TurnIdPath, unknown_turn, use_session
from .routes import SSE_DOC
from .schemas import ErrorBody
from .sse import SSEResponse

__all__ = ["router"]

log = scrubbed_logger("june_worker.gateway")

router = APIRouter(prefix="/v1/console", tags=["console"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "No bearer token, or an unknown one."},
    403: {"model": ErrorBody, "description": "The token is not an operator's."},
    422: {"model": ErrorBody, "description": "A malformed query (a cursor this console did not make)."},
    503: {"model": ErrorBody, "description": "Postgres or Redis is unavailable."},
}
_ERROR_JSON = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
Limit = Annotated[int, Query(ge=1, le=200, description="At most this many rows.")]
Cursor = Annotated[
    str | None, Query(max_length=2048, pattern=r"^[A-Za-z0-9_\-]+$", description="next_cursor of the previous page.")
]


class ConsolePage(BaseModel):
    items: list[dict[str, Any]] = Field(description="The page's rows.")
    next_cursor: str | None = Field(description="Ask again with cursor set to this for the next page; null: last.")
    now: float = Field(description="The gateway's clock (unix seconds) when the page was read.")


def operator(principal: Principal) -> Principal:
    """The caller, if it is an operator; else 403."""
    if not principal.operator:
        raise HTTPException(status_code=403, detail="the operator console needs an operator token (role: operator)")
    return principal


def visible_agents(request: Request, principal: Principal) -> list[str]:
    return [a for a in request.app.state.settings.agents if principal.sees(a)]


async def _read(backend: GatewayBackend, fn: Callable[[Any], Any]) -> Any:
    """Run ``fn(conn)`` on a pooled connection in a worker thread; a database without june's schema reads as empty."""

    def run() -> Any:
        with backend.store.pool.connection() as conn:
            return fn(conn)

    try:
        return await backend.read(run)
    except psycopg.errors.UndefinedTable:
        return None
    except console.BadCursor as exc:
        raise HTTPException(
            status_code=422, detail=[{"loc": ["query", "cursor"], "msg": str(exc), "type": "value_error"}]
        ) from None


@router.get("/sessions", response_model=ConsolePage, responses=_ERRORS, summary="Sessions, latest activity first")
async def sessions(
    request: Request, principal: Authenticated, backend: Backend, limit: Limit = 50, cursor: Cursor = None,
    status: Annotated[
        str | None,
        Query(pattern=f"^({'|'.join(console.SESSION_STATUSES)})$",
              description="Only this status (rejected: every turn of the session was refused at intake)."),
    ] = None,
) -> ConsolePage:  # fmt: skip
    """Every session of the agents this operator sees, with its status and last activity (its last commit).
    ``rejected``: every turn of the session was refused at intake (its stored status stays ``new``)."""
    agents = visible_agents(request, operator(principal))
    page = await _read(backend, lambda c: console.sessions_page(c, agents, status, limit, cursor))
    items, nxt = page or ([], None)
    return ConsolePage(items=items, next_cursor=nxt, now=time.time())


@router.get("/approvals", response_model=ConsolePage, responses=_ERRORS, summary="The approvals inbox")
async def approvals(
    request: Request, principal: Authenticated, backend: Backend, limit: Limit = 50, cursor: Cursor = None
) -> ConsolePage:
    """Parked sessions, longest waiting first: the prompt, who may answer, how long it has waited, and
    whether this operator may answer (``may_answer``: null when the agent's ``authorize_answer`` decides)."""
    agents = visible_agents(request, operator(principal))
    now = time.time()
    page = await _read(backend, lambda c: console.inbox_page(c, agents, principal, limit, cursor, now))
    items, nxt = page or ([], None)
    return ConsolePage(items=items, next_cursor=nxt, now=now)


@router.get("/failed", response_model=ConsolePage, responses=_ERRORS, summary="Failed and rejected turns, latest first")
async def failed(
    request: Request, principal: Authenticated, backend: Backend, limit: Limit = 50, cursor: Cursor = None
) -> ConsolePage:
    """Turns that ended ``failed``, with the phase and step they failed at and the error, and turns refused at
    intake (``status: rejected``: phase ``intake``, the reason as the error)."""
    agents = visible_agents(request, operator(principal))
    page = await _read(backend, lambda c: console.failed_page(c, agents, limit, cursor))
    items, nxt = page or ([], None)
    return ConsolePage(items=items, next_cursor=nxt, now=time.time())


@router.get(
    "/agents/{agent}/sessions/{session}/turns", response_model=ConsolePage, responses=_ERRORS,
    summary="A session's latest turns",
)  # fmt: skip
async def turns(
    request: Request, agent: AgentName, session: SessionId, principal: Authenticated, backend: Backend,
    limit: Limit = 50,
) -> ConsolePage:  # fmt: skip
    ref = await use_session(request, operator(principal), agent, session, "follow")
    items = await _read(backend, lambda c: console.session_turns(c, ref.agent, ref.session, limit))
    return ConsolePage(items=items or [], next_cursor=None, now=time.time())


@router.get(
    "/agents/{agent}/sessions/{session}/turns/{turn_id}/timeline", responses=_ERRORS, summary="A turn's timeline"
)
async def turn_timeline(
    request: Request, agent: AgentName, session: SessionId, turn_id: TurnIdPath, principal: Authenticated,
    backend: Backend,
) -> dict[str, Any]:  # fmt: skip
    """The turn's row, its committed events (when each landed, how long after the one before) and its steps."""
    ref = await use_session(request, operator(principal), agent, session, "follow", turn_id=turn_id)
    found = await _read(backend, lambda c: console.timeline(c, ref.agent, ref.session, turn_id))
    if found is None:
        raise unknown_turn(agent, session, turn_id)
    result: dict[str, Any] = found
    return result


_SSE_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": doc["description"], "content": _ERROR_JSON} for code, doc in _ERRORS.items()
}
"""The feed's errors: JSON like everywhere else (not its route's media type)."""


@router.get(
    "/events",
    response_class=SSEResponse,
    responses={**_SSE_ERRORS, 200: {"content": SSE_DOC, "description": "One `change` per structural event."}},
    summary="What changes, live (SSE)",
)
async def changes(request: Request, principal: Authenticated, backend: Backend) -> Response:
    """A ``change`` message per structural event of the agents this operator sees: ``{type, agent, session,
    turn_id, seq}``. It ends after JUNE_GATEWAY_MAX_STREAM_S (reconnect)."""
    agents = frozenset(visible_agents(request, operator(principal)))
    s = backend.settings

    def produce(gone: Callable[[], bool]) -> AsyncIterator[bytes]:
        return _changes(backend, agents, heartbeat_s=s.heartbeat_s, max_stream_s=s.max_stream_s, gone=gone)

    return SSEResponse(produce, backend.stats)


async def _changes(
    backend: GatewayBackend,
    agents: frozenset[str],
    *,
    heartbeat_s: float,
    max_stream_s: float,
    gone: Callable[[], bool],
) -> AsyncIterator[bytes]:
    client = backend.redis
    deadline = time.monotonic() + max_stream_s
    names = backend.keys.firehose_streams()
    streams: dict[str, str] = {}
    try:
        for name in names:  # from the newest entry on: only what happens next
            last: Any = await client.xrevrange(name, count=1)
            streams[name] = str(last[0][0]) if last else "0-0"
    except UNAVAILABLE as exc:
        log.warning("console feed: Redis read failed (%s)", type(exc).__name__)
        yield b": event store unavailable; reconnect\n\n"
        return
    # One Redis reads every partition in one XREAD. On a cluster each partition is a slot of its own (maybe on
    # another node), and a command may name keys of one slot only: one reader per partition, side by side.
    groups = [[name] for name in names] if is_cluster(client) else [names]
    feed = _Readers(client, [{name: streams[name] for name in group} for group in groups], heartbeat_s)
    yield b"retry: 2000\n: connected\n\n"
    try:
        while not gone():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                yield b": stream time limit reached; reconnect\n\n"
                return
            found = await feed.next(timeout_s=min(heartbeat_s, remaining))
            if found is None:
                yield b": heartbeat\n\n"
                continue
            if isinstance(found, BaseException):
                if not isinstance(found, UNAVAILABLE):
                    raise found
                log.warning("console feed: Redis read failed (%s)", type(found).__name__)
                yield b": event store unavailable; reconnect\n\n"
                return
            for _stream, entries in found:
                for _entry_id, fields in entries:
                    change = _change(fields)
                    if change is not None and change["agent"] in agents:
                        yield f"event: change\ndata: {json.dumps(change, separators=(',', ':'))}\n\n".encode()
    finally:
        await feed.close()


class _Readers:
    """One task per group of streams, each an XREAD BLOCK loop, handing what it read over one at a time.

    A reader reads again only once its last XREAD's entries are queued, and the queue holds one batch per
    reader, so the feed holds at most two batches per reader however slow its client. Closing never cancels
    a Redis command: a reader waiting on Redis is let finish its XREAD (at most ``block_s``), one waiting to
    hand over is cancelled.
    """

    def __init__(self, client: Any, groups: list[dict[str, str]], block_s: float) -> None:
        self._client = client
        self._block_ms = max(1, int(block_s * 1000))
        self._found: asyncio.Queue[Any] = asyncio.Queue(maxsize=len(groups))
        self._stop = False
        self._in_redis: set[asyncio.Task[None]] = set()
        self._tasks = [asyncio.create_task(self._read(group)) for group in groups]

    async def _read(self, streams: dict[str, str]) -> None:
        me = asyncio.current_task()
        assert me is not None
        while not self._stop:
            self._in_redis.add(me)
            try:
                found: Any = await self._client.xread(streams, count=200, block=self._block_ms)
            except Exception as exc:  # handed over: the feed decides (Redis unavailable, or a bug to raise)
                found = exc
            finally:
                self._in_redis.discard(me)
            if self._stop:
                return
            if isinstance(found, Exception):
                await self._found.put(found)
                return
            if found:
                for stream, entries in found:
                    streams[str(stream)] = str(entries[-1][0])
                await self._found.put(found)

    async def next(self, *, timeout_s: float) -> Any:
        """One XREAD's entries, an exception a reader met, or None when nothing came within ``timeout_s``."""
        try:
            return await asyncio.wait_for(self._found.get(), timeout=timeout_s)
        except TimeoutError:
            return None

    async def close(self) -> None:
        self._stop = True
        for task in self._tasks:
            if task not in self._in_redis:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _change(fields: dict[str, Any]) -> dict[str, Any] | None:
    try:
        data = json.loads(fields.get("data") or "{}")
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("agent"), str):
        return None
    return {
        "type": fields.get("type") or data.get("type"),
        "agent": data["agent"],
        "session": data.get("session"),
        "turn_id": data.get("turn_id"),
        "seq": data.get("seq"),
    }
