"""The session-id rule as the engine applies it (agent names and session ids); the rule itself lives in
:mod:`june_wire.ids`, with turn-id minting.

The rule a reader must not break: turn ids are minted by :func:`june_wire.ids.new_turn_id` only, so that
the engine and a producer in one process share one sequence (ids sort in mint order, S54).
"""

from __future__ import annotations

from june_wire.ids import SESSION_ID

__all__ = ["validate_session_id"]


def validate_session_id(session: str, *, what: str = "session key") -> str:
    """Session ids and agent names are printable ASCII without spaces: they end up in keys and headers."""
    return SESSION_ID.check(session, what)
