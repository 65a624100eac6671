"""What the worker host keeps for each session and turn it runs: the claim (:class:`_Running`, one per session
per process, with the gate every release runs under), a running turn's cancel probe (:class:`_Cancel`, set from
any thread) and the store as that turn sees it (:class:`_Ending`: its ending commit also releases the lease
or marks the delivery due). Used by :mod:`.host` only.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine.events import TurnEvent
from ..engine.store import (
    UNFINISHED_TURN_STATUSES,
    Commit,
    CommitBuilder,
    SessionRef,
)

if TYPE_CHECKING:
    from .host import WorkerHost

__all__ = ["_Cancel", "_Ending", "_Running"]


class _Cancel:
    """A running turn's cancel probe; set from other threads (control listener, heartbeat).

    The reason is seen at once, from any thread (the turn reads it at its next checkpoint, whatever holds the
    loop); only the callback that interrupts a wait (a model stream) runs on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, reason: str | None) -> None:
        self._loop = loop
        self._reason = reason
        self._callback: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def reason(self) -> str | None:
        return self._reason

    def on_cancel(self, callback: Callable[[], None] | None) -> None:
        with self._lock:
            self._callback = callback

    def set(self, reason: str) -> None:
        with self._lock:
            if self._reason is not None:
                return
            self._reason = reason

        def apply() -> None:  # on the loop's thread, like every engine call
            with self._lock:
                callback, self._callback = self._callback, None
            if callback is not None:
                callback()

        self._loop.call_soon_threadsafe(apply)


class _Ending:
    """The store as the worker's turn sees it: the commit that ends the turn does more in its statement.

    ``release``: it also gives the lease up when the session has nothing else queued, which
    saves the release its own statement (a round trip and a disk flush). ``released`` says
    whether it did; None when no such commit ran (the turn had ended before, or its ending
    failed). ``deliver_due``: it marks the turn due for delivery to its target, so a crash
    before the delivery leaves the mark for the sweeper (``ended`` says the mark was set).
    A releasing commit runs under the session's gate (:class:`_Running`), like every release.
    Everything else is the store's own.
    """

    def __init__(self, host: WorkerHost, running: _Running, turn_id: str, *, release: bool, deliver_due: bool) -> None:
        self._host = host
        self._store = host.store
        self._running = running
        self._turn_id = turn_id
        self._release = release
        self._deliver_due = deliver_due
        self.released: bool | None = None
        self.ended = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def commit(self, ref: SessionRef, commit: Commit | CommitBuilder, *, fence: int | None = None) -> list[TurnEvent]:
        if (
            isinstance(commit, Commit)
            and fence is not None
            and commit.turn_id == self._turn_id
            and commit.turn_status is not None
            and commit.turn_status not in UNFINISHED_TURN_STATUSES
        ):
            if not self._release:
                events, _ = self._store.commit_ending(
                    ref, commit, fence=fence, release=False, deliver_due=self._deliver_due
                )
                self.ended = True
                return events
            with self._running.gate:
                events, released = self._store.commit_ending(
                    ref, commit, fence=fence, release=True, deliver_due=self._deliver_due
                )
                if released:
                    self._host._let_go_lease(self._running)
            self.ended = True
            self.released = released
            return events
        return self._store.commit(ref, commit, fence=fence)


@dataclass(eq=False)
class _Running:
    """A session a thread of this process works on (took, or is taking, its lease), from its claim to its end.

    Set before the lease is taken, so that a cancel signal that arrives while the next turn is being picked is
    kept (``signalled``) and seen when that turn starts. One claim per session per process: other threads that
    get a message of the session record its turn and leave it to this one (the session's turns run one at a time;
    a second lease taken under the same owner would fence the first). Every statement that may give the lease up
    runs under ``gate`` and, when it did, ends ``draining``, so that a thread recording a turn meanwhile either
    sees the holder still draining once the gate is free (the holder's release failed on its turn: the holder
    runs it) or takes the session itself."""

    ref: SessionRef
    fence: int | None = None
    turn_id: str | None = None
    cancel: _Cancel | None = None
    signalled: dict[str, str] = field(default_factory=dict)
    draining: bool = True
    gate: threading.Lock = field(default_factory=threading.Lock)
    thread: int = field(default_factory=threading.get_ident)
    """The thread that claimed it."""
