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

**Gaps are told, never skipped** (:mod:`._gaps`): when the start id was trimmed away (or is one of an
earlier copy of the stream), or a structural event's ``seq`` jumps past the last one held, ``follow`` raises
:class:`~june_worker.errors.StreamGapError` naming the first missing seq (when known) and where to
go on, before yielding anything after the gap. Reload the missing events from the store
(``SessionStore.events(ref, after_seq=...)``), then follow again from the error's ``resume_id``
with ``last_seq=next_seq - 1``. Pass ``last_seq`` (the last seq you hold) when you resume from a
stream id, so that a trimmed start names its first missing seq exactly.

A delta of an older attempt at a step than one already seen (``attempt``: a dead or fenced-off
worker's deltas arriving after its retry began) is dropped. Entries that do not decode (a newer
version's event type) are logged and skipped.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncGenerator, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from ..engine.events import TurnEvent, TurnEventAdapter, is_structural, is_terminal
from ..engine.secrets import scrubbed_logger
from ..engine.store import SessionRef
from ._gaps import SCAN, Gap, Start, judge_start, jump, lost_start, queue_start_check
from ._redis_url import AsyncRedisClient, RedisClient, socket_timeout_s
from .keys import DEFAULT_KEYS, EventKeys

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


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One decoded stream entry: its id (the resume token), the event, and where it came from."""

    stream_id: str
    event: TurnEvent
    agent: str
    session: str
    stream: str = ""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_entry(stream: str, entry_id: str, fields: dict[Any, Any] | None) -> StreamEvent | None:
    """A stream entry (fields ``type`` and ``data``) as a :class:`StreamEvent`; None if it does not decode."""
    if not fields:
        return None
    raw: Any = fields.get("data", fields.get(b"data"))
    try:
        data = json.loads(raw)
        agent = str(data.pop("agent"))
        session = str(data.pop("session"))
        event = TurnEventAdapter.validate_python(data)
    except (TypeError, KeyError, ValueError, ValidationError) as exc:
        log.warning("skipped entry %s of %s: it does not decode as a TurnEvent (%s)", entry_id, stream, exc)
        return None
    return StreamEvent(stream_id=entry_id, event=event, agent=agent, session=session, stream=stream)


def _entries(response: Any) -> list[tuple[str, str, dict[Any, Any] | None]]:
    """(stream, id, fields) of an XREAD / XREADGROUP reply, in RESP2 (list) or RESP3 (dict) shape."""
    if not response:
        return []
    pairs = response.items() if isinstance(response, dict) else response
    out: list[tuple[str, str, dict[Any, Any] | None]] = []
    for stream, entries in pairs:
        name = _text(stream)
        for entry_id, fields in entries:
            out.append((name, _text(entry_id), fields))
    return out


def _safe_block_ms(client: Any, block_ms: int) -> int:
    """``block_ms`` cut below the client's socket timeout: a BLOCK longer than it would end in a TimeoutError."""
    socket_timeout = socket_timeout_s(client)
    if socket_timeout:
        block_ms = min(block_ms, max(1, int(socket_timeout * 800)))
    return max(1, block_ms)


class _Follow:
    """The state of one follow, shared by the sync and async loops: position, filter, deadline."""

    def __init__(
        self,
        stream: str,
        turn_id: str | None,
        last_id: str,
        block_ms: int,
        timeout_s: float | None,
        deltas: bool,
        last_seq: int | None = None,
        newest_attempt: dict[tuple[str, str], int] | None = None,
    ) -> None:
        if last_seq is not None and last_seq < 0:
            raise ValueError(f"last_seq must not be negative, not {last_seq}")
        self.stream = stream
        self.turn_id = turn_id
        self.last_id = last_id
        self.block_ms = block_ms
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.include_deltas = deltas
        self.last_seq = last_seq  # the highest structural seq the follower holds; None: not known yet
        self.gap: Gap | None = None
        self.lost = False  # the start id is from no copy of the stream here: check the first structural seq
        self.done = False
        self.newest_attempt = {} if newest_attempt is None else newest_attempt

    def block(self) -> int | None:
        """How long the next XREAD may block; None (do not block) once the deadline has passed."""
        if self.deadline is None:
            return self.block_ms
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return None
        return max(1, min(self.block_ms, math.ceil(remaining * 1000)))

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _stale(self, delta: TurnEvent) -> bool:
        """A delta of an older attempt at its step than one already seen: a dead (or fenced-off) worker's."""
        attempt = getattr(delta, "attempt", None)
        if attempt is None:
            return False
        key = (delta.turn_id, str(getattr(delta, "step", "")))
        if attempt < self.newest_attempt.get(key, 0):
            return True
        self.newest_attempt[key] = attempt
        return False

    def started(self, start: Start, after: Any = None) -> None:
        """Take what the start check found (:func:`._gaps.judge_start`) and, when it was suspect, the entries
        after the start id: the seq held, and a gap at the start."""
        self.last_seq, self.gap = start.settle(after) if start.suspect else (start.anchor, None)
        self.lost = start.lost and not start.suspect

    def raise_gap(self) -> None:
        if self.gap is not None:
            raise self.gap.error("the store (SessionStore.events)")

    def take(self, response: Any) -> list[StreamEvent]:
        """The events of one XREAD reply to yield; stops before a seq jump (``gap``) or after the turn's end."""
        out: list[StreamEvent] = []
        for stream, entry_id, fields in _entries(response):
            before, self.last_id = self.last_id, entry_id
            item = decode_entry(stream, entry_id, fields)
            if item is None:
                continue
            event = item.event
            if is_structural(event):
                seq = event.seq or 0
                if seq and self.last_seq is None and self.lost:
                    self.lost, self.gap = False, lost_start(self.stream, before, entry_id, seq)
                    if self.gap is not None:
                        self.last_id = before
                        break
                if seq and self.last_seq is not None:
                    if seq <= self.last_seq:
                        continue  # the same event again, in a stream rebuilt from the store
                    if seq > self.last_seq + 1:
                        self.gap = jump(self.stream, before, entry_id, self.last_seq, seq)
                        self.last_id = before
                        break
                if seq:
                    self.last_seq = seq
            elif not self.include_deltas or self._stale(event):
                continue
            if self.turn_id is not None and event.turn_id != self.turn_id:
                continue
            out.append(item)
            if self.turn_id is not None and is_terminal(event):
                self.done = True
                break
        return out


def _resolve_last_id(last_id: str, tail: Any) -> str:
    if last_id != "$":
        return last_id
    return _text(tail[0][0]) if tail else "0-0"


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
        last_id = _resolve_last_id(last_id, client.xrevrange(stream, count=1))
    state = _Follow(stream, turn_id, last_id, _safe_block_ms(client, block_ms), timeout_s, include_deltas, last_seq)
    return _follow(client, state, count)


def _follow(client: RedisClient, state: _Follow, count: int) -> Generator[StreamEvent, None, None]:
    with client.pipeline(transaction=False) as pipe:
        queue_start_check(pipe, state.stream, state.last_id, state.last_seq)
        start = judge_start(state.stream, state.last_id, state.last_seq, pipe.execute(raise_on_error=False))
    state.started(start, client.xrange(state.stream, min="(" + state.last_id, count=SCAN) if start.suspect else None)
    state.raise_gap()
    while not state.done:
        response = client.xread({state.stream: state.last_id}, count=count, block=state.block())
        yield from state.take(response)
        state.raise_gap()
        if not response and state.expired():
            return


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
    if last_id == "$":
        last_id = _resolve_last_id(last_id, await client.xrevrange(stream, count=1))
    state = _Follow(
        stream, turn_id, last_id, _safe_block_ms(client, block_ms), timeout_s, include_deltas, last_seq, newest_attempt
    )
    async with client.pipeline(transaction=False) as pipe:
        queue_start_check(pipe, stream, state.last_id, state.last_seq)
        start = judge_start(stream, state.last_id, state.last_seq, await pipe.execute(raise_on_error=False))
    after = await client.xrange(stream, min="(" + state.last_id, count=SCAN) if start.suspect else None
    state.started(start, after)
    state.raise_gap()
    while not state.done:
        response = await client.xread({stream: state.last_id}, count=count, block=state.block())
        for item in state.take(response):
            yield item
        state.raise_gap()
        if not response and state.expired():
            return


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
    return [e for s, i, f in _entries(response) if (e := decode_entry(s, i, f)) is not None]


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
    for stream, entry_id, fields in _entries(response):
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
