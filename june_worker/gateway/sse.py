"""Server-sent events over a session's Redis Stream: the wire format, the follow loop, and its response.

Each event is one SSE message whose ``id`` is the entry's Redis stream id, so a client that
reconnects with ``Last-Event-ID`` continues exactly after the last event it got: nothing
missed, nothing repeated. ``event`` is the event type, ``data`` the event as one line of JSON
(the stream entry's own fields: ``type``, ``turn_id``, ``agent``, ``session``, ``seq``...).
A comment line (``: heartbeat``) goes out after ``heartbeat_s`` without an event, so proxies
keep the connection open. A turn's stream ends after its terminal event; any stream ends after
``max_stream_s`` (the client reconnects with ``Last-Event-ID``) or on a Redis error.

Memory per stream is bounded: the loop reads Redis one XREAD (``batch`` entries) at a time,
only when the previous entries were handed to the server, and the server hands a chunk on only
when the socket takes it (uvicorn's flow control). A slow client slows its own reads, nothing
else. A client that goes away is noticed through ``http.disconnect``; the stream stops at its
next event or its next XREAD timeout (at most ``heartbeat_s``). No in-flight Redis command is
ever cancelled, so the connection pool stays sound. The worker side never knows about readers.

Events a client asked for that the stream no longer holds (its ``Last-Event-ID`` was trimmed away,
or a structural ``seq`` jumps) are never skipped silently: the stream says so with a
``stream.gap`` event naming the first missing seq (when known), where the stream goes on, and the
``GET .../log?after_seq=`` route that reads them from Postgres; its ``id`` is where the stream goes
on after the gap, and the stream continues from there.

The rule a reader must not break: **an event's SSE id is its stream id**; never number events
any other way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from june_wire.keys import EventKeys
from june_wire.redis_url import UNAVAILABLE, AsyncRedisClient

from ..engine.events import is_structural, is_terminal
from ..engine.secrets import scrubbed_logger
from ..engine.store import SessionRef
from ..errors import StreamGapError
from ..events.reader import StreamEvent, afollow
from ..events.redis_stream import encode_event

__all__ = ["SSE_HEADERS", "SSEResponse", "StreamStats", "follow_events", "format_event", "format_gap", "log_path"]

log = scrubbed_logger("june_worker.gateway")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class StreamStats:
    """Counters of the gateway's open streams (tests and /healthz read them)."""

    open: int = 0
    events_sent: int = 0
    sending: int = 0
    """Streams whose last chunk the server has not taken yet (a slow or stalled client)."""
    stalled_since: float | None = None
    """monotonic time since which at least one stream has been waiting on its client."""


def format_event(item: StreamEvent) -> bytes:
    """One SSE message: ``id`` (the stream id), ``event`` (the type), ``data`` (the entry's JSON, one line)."""
    data = encode_event(SessionRef(item.agent, item.session), item.event)
    return f"id: {item.stream_id}\nevent: {item.event.type}\ndata: {data}\n\n".encode()


def log_path(ref: SessionRef) -> str:
    """The route that reads a session's committed events from Postgres (where a gap is reloaded from).

    Every segment is percent-encoded, as in the 202's links: a session id may hold ``?``, ``#`` or ``%``."""
    agent, session = (urllib.parse.quote(part, safe="") for part in (ref.agent, ref.session))
    return f"/v1/agents/{agent}/sessions/{session}/log"


