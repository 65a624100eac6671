"""Events as a producer sees them: one entry of a session's Redis Stream, decoded to a plain dict.

A session's events live in the stream ``<prefix>:events:{<agent>:<session>}`` (literal
braces: a Redis Cluster hash tag). Each entry has two fields: ``type`` and ``data``, the event
as JSON with snake_case fields, among them ``agent``, ``session``, ``turn_id`` and, for
structural events, the per-session ``seq``. Producers do not validate events against the
engine's models (they import nothing of the engine): an event type they do not know is passed
through as it came. The format is the wire protocol's (:mod:`june_wire.events`, where these
names live); this module is where a producer's user finds them.

The rule a reader must not break: **resume from the last ``stream_id`` you handled**, never
from a ``seq``: deltas carry no seq, and stream ids are what XREAD understands.
"""

from __future__ import annotations

from june_wire.events import DELTA_TYPES, TERMINAL_TYPES, FollowedEvent

__all__ = ["DELTA_TYPES", "TERMINAL_TYPES", "FollowedEvent"]
