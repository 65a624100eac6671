"""Events as a producer sees them: one entry of a session's Redis Stream, decoded to a plain dict.

A session's events live in the stream ``<prefix>:events:{<agent>:<session>}`` (literal
braces: a Redis Cluster hash tag). Each entry has two fields: ``type`` and ``data``, the event
as JSON with snake_case fields, among them ``agent``, ``session``, ``turn_id`` and, for
structural events, the per-session ``seq``. This module does not validate events against
the engine's models (producers import nothing of the engine): an event type it does not know
is passed through as it came.

The rule a reader must not break: **resume from the last ``stream_id`` you handled**, never
from a ``seq``: deltas carry no seq, and stream ids are what XREAD understands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DELTA_TYPES", "TERMINAL_TYPES", "FollowedEvent", "session_stream"]

TERMINAL_TYPES = frozenset({"turn.completed", "turn.failed", "turn.cancelled", "input.requested"})
"""A turn's stream ends after one of these; ``input.requested`` means the turn parked (it continues after a resume)."""

DELTA_TYPES = frozenset({"message.delta", "reasoning.delta"})
"""Live tokens: never stored, never re-sent on replay, no ``seq``; each carries its ``step`` and ``attempt``."""


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
        value = self.data.get("seq")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def step(self) -> str | None:
        """The step id (``model:3``, ``tool:3:call_1``) of a delta or a step's event; None for others."""
        value = self.data.get("step")
        return value if isinstance(value, str) else None

    @property
    def attempt(self) -> int | None:
        """Which attempt at the turn a delta belongs to (1, 2...); None for structural events and older workers."""
        value = self.data.get("attempt")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

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


def session_stream(prefix: str, agent: str, session: str) -> str:
    """The name of a session's stream, exactly as the worker writes it."""
    return f"{prefix}:events:{{{agent}:{session}}}"
