"""One entry of a session's Redis Stream, as the workers write it and every reader decodes it.

An entry has two fields: ``type`` (the event's type) and ``data``, the event as JSON with
snake_case fields, ``agent`` and ``session`` first (:func:`encode_data`), among them ``type``,
``turn_id`` and, for structural events, the per-session ``seq``. Two kinds of event:

* **structural** events (every type but the deltas) carry a ``seq`` (1, 2, 3... without holes in
  the store) and appear once per session stream, in commit order;
* **deltas** (:data:`DELTA_TYPES`) are live tokens: never stored, never re-sent on replay, no
  ``seq``; each carries its ``step`` and ``attempt``.

A turn's stream ends after one of :data:`TERMINAL_TYPES`. Decoding here does not validate an
event against the engine's models: a type this module does not know is passed through as it came
(the engine's reader validates on top, :mod:`june_worker.events.reader`).

The rule a reader must not break: **resume from the last ``stream_id`` you handled**, never from a
``seq``: deltas carry no seq, and stream ids are what XREAD understands.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DELTA_TYPES",
    "TERMINAL_TYPES",
    "FollowedEvent",
    "decode_entry",
    "encode_data",
    "entries",
    "text",
]

TERMINAL_TYPES = frozenset({"turn.completed", "turn.failed", "turn.cancelled", "input.requested"})
"""A turn's stream ends after one of these; ``input.requested`` means the turn parked (it continues after a resume)."""

DELTA_TYPES = frozenset({"message.delta", "reasoning.delta"})
"""Live tokens: never stored, never re-sent on replay, no ``seq``; each carries its ``step`` and ``attempt``."""

_log = logging.getLogger("june_wire.events")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True)
class FollowedEvent:
    """One event read from a session stream: its stream id (the resume token), its type, and its JSON fields."""

    stream_id: str
    type: str
    data: dict[str, Any]

    @property
    def turn_id(self) -> str | None:
        value = self.data.get("turn_id")
        return value if isinstance(value, str) else None

    @property
    def seq(self) -> int | None:
        """The per-session sequence number of a structural event; None for deltas."""
        return _int(self.data.get("seq"))

    @property
    def step(self) -> str | None:
        """The step id (``model:3``, ``tool:3:call_1``) of a delta or a step's event; None for others."""
        value = self.data.get("step")
        return value if isinstance(value, str) else None

    @property
    def attempt(self) -> int | None:
        """Which attempt at the turn a delta belongs to (1, 2...); None for structural events and older workers."""
        return _int(self.data.get("attempt"))

    @property
    def terminal(self) -> bool:
        """True for the events that end a turn's stream (completed, failed, cancelled, or parked)."""
        return self.type in TERMINAL_TYPES

    @property
    def delta(self) -> bool:
        return self.type in DELTA_TYPES

    def to_json(self) -> dict[str, Any]:
        """The event as one flat JSON object: ``stream_id`` first, then its fields (``type`` among them)."""
        return {"stream_id": self.stream_id, **self.data, "type": self.type}


def text(value: Any) -> str:
    """A reply's value as text, whether the client decodes responses or not."""
    return value.decode() if isinstance(value, bytes) else str(value)


def encode_data(agent: str, session: str, event_json: str) -> str:
    """The ``data`` field of an entry: ``event_json`` (one JSON object) with ``agent`` and ``session`` put first."""
    head = _head(agent, session)
    return head if event_json == "{}" else head[:-1] + "," + event_json[1:]


@functools.lru_cache(maxsize=4096)
def _head(agent: str, session: str) -> str:
    """``{"agent":...,"session":...}``, made once per session while it is busy (every event of a turn has it)."""
    return json.dumps({"agent": agent, "session": session}, separators=(",", ":"))


def decode_entry(
    stream: str, entry_id: str, fields: dict[Any, Any] | None, log: logging.Logger = _log
) -> FollowedEvent | None:
    """A stream entry (fields ``type`` and ``data``) as a :class:`FollowedEvent`; None (logged on ``log``) if it
    does not decode."""
    if not fields:
        return None
    decoded = {text(k): v for k, v in fields.items()}
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
    kind = text(kind) if kind is not None else data.get("type")
    if not isinstance(kind, str) or not kind:
        log.warning("skipped entry %s of %s: it has no event type", entry_id, stream)
        return None
    return FollowedEvent(stream_id=entry_id, type=kind, data=data)


def entries(response: Any) -> list[tuple[str, str, dict[Any, Any] | None]]:
    """(stream, id, fields) of an XREAD / XREADGROUP reply, in RESP2 (list) or RESP3 (dict) shape; an entry
    deleted since it was delivered (no id) is left out."""
    if not response:
        return []
    pairs = response.items() if isinstance(response, dict) else response
    out: list[tuple[str, str, dict[Any, Any] | None]] = []
    for stream, items in pairs:
        name = text(stream)
        for entry_id, fields in items:
            if entry_id is not None:
                out.append((name, text(entry_id), fields))
    return out
