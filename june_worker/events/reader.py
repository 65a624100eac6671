"""Reading events back: follow one session (or one turn), read the firehose, share it in a group.

``follow`` catches up from ``last_id`` and then waits for new entries with XREAD BLOCK; a
stream id is the resume token (the gateway's SSE ``Last-Event-ID``). Following one turn
ends after that turn's terminal event (``turn.completed``, ``turn.failed``,
``turn.cancelled``, or ``input.requested``: the turn parked; follow again from that entry's
id to see it continue after a resume). Following a whole session ends only at ``timeout_s``.

The rule a reader must not break: **resume from the last ``stream_id`` you handled**, never
from a ``seq``: deltas have no seq, and ids are what XREAD understands. Within one follow a
structural event is yielded at most once even if the stream holds it twice (after Redis lost
its keys and the stream was rebuilt from the store).

**Gaps are told, never skipped** (:mod:`june_wire.gaps`): when the start id was trimmed away (or is one of an
earlier copy of the stream), or a structural event's ``seq`` jumps past the last one held, ``follow`` raises
:class:`~june_worker.errors.StreamGapError` naming the first missing seq (when known) and where to
go on, before yielding anything after the gap. Reload the missing events from the store
(``SessionStore.events(ref, after_seq=...)``), then follow again from the error's ``resume_id``
with ``last_seq=next_seq - 1``. Pass ``last_seq`` (the last seq you hold) when you resume from a
stream id, so that a trimmed start names its first missing seq exactly.

A delta of an older attempt at a step than one already seen (``attempt``: a dead or fenced-off
worker's deltas arriving after its retry began) is dropped. Entries that do not decode (a newer
version's event type) are logged and skipped. The follow itself (position, filters, gaps) is
:mod:`june_wire.follow`, the producers' too; this module makes a TurnEvent of each entry on top.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from june_wire import events as wire
from june_wire.follow import FollowState, follow_async, follow_sync, pin_last_id, safe_block_ms
from june_wire.keys import DEFAULT_KEYS, EventKeys, SessionRef
from june_wire.redis_url import AsyncRedisClient, RedisClient, socket_timeout_s

from ..engine.events import TurnEvent, TurnEventAdapter
from ..engine.secrets import scrubbed_logger
from ..errors import StreamGapError

__all__ = [
    "StreamEvent",
    "ack",
    "afollow",
    "claim_stale",
    "decode_entry",
    "ensure_group",
    "follow",
    "read_firehose",
    "read_group",
]

log = scrubbed_logger("june_worker.events.reader")

_RELOAD = "the store (SessionStore.events)"


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One decoded stream entry: its id (the resume token), the event, and where it came from."""

    stream_id: str
    event: TurnEvent
    agent: str
    session: str
    stream: str = ""


def _adopt(entry: wire.FollowedEvent, stream: str) -> StreamEvent | None:
    """The entry as a :class:`StreamEvent`: its data validated as a TurnEvent; None (logged) if it is not one."""
    data = dict(entry.data)
    try:
        agent = str(data.pop("agent"))
        session = str(data.pop("session"))
        event = TurnEventAdapter.validate_python(data)
    except (TypeError, KeyError, ValueError, ValidationError) as exc:
        log.warning("skipped entry %s of %s: it does not decode as a TurnEvent (%s)", entry.stream_id, stream, exc)
        return None
    return StreamEvent(stream_id=entry.stream_id, event=event, agent=agent, session=session, stream=stream)


def decode_entry(stream: str, entry_id: str, fields: dict[Any, Any] | None) -> StreamEvent | None:
    """A stream entry (fields ``type`` and ``data``) as a :class:`StreamEvent`; None if it does not decode."""
    entry = wire.decode_entry(stream, entry_id, fields, log)
    return _adopt(entry, stream) if entry is not None else None


def _state(
    client: Any,
    stream: str,
    turn_id: str | None,
    last_id: str,
    block_ms: int,
    timeout_s: float | None,
    include_deltas: bool,
    last_seq: int | None,
    newest_attempt: dict[tuple[str, str], int] | None = None,
) -> FollowState[StreamEvent]:
    return FollowState(
        stream,
        adopt=lambda entry: _adopt(entry, stream),
        turn_id=turn_id,
        last_id=last_id,
        block_ms=safe_block_ms(socket_timeout_s(client), block_ms),
        timeout_s=timeout_s,
        include_deltas=include_deltas,
        last_seq=last_seq,
        reload=_RELOAD,
        gap_error=StreamGapError,
        newest_attempt=newest_attempt,
        log=log,
    )


def follow(
    client: RedisClient,
    agent: str,
    session: str,
    *,
    turn_id: str | None = None,
    last_id: str = "0-0",
    block_ms: int = 2000,
    timeout_s: float | None = None,
    count: int = 100,
    include_deltas: bool = True,
    keys: EventKeys = DEFAULT_KEYS,
    last_seq: int | None = None,
) -> Generator[StreamEvent, None, None]:
    """Events of a session after ``last_id`` (``"0-0"``: from the start; ``"$"``: only what comes next).

    With ``turn_id``, only that turn's events, ending after its terminal event. ``timeout_s``
    bounds how long to wait for new entries (0: catch up, then stop); what is already in the
    stream is always read. ``block_ms`` is one XREAD's wait, kept below the client's socket
    timeout. ``"$"`` is pinned to the stream's last id by this call, before iterating.
    ``last_seq``: the last structural seq you hold (when resuming from a stream id; 0 from the
    start). Raises :class:`~june_worker.errors.StreamGapError` when events after your position are
    gone (see the module docstring). Redis errors propagate: reconnect and follow again from the
    last ``stream_id``.
    """
    stream = keys.session_stream(SessionRef(agent, session))
    if last_id == "$":
        last_id = pin_last_id(client.xrevrange(stream, count=1))
    state = _state(client, stream, turn_id, last_id, block_ms, timeout_s, include_deltas, last_seq)
    return follow_sync(client, state, count)


