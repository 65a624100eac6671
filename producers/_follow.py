"""The state of one follow of a session stream, shared by the sync and the async reader.

XREAD from ``last_id`` (exclusive), catch-up first and then BLOCK for new entries. Every
entry read moves the position, also the ones filtered out, so the next XREAD never reads them
again. Following one turn ends after its terminal event; following a session ends when
``timeout_s`` has passed and a read comes back empty (what is already in the stream is always
read, even with ``timeout_s=0``).

Within one follow a structural event is yielded at most once, even when the stream holds it
twice (the worker rebuilt the stream from Postgres after Redis lost it): a ``seq`` not above the
highest one seen is skipped. A delta of an older attempt at a step than one already seen (a dead
or fenced-off worker's, arriving after its retry began) is dropped. Entries that do not decode are
logged and skipped.

Gaps are told, never skipped (:mod:`._gaps`): a start id the stream no longer holds, or a
structural ``seq`` more than one past the last one held, raises
:class:`~producers.errors.StreamGapError` before anything after the gap is yielded.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

from ._gaps import Gap, Start, jump, lost_start
from .events import FollowedEvent

__all__ = ["DeltaAttempts", "FollowState", "decode_entry", "entries", "safe_block_ms"]

log = logging.getLogger("producers.follow")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode_entry(stream: str, entry_id: str, fields: dict[Any, Any] | None) -> FollowedEvent | None:
    """A stream entry (fields ``type`` and ``data``) as a :class:`FollowedEvent`; None if it does not decode."""
    if not fields:
        return None
    decoded = {_text(k): v for k, v in fields.items()}
    raw = decoded.get("data")
    try:
        data = json.loads(raw) if raw is not None else None
    except (TypeError, ValueError) as exc:
        log.warning("skipped entry %s of %s: its data is not JSON (%s)", entry_id, stream, exc)
        return None
    if not isinstance(data, dict):
        log.warning("skipped entry %s of %s: its data is not a JSON object", entry_id, stream)
        return None
    kind = decoded.get("type")
    kind = _text(kind) if kind is not None else data.get("type")
    if not isinstance(kind, str) or not kind:
        log.warning("skipped entry %s of %s: it has no event type", entry_id, stream)
        return None
    return FollowedEvent(stream_id=entry_id, type=kind, data=data)


def entries(response: Any) -> list[tuple[str, str, dict[Any, Any] | None]]:
    """(stream, id, fields) of an XREAD reply, in RESP2 (list) or RESP3 (dict) shape."""
    if not response:
        return []
    pairs = response.items() if isinstance(response, dict) else response
    out: list[tuple[str, str, dict[Any, Any] | None]] = []
    for stream, items in pairs:
        name = _text(stream)
        for entry in items:
            entry_id, fields = entry
            if entry_id is None:
                continue
            out.append((name, _text(entry_id), fields))
    return out


def safe_block_ms(socket_timeout_s: float | None, block_ms: int) -> int:
    """``block_ms`` cut below the client's socket timeout: a longer BLOCK would end in a socket timeout."""
    if block_ms < 1:
        raise ValueError(f"block_ms must be at least 1, not {block_ms}")
    if socket_timeout_s:
        block_ms = min(block_ms, max(1, int(socket_timeout_s * 800)))
    return block_ms


class DeltaAttempts:
    """The newest attempt seen per (turn, step): a delta of an older one belongs to a dead attempt."""

    def __init__(self) -> None:
        self._newest: dict[tuple[str | None, str | None], int] = {}

    def stale(self, event: FollowedEvent) -> bool:
        """True for a delta of an older attempt at its step than one seen before; remembers newer ones."""
        attempt = event.attempt
        if attempt is None:
            return False  # a worker that does not say: nothing to compare
        key = (event.turn_id, event.step)
        newest = self._newest.get(key, 0)
        if attempt < newest:
            return True
        self._newest[key] = attempt
        return False


class FollowState:
    """Position, filter and deadline of one follow."""

    def __init__(
        self,
        stream: str,
        *,
        turn_id: str | None,
        last_id: str,
        block_ms: int,
        timeout_s: float | None,
        include_deltas: bool,
        last_seq: int | None = None,
        reload: str = "the store",
    ) -> None:
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must not be negative, not {timeout_s}")
        if last_seq is not None and (not isinstance(last_seq, int) or last_seq < 0):
            raise ValueError(f"last_seq must be a seq you hold (an int >= 0), not {last_seq!r}")
        self.stream = stream
        self.turn_id = turn_id
        self.last_id = last_id
        self.block_ms = block_ms
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.include_deltas = include_deltas
        self.last_seq = last_seq  # the highest structural seq held; None: not known until the start check
        self.reload = reload
        self.gap: Gap | None = None
        self.lost = False  # the start id is from no copy of the stream here: check the first structural seq
        self.done = False
        self.attempts = DeltaAttempts()

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
        """Take what the start check found (:func:`._gaps.judge_start`) and, when it was suspect, the entries
        after the start id: the seq held, and a gap at the start."""
        self.last_seq, self.gap = start.settle(after) if start.suspect else (start.anchor, None)
        self.lost = start.lost and not start.suspect

    def raise_gap(self) -> None:
        if self.gap is not None:
            raise self.gap.error(self.reload)

    def take(self, response: Any) -> list[FollowedEvent]:
        """The events of one XREAD reply this follow yields; sets ``done`` after the turn's terminal event and
        ``gap`` (stopping before it) at a seq jump."""
        out: list[FollowedEvent] = []
        for stream, entry_id, fields in entries(response):
            before, self.last_id = self.last_id, entry_id
            event = decode_entry(stream, entry_id, fields)
            if event is None:
                continue
            if event.delta:
                if not self.include_deltas or self.attempts.stale(event):
                    continue
            else:
                seq = event.seq
                if seq is not None and self.last_seq is None and self.lost:
                    self.lost, self.gap = False, lost_start(self.stream, before, entry_id, seq)
                    if self.gap is not None:
                        self.last_id = before
                        break
                if seq is not None and self.last_seq is not None:
                    if seq <= self.last_seq:
                        continue  # the same event again, in a stream rebuilt from the store
                    if seq > self.last_seq + 1:
                        self.gap = jump(self.stream, before, entry_id, self.last_seq, seq)
                        self.last_id = before
                        break
                if seq is not None:
                    self.last_seq = seq
            if self.turn_id is not None and event.turn_id != self.turn_id:
                continue
            out.append(event)
            if self.turn_id is not None and event.terminal:
                self.done = True
                break
        return out
