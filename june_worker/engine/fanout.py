"""FanoutSink: delivers a session's events to in-process observers, then to an optional next sink.

An observer that raises is logged and kept; it never breaks the turn that emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .events import TurnEvent, is_structural
from .secrets import scrubbed_logger
from .sink import EventSink
from .store import SessionRef

__all__ = ["FanoutSink", "Observer"]

log = scrubbed_logger("june_worker.events")

Observer = Callable[[TurnEvent], object]


@dataclass(eq=False)
class _Subscription:
    callback: Observer
    turn_id: str | None
    after_seq: int


class FanoutSink:
    def __init__(self, downstream: EventSink | None = None) -> None:
        self.downstream = downstream
        self._subs: dict[SessionRef, list[_Subscription]] = {}

    def subscribe(
        self, ref: SessionRef, callback: Observer, *, turn_id: str | None = None, after_seq: int = 0
    ) -> Callable[[], None]:
        """Observe a session (or one turn); structural events with ``seq <= after_seq`` are skipped."""
        sub = _Subscription(callback, turn_id, after_seq)
        self._subs.setdefault(ref, []).append(sub)

        def unsubscribe() -> None:
            subs = self._subs.get(ref, [])
            if sub in subs:
                subs.remove(sub)

        return unsubscribe

    def _deliver(self, ref: SessionRef, event: TurnEvent) -> None:
        for sub in list(self._subs.get(ref, ())):
            if sub.turn_id is not None and sub.turn_id != event.turn_id:
                continue
            if is_structural(event) and (event.seq or 0) <= sub.after_seq:
                continue
            try:
                sub.callback(event)
            except Exception:
                log.exception("observer of %s raised on %s; ignored", ref, event.type)

    def publish(self, ref: SessionRef, events: Sequence[TurnEvent]) -> None:
        for event in events:
            self._deliver(ref, event)
        if self.downstream is not None:
            try:
                self.downstream.publish(ref, events)
            except Exception:
                log.exception("event sink failed for %s; events stay in the store's log", ref)

    def publish_delta(self, ref: SessionRef, event: TurnEvent) -> None:
        self._deliver(ref, event)
        if self.downstream is not None:
            try:
                self.downstream.publish_delta(ref, event)
            except Exception:
                log.exception("event sink failed for a delta of %s; dropped", ref)