def format_gap(ref: SessionRef, gap: StreamGapError) -> bytes:
    """The ``stream.gap`` message: what is missing, where the stream goes on (its ``id``), how to reload it."""
    first, nxt, log = gap.first_missing_seq, gap.next_seq, log_path(ref)
    goes_on = f"this stream goes on at seq {nxt}" if nxt is not None else "this stream goes on after the gap"
    if first is not None:
        upto = f" to {nxt - 1}" if nxt is not None else " on"
        reload = f"{log}?after_seq={first - 1}"
        message = f"events from seq {first}{upto} are no longer in the session stream; read them with GET {reload}"
    else:
        reload = f"{log}?after_seq=<the last seq you hold>"
        message = f"the session stream no longer holds {gap.after_id}: events after it were trimmed; read those you "
        message += f"lack{f' before seq {nxt}' if nxt is not None else ''} with GET {reload}"
    data = {
        "agent": ref.agent,
        "session": ref.session,
        "type": "stream.gap",
        "first_missing_seq": first,
        "next_seq": nxt,
        "after_id": gap.after_id,
        "resume_id": gap.resume_id,
        "reload": reload,
        "message": f"{message} ({goes_on})",
    }
    return f"id: {gap.resume_id}\nevent: stream.gap\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def follow_events(
    client: AsyncRedisClient,
    keys: EventKeys,
    ref: SessionRef,
    *,
    turn_id: str | None,
    last_id: str,
    heartbeat_s: float,
    max_stream_s: float,
    batch: int,
    gone: Callable[[], bool] = lambda: False,
) -> AsyncIterator[bytes]:
    """SSE chunks: the session's (or one turn's) events after ``last_id``, with heartbeats.

    Follows in windows of ``heartbeat_s``: each window is one :func:`afollow` that ends after a
    read comes back empty past the window; a heartbeat follows, and the next window starts
    after the last event sent. Structural events already sent (by ``seq``) are not sent again, nor a delta of an
    older attempt at its step than one sent (in any window).
    A gap is sent as a ``stream.gap`` event (:func:`format_gap`), and the stream goes on after it.
    """
    deadline = time.monotonic() + max_stream_s
    last_seq: int | None = None  # the last structural seq sent (None: none yet; afollow reads it off the stream)
    attempts: dict[tuple[str, str], int] = {}  # newest attempt per (turn, step), across windows: late stale deltas
    if last_id == "$":
        raise ValueError("pin '$' to a stream id before following: every window must start from a real id")
    yield b"retry: 1000\n: connected\n\n"
    while not gone():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            yield b": stream time limit reached; reconnect with Last-Event-ID\n\n"
            return
        window = min(heartbeat_s, remaining)
        events = afollow(
            client,
            ref.agent,
            ref.session,
            turn_id=turn_id,
            last_id=last_id,
            block_ms=max(1, math.ceil(window * 1000)),
            timeout_s=window,
            count=batch,
            keys=keys,
            last_seq=last_seq,
            newest_attempt=attempts,
        )
        try:
            async with contextlib.aclosing(events):
                async for item in events:
                    if gone():
                        return
                    last_id = item.stream_id
                    event = item.event
                    if is_structural(event) and event.seq:
                        if last_seq is not None and event.seq <= last_seq:
                            continue  # sent already (the stream was rebuilt from the store)
                        last_seq = event.seq
                    yield format_event(item)
                    if turn_id is not None and is_terminal(event):
                        return
                    if time.monotonic() > deadline:
                        break
        except StreamGapError as gap:
            log.info("event stream of %s: told a gap (%s)", ref, gap)
            yield format_gap(ref, gap)
            last_id = gap.resume_id
            last_seq = gap.next_seq - 1 if gap.next_seq is not None else last_seq
            continue
        except UNAVAILABLE as exc:
            log.warning("event stream of %s ended: Redis read failed (%s)", ref, type(exc).__name__)
            yield b": event store unavailable; reconnect with Last-Event-ID\n\n"
            return
        yield b": heartbeat\n\n"


class SSEResponse(Response):
    """A ``text/event-stream`` response fed by :func:`follow_events`, aware of the client leaving.

    Unlike a plain streaming response it never cancels the producer mid-read: it listens for
    ``http.disconnect`` beside it and the producer checks ``gone()`` between events and reads.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        produce: Callable[[Callable[[], bool]], AsyncIterator[bytes]],
        stats: StreamStats,
        *,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
    ) -> None:
        # Not Response.__init__: with no body set, no Content-Length is declared (the stream has no end known).
        self.status_code = status_code
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})
        self._produce = produce
        self._stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = asyncio.Event()

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        listener = asyncio.create_task(listen())
        chunks = self._produce(disconnected.is_set)
        stats = self._stats
        stats.open += 1
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in chunks:
                if disconnected.is_set():
                    break
                await self._send_body(send, chunk)
                if chunk.startswith(b"id: "):
                    stats.events_sent += 1
            if not disconnected.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away (ASGI 2.4 servers say so by raising from send)
        finally:
            stats.open -= 1
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            await _aclose(chunks)

    async def _send_body(self, send: Send, chunk: bytes) -> None:
        stats = self._stats
        stats.sending += 1
        if stats.stalled_since is None:
            stats.stalled_since = time.monotonic()
        try:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            stats.sending -= 1
            if stats.sending == 0:
                stats.stalled_since = None


async def _aclose(chunks: Any) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()