async def afollow(
    client: AsyncRedisClient,
    agent: str,
    session: str,
    *,
    turn_id: str | None = None,
    last_id: str = "0-0",
    block_ms: int = 2000,
    timeout_s: float | None = None,
    count: int = 100,
    include_deltas: bool = True,
    keys: EventKeys = DEFAULT_KEYS,
    last_seq: int | None = None,
    newest_attempt: dict[tuple[str, str], int] | None = None,
) -> AsyncGenerator[StreamEvent, None]:
    """:func:`follow` on ``redis.asyncio``, for the HTTP gateway (SSE, ``Last-Event-ID`` = ``stream_id``).

    An async generator: ``"$"`` is pinned when iteration starts, not at the call. ``newest_attempt``: the
    newest attempt seen per (turn id, step), updated in place, so that a follow that goes on where an earlier
    one ended (the gateway's windows) still drops a dead attempt's deltas that arrive late.
    """
    stream = keys.session_stream(SessionRef(agent, session))
    state = _state(client, stream, turn_id, last_id, block_ms, timeout_s, include_deltas, last_seq, newest_attempt)
    async with contextlib.aclosing(follow_async(client, state, count)) as items:
        async for item in items:
            yield item


# --- the firehose ----------------------------------------------------------------------------------


def read_firehose(
    client: RedisClient,
    partition: int = 0,
    *,
    last_id: str = "0-0",
    count: int = 100,
    block_ms: int | None = None,
    keys: EventKeys = DEFAULT_KEYS,
) -> list[StreamEvent]:
    """Up to ``count`` structural events of all sessions after ``last_id`` in one firehose partition.

    Continue from the last item's ``stream_id``. One call reads one partition: partitions
    live in different hash slots, and a multi-key XREAD would fail on a cluster.
    """
    stream = keys.firehose_stream(partition)
    response = client.xread({stream: last_id}, count=count, block=block_ms)
    return [e for s, i, f in wire.entries(response) if (e := decode_entry(s, i, f)) is not None]


def ensure_group(
    client: RedisClient,
    group: str,
    *,
    partition: int = 0,
    start_id: str = "0",
    keys: EventKeys = DEFAULT_KEYS,
) -> bool:
    """Create consumer group ``group`` on a firehose partition (and the stream if needed); False if it exists.

    ``start_id="0"`` hands the group everything still in the stream; ``"$"`` only what comes next.
    """
    try:
        client.xgroup_create(keys.firehose_stream(partition), group, id=start_id, mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" in str(exc):
            return False
        raise
    return True


def _group_items(client: RedisClient, group: str, response: Any) -> list[StreamEvent]:
    out: list[StreamEvent] = []
    poison: dict[str, list[str]] = {}
    for stream, entry_id, fields in wire.entries(response):
        item = decode_entry(stream, entry_id, fields)
        if item is None:
            poison.setdefault(stream, []).append(entry_id)
        else:
            out.append(item)
    for stream, ids in poison.items():
        # No consumer of this group can handle them; left pending they would be claimed forever.
        log.error("acknowledged %d undecodable entr(ies) of %s for group %s: %s", len(ids), stream, group, ids)
        client.xack(stream, group, *ids)
    return out


def read_group(
    client: RedisClient,
    group: str,
    consumer: str,
    *,
    partition: int = 0,
    count: int = 100,
    block_ms: int | None = None,
    pending: bool = False,
    keys: EventKeys = DEFAULT_KEYS,
) -> list[StreamEvent]:
    """Up to ``count`` events of a firehose partition no other consumer of ``group`` was given.

    Each event goes to one consumer of the group and stays pending until :func:`ack`.
    ``pending=True`` re-reads this consumer's own unacknowledged events instead (after a
    restart, before reading new ones). Undecodable entries are logged and acknowledged.
    """
    stream = keys.firehose_stream(partition)
    response = client.xreadgroup(group, consumer, {stream: "0" if pending else ">"}, count=count, block=block_ms)
    return _group_items(client, group, response)


def ack(client: RedisClient, group: str, events: Iterable[StreamEvent]) -> int:
    """Acknowledge handled events (from :func:`read_group` / :func:`claim_stale`); returns how many were pending."""
    by_stream: dict[str, list[str]] = {}
    for e in events:
        if not e.stream:
            raise ValueError(f"event {e.stream_id} has no stream name; ack the events read_group returned")
        by_stream.setdefault(e.stream, []).append(e.stream_id)
    return sum(int(client.xack(stream, group, *ids)) for stream, ids in by_stream.items())


def claim_stale(
    client: RedisClient,
    group: str,
    consumer: str,
    *,
    min_idle_ms: int,
    partition: int = 0,
    count: int = 100,
    keys: EventKeys = DEFAULT_KEYS,
) -> list[StreamEvent]:
    """Take over events another consumer of ``group`` read but did not ack for ``min_idle_ms`` (it died)."""
    stream = keys.firehose_stream(partition)
    reply = client.xautoclaim(stream, group, consumer, min_idle_ms, start_id="0-0", count=count)
    entries = [(i, f) for i, f in reply[1] if i is not None] if reply else []
    return _group_items(client, group, [[stream, entries]])
