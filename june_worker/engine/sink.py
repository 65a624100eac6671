"""The EventSink seam: where a turn's events go once they exist.

The engine calls :meth:`EventSink.publish` with structural events only *after* their
commit (they carry their ``seq``), and :meth:`EventSink.publish_delta` with live tokens as
they stream. Rule: a sink must never raise into the turn. A sink that cannot deliver
(Redis down) logs and drops; structural events stay in the store's outbox and are
relayed later, deltas are best-effort by design.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .events import TurnEvent
from .store import SessionRef

__all__ = ["EventSink", "NullSink"]


class EventSink(Protocol):
    def publish(self, ref: SessionRef, events: Sequence[TurnEvent]) -> None:
        """Deliver committed structural events, in ``seq`` order."""
        ...

    def publish_delta(self, ref: SessionRef, event: TurnEvent) -> None:
        """Deliver one live delta; never stored, never re-sent."""
        ...


class NullSink:
    """Drops everything; for hosts that only read results."""

    def publish(self, ref: SessionRef, events: Sequence[TurnEvent]) -> None:
        return None

    def publish_delta(self, ref: SessionRef, event: TurnEvent) -> None:
        return None
