"""One follow of a session stream: its state, and the sync and async loops that drive it.

XREAD from ``last_id`` (exclusive), catch-up first and then BLOCK for new entries. Every entry
read moves the position, also the ones filtered out, so the next XREAD never reads them again.
Following one turn ends after its terminal event; following a session ends when ``timeout_s`` has
passed and a read comes back empty (what is already in the stream is always read, even with
``timeout_s=0``).

Within one follow a structural event is yielded at most once, even when the stream holds it twice
(the worker rebuilt the stream from the store after Redis lost it): a ``seq`` not above the
highest one seen is skipped. A delta of an older attempt at a step than one already seen (a dead
or fenced-off worker's, arriving after its retry began) is dropped. Entries that do not decode are
logged and skipped.

Gaps are told, never skipped (:mod:`.gaps`): a start id the stream no longer holds, or a
structural ``seq`` more than one past the last one held, raises the caller's
:class:`~june_wire.errors.StreamGapError` before anything after the gap is yielded.

Both sides drive the same state: the producers yield the entries as decoded here
(:class:`~june_wire.events.FollowedEvent`); the engine's reader turns each into its own typed event
on top (``adopt``: an entry it cannot use is skipped as one that does not decode). The rule a reader
must not break: **the filters judge the entry as it is on the wire**, whatever the caller makes of it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncGenerator, Callable, Generator
from typing import Any, Generic, TypeVar

from .errors import StreamGapError
from .events import FollowedEvent, decode_entry, entries, text
from .gaps import SCAN, Gap, Start, judge_start, jump, lost_start, queue_start_check

__all__ = [
    "DeltaAttempts",
    "FollowState",
    "follow_async",
    "follow_sync",
    "pin_last_id",
    "safe_block_ms",
    "same_event",
]

Item = TypeVar("Item")

_log = logging.getLogger("june_wire.follow")


def same_event(event: FollowedEvent) -> FollowedEvent:
    """The ``adopt`` of a follow that yields the entries as decoded."""
    return event


def safe_block_ms(socket_timeout_s: float | None, block_ms: int) -> int:
    """``block_ms`` cut below the client's socket timeout: a longer BLOCK would end in a socket timeout."""
    if not isinstance(block_ms, int) or block_ms < 1:
        raise ValueError(f"block_ms must be at least 1, not {block_ms!r}")
    if socket_timeout_s:
        block_ms = min(block_ms, max(1, int(socket_timeout_s * 800)))
    return block_ms


def pin_last_id(tail: Any) -> str:
    """What ``"$"`` (only what comes next) means now: the id of the stream's newest entry, from an
    ``XREVRANGE stream + - COUNT 1`` reply (``"0-0"`` for an empty stream)."""
    return text(tail[0][0]) if tail else "0-0"


class DeltaAttempts:
    """The newest attempt seen per (turn, step): a delta of an older one belongs to a dead attempt.

    ``newest``: a mapping to keep it in, updated in place, so that a follow going on where an earlier one
    ended (the gateway's windows) still drops a dead attempt's deltas that arrive late."""

    def __init__(self, newest: dict[tuple[str, str], int] | None = None) -> None:
        self._newest = {} if newest is None else newest

    def stale(self, event: FollowedEvent) -> bool:
        """True for a delta of an older attempt at its step than one seen before; remembers newer ones."""
        attempt = event.attempt
        if attempt is None:
            return False  # a worker that does not say: nothing to compare
        key = (event.turn_id or "", event.step or "")
        if attempt < self._newest.get(key, 0):
            return True
        self._newest[key] = attempt
        return False


