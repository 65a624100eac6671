"""Rendering a turn to its target from the worker that runs it: live while it runs, at least once when it ended.

For a turn with a ``target`` whose agent's ``deliver`` hook is a :class:`~june_worker.channels.Channels`:

* :func:`start_live` makes the run's renderer (the turn's committed events so far and its
  :class:`PgRenderState` go with it) and, when the channel renders live, a :class:`LiveRender`:
  a thread that takes the turn's events from a tee in front of the turn's sink and pushes them to
  the channel, at most every ``interval_s`` (a run's end at once). The turn never waits for the
  channel: the tee only queues.
* :func:`deliver_once` is the at-least-once part, called where the worker delivers a turn whose
  delivery is due (:meth:`~june_worker.worker.host.WorkerHost.deliver`): the renderer's ``finish``
  on the turn's stored events. A failure the failure policy calls transient keeps the delivery due
  (the sweeper sends the turn again); any other is logged and the delivery given up.

Any other ``deliver`` hook is called as before (:func:`~june_worker.engine.agent.deliver_result`).

The rule a reader must not break: **nothing here raises into the turn**.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from psycopg_pool import ConnectionPool

from ..channels.base import Channels, RenderContext, Renderer
from ..engine.agent import Agent, deliver_result
from ..engine.events import TurnEvent, TurnResult, is_structural
from ..engine.failures import Failure, classify
from ..engine.secrets import scrubbed_logger
from ..engine.sink import EventSink
from ..engine.store import SessionRef, TurnRecord
from ..engine.types import JsonValue
from ..errors import ChannelError
from ..stores._pg_conn import pooled
from ..stores.postgres import PostgresStore

__all__ = ["LiveRender", "PgRenderState", "deliver_once", "notify", "start_live"]

log = scrubbed_logger("june_worker.worker")

_STOP = object()
LIVE_DRAIN_S = 30.0
"""How long the end of a turn waits for its live renderer to push what is queued before delivery goes on."""
LIVE_ABORT_S = 120.0
"""Then, the renderer stopped, how long it waits for the channel call still in flight (its retries included)."""


class PgRenderState:
    """A turn's render state in ``june_channel_renders`` (migration 7): one row per slot, written at once."""

    def __init__(self, pool: ConnectionPool[Any], ref: SessionRef, turn_id: str) -> None:
        self.pool, self.ref, self.turn_id = pool, ref, turn_id
        self._slots: dict[str, dict[str, JsonValue]] | None = None

    def _load(self) -> dict[str, dict[str, JsonValue]]:
        if self._slots is None:
            with pooled(self.pool) as conn:
                rows = conn.execute(
                    "select slot, data::text from june_channel_renders where agent = %s and session = %s "
                    "and turn_id = %s",
                    (self.ref.agent, self.ref.session, self.turn_id),
                ).fetchall()
            self._slots = {slot: json.loads(data) for slot, data in rows}
        return self._slots

    def get(self, slot: str) -> dict[str, JsonValue] | None:
        found = self._load().get(slot)
        return dict(found) if found is not None else None

    def put(self, slot: str, data: dict[str, JsonValue]) -> None:
        with pooled(self.pool) as conn:
            conn.execute(
                "insert into june_channel_renders (agent, session, turn_id, slot, data) values (%s, %s, %s, %s, %s) "
                "on conflict (agent, session, turn_id, slot) do update set data = excluded.data",
                (self.ref.agent, self.ref.session, self.turn_id, slot, json.dumps(data)),
            )
        self._load()[slot] = dict(data)


def _context(agent: Agent, store: PostgresStore, ref: SessionRef, turn_id: str, *, history: bool) -> RenderContext:
    return RenderContext(
        agent=agent.name,
        session=ref.session,
        turn_id=turn_id,
        state=PgRenderState(store.pool, ref, turn_id),
        history=store.events(ref, turn_id=turn_id) if history else [],
    )