class FollowState(Generic[Item]):
    """Position, filter and deadline of one follow; ``adopt`` makes the caller's item of each entry it yields."""

    def __init__(
        self,
        stream: str,
        *,
        adopt: Callable[[FollowedEvent], Item | None],
        turn_id: str | None,
        last_id: str,
        block_ms: int,
        timeout_s: float | None,
        include_deltas: bool,
        last_seq: int | None = None,
        reload: str = "the store",
        gap_error: type[StreamGapError] = StreamGapError,
        newest_attempt: dict[tuple[str, str], int] | None = None,
        log: logging.Logger = _log,
    ) -> None:
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must not be negative, not {timeout_s}")
        if last_seq is not None and (not isinstance(last_seq, int) or last_seq < 0):
            raise ValueError(f"last_seq must be a seq you hold (an int >= 0), not {last_seq!r}")
        self.stream = stream
        self.adopt = adopt
        self.turn_id = turn_id
        self.last_id = last_id
        self.block_ms = block_ms
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.include_deltas = include_deltas
        self.last_seq = last_seq  # the highest structural seq held; None: not known until the start check
        self.reload = reload
        self.gap_error = gap_error
        self.log = log
        self.gap: Gap | None = None
        self.lost = False  # the start id is from no copy of the stream here: check the first structural seq
        self.done = False
        self.attempts = DeltaAttempts(newest_attempt)

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

    def started(self, start: Start, after: Any = None) -> None:
        """Take what the start check found (:func:`.gaps.judge_start`) and, when it was suspect, the entries
        after the start id: the seq held, and a gap at the start."""
        self.last_seq, self.gap = start.settle(after) if start.suspect else (start.anchor, None)
        self.lost = start.lost and not start.suspect

    def raise_gap(self) -> None:
        if self.gap is not None:
            raise self.gap.error(self.reload, self.gap_error)

    def take(self, response: Any) -> list[Item]:
        """The items of one XREAD reply this follow yields; sets ``done`` after the turn's terminal event and
        ``gap`` (stopping before it) at a seq jump."""
        out: list[Item] = []
        for stream, entry_id, fields in entries(response):
            before, self.last_id = self.last_id, entry_id
            event = decode_entry(stream, entry_id, fields, self.log)
            item = self.adopt(event) if event is not None else None
            if event is None or item is None:
                continue
            if event.delta:
                if not self.include_deltas or self.attempts.stale(event):
                    continue
            elif seq := event.seq:
                if self.last_seq is None and self.lost:
                    self.lost, self.gap = False, lost_start(self.stream, before, entry_id, seq)
                    if self.gap is not None:
                        self.last_id = before
                        break
                if self.last_seq is not None:
                    if seq <= self.last_seq:
                        continue  # the same event again, in a stream rebuilt from the store
                    if seq > self.last_seq + 1:
                        self.gap = jump(self.stream, before, entry_id, self.last_seq, seq)
                        self.last_id = before
                        break
                self.last_seq = seq
            if self.turn_id is not None and event.turn_id != self.turn_id:
                continue
            out.append(item)
            if self.turn_id is not None and event.terminal:
                self.done = True
                break
        return out


def follow_sync(client: Any, state: FollowState[Item], count: int) -> Generator[Item, None, None]:
    """Drive ``state`` on a ``redis.Redis`` (or cluster) client: the start check, then XREAD until it is done."""
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


async def follow_async(client: Any, state: FollowState[Item], count: int) -> AsyncGenerator[Item, None]:
    """:func:`follow_sync` on a ``redis.asyncio`` client; ``"$"`` as ``last_id`` is pinned when iteration starts."""
    if state.last_id == "$":
        state.last_id = pin_last_id(await client.xrevrange(state.stream, count=1))
    async with client.pipeline(transaction=False) as pipe:
        queue_start_check(pipe, state.stream, state.last_id, state.last_seq)
        start = judge_start(state.stream, state.last_id, state.last_seq, await pipe.execute(raise_on_error=False))
    after = await client.xrange(state.stream, min="(" + state.last_id, count=SCAN) if start.suspect else None
    state.started(start, after)
    state.raise_gap()
    while not state.done:
        response = await client.xread({state.stream: state.last_id}, count=count, block=state.block())
        for item in state.take(response):
            yield item
        state.raise_gap()
        if not response and state.expired():
            return