class LiveRender:
    """One run's live renderer on a thread of its own, fed through :meth:`tee`."""

    def __init__(self, renderer: Renderer, turn_id: str) -> None:
        self.renderer = renderer
        self.turn_id = turn_id
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"june-render-{turn_id[:24]}", daemon=True)
        self._thread.start()

    def tee(self, sink: EventSink) -> _Tee:
        return _Tee(sink, self)

    def put(self, events: Sequence[TurnEvent]) -> None:
        for event in events:
            self._queue.put(event)

    def close(self, timeout_s: float = LIVE_DRAIN_S, *, abort_wait_s: float = LIVE_ABORT_S) -> None:
        """Push what is queued, then stop; the delivery converges whatever is left, and must run alone.

        Waits at most ``timeout_s`` for the pushes. A renderer still busy then (a Slack call sleeping on a long
        ``Retry-After``) is aborted: it makes no call after the one in flight, which is waited for (at most
        ``abort_wait_s``) so that what it posts is recorded before the delivery reads the render state.
        """
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            return
        abort = getattr(self.renderer, "abort", None)  # (a channel's renderer written before the seam had it)
        try:
            if abort is not None:
                abort()
        except Exception:  # a renderer's bug must not stop the turn's ending: its delivery, its parent's answer
            log.exception("live rendering of turn %s could not be aborted", self.turn_id)
        log.warning("live rendering of turn %s is still busy after %.0fs; stopped, the delivery finishes it",
                    self.turn_id, timeout_s)  # fmt: skip
        self._thread.join(abort_wait_s)
        if self._thread.is_alive():
            log.error("live rendering of turn %s is still in a call after %.0fs more; delivery goes on beside it",
                      self.turn_id, abort_wait_s)  # fmt: skip

    def _run(self) -> None:
        interval = max(0.0, self.renderer.interval_s)
        dirty, last = False, 0.0
        while True:
            wait = None if not dirty else max(0.0, last + interval - time.monotonic())
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            urgent = item is _STOP
            if item is not None and item is not _STOP:
                try:
                    self.renderer.feed(item)  # type: ignore[arg-type]
                except Exception:  # a renderer's bug must not stop the turn, nor this thread's draining
                    log.exception("live rendering of turn %s could not take an event", self.turn_id)
                dirty = True
                urgent = is_structural(item)  # type: ignore[arg-type]
            if dirty and (urgent or time.monotonic() - last >= interval):
                try:
                    self.renderer.push()
                except Exception:
                    log.exception("live rendering of turn %s failed; the delivery finishes it", self.turn_id)
                dirty, last = False, time.monotonic()
            if item is _STOP:
                return


class _Tee:
    """The turn's sink, plus a copy of every event for the live renderer (queued: never waits on it)."""

    def __init__(self, inner: EventSink, live: LiveRender) -> None:
        self.inner, self.live = inner, live

    def publish(self, ref: SessionRef, events: Sequence[TurnEvent]) -> None:
        self.inner.publish(ref, events)
        self.live.put(events)

    def publish_delta(self, ref: SessionRef, event: TurnEvent) -> None:
        self.inner.publish_delta(ref, event)
        self.live.put([event])


def start_live(agent: Agent, store: PostgresStore, ref: SessionRef, rec: TurnRecord) -> LiveRender | None:
    """The run's live renderer, if the turn has a target on a channel that renders live; None otherwise."""
    target = rec.payload.target
    if target is None or not isinstance(agent.deliver, Channels):
        return None
    try:
        renderer = agent.deliver.renderer(target, _context(agent, store, ref, rec.turn_id, history=True))
    except Exception as exc:  # a bad target, the store: the turn runs anyway, its delivery says what went wrong
        log.warning("turn %s of %s is not rendered live: %s", rec.turn_id, ref, exc)
        return None
    return LiveRender(renderer, rec.turn_id) if renderer.live else None


def deliver_once(
    agent: Agent, store: PostgresStore, ref: SessionRef, rec: TurnRecord, result: TurnResult,
    run: Callable[[Coroutine[Any, Any, None]], None],
) -> bool:  # fmt: skip
    """Render the ended turn to its target; True when done (or not worth another attempt), False to try again.

    ``run`` runs an agent's own ``deliver`` hook (a coroutine) to its end on the worker's loop."""
    target = rec.payload.target
    if target is None:
        return False
    events = store.events(ref, turn_id=rec.turn_id)
    if not isinstance(agent.deliver, Channels):
        run(deliver_result(agent, target=target, result=result, events=events, session=ref.session))
        return True
    try:
        agent.deliver.renderer(target, _context(agent, store, ref, rec.turn_id, history=False)).finish(events, result)
    except ChannelError as exc:
        if classify(exc, phase="channel") is Failure.TRANSIENT:
            log.warning("delivering turn %s of %s: %s; it is tried again", rec.turn_id, ref, exc)
            return False
        log.error("delivering turn %s of %s failed for good: %s (method %s, code %s)", rec.turn_id, ref, exc,
                  exc.method or "-", exc.code or "-")  # fmt: skip
        return True
    return True


def notify(agent: Agent, target: dict[str, JsonValue], text: str) -> None:
    """Tell the person ``target`` names a short note through the agent's channel, if it has one. Never raises."""
    if not isinstance(agent.deliver, Channels):
        return
    try:
        agent.deliver.notify(target, text)
    except Exception as exc:
        kind = classify(exc, phase="channel")
        log.warning("could not tell %s a note (%s, %s)", target.get("channel"), type(exc).__name__, kind.value)
