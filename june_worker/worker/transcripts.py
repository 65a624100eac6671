"""Recently used transcripts, held in a worker's memory so that a turn reads only what is new.

A turn runs on the session's whole transcript (the model is sent all of it, or all of it since the
last compaction). Reading it from Postgres at every turn would make a turn's cost grow with the
session's history; instead a worker keeps the transcripts of the sessions it ran lately (a bounded
LRU: :class:`TranscriptCache`), each as ``(generation, messages)``, and its next read of the
session (the intake, or :meth:`~june_worker.worker.queue.SessionQueue.read`) asks only for the
messages after those: ``held_params`` are the read's parameters.

The rule a reader must not break: **what is held is used only if the read says it is valid**, and
the read decides that in the same statement (and snapshot) in which it reads the rest. It is valid
when the session's generation is the one held (a reset starts a new one) and the stored message at
the last held index was written by the turn held there. Within a generation messages are only ever
appended, each index written once (a duplicate index fails its commit), so a held prefix that
passes is the stored one, whatever other workers committed since. What is put here is only ever
what committed: the snapshot read from Postgres, and the messages a turn appended after its commits
returned. Anything unusual (a run that raised, a reset performed here) drops the entry instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from psycopg.types.numeric import Int4

from ..engine.store import SessionRef
from ..engine.types import Message

__all__ = ["Held", "TranscriptCache", "held_params"]


@dataclass(frozen=True)
class Held:
    """The first ``len(messages)`` messages of generation ``generation`` of a session's transcript."""

    generation: int
    messages: list[Message]
    """Never changed in place: a new list goes in with every :meth:`TranscriptCache.put`."""
    size: int = 0
    """Their approximate size: the characters of their JSON (the objects themselves take a few times that)."""


def _size(message: Message) -> int:
    return len(message.model_dump_json())


_NOTHING = {"g": Int4(-1), "have": Int4(0), "last": ""}


def held_params(held: Held | None) -> dict[str, Any]:
    """The parameters ``g``, ``have`` and ``last`` of ``june_transcript`` (and ``june_intake``) for ``held``."""
    if held is None or not held.messages:
        return dict(_NOTHING)
    return {"g": Int4(held.generation), "have": Int4(len(held.messages)), "last": held.messages[-1].turn_id}


class TranscriptCache:
    """At most ``max_sessions`` transcripts, ``max_messages`` messages and about ``max_bytes`` of them in all
    (:attr:`Held.size`), least recently used out first.

    ``max_sessions=0`` turns it off. A transcript past ``max_messages`` or ``max_bytes`` alone is not kept. Safe
    to share between threads (a thread pool's tasks): every method takes the lock, and entries are never changed
    in place. ``hits`` and ``misses`` count :meth:`get` calls, for tests and benches.

    A transcript's size is measured once per message: a put that extends what is held (the same generation, the
    held messages its prefix) measures only the messages added, so a turn's cost stays flat in the history.
    """

    def __init__(self, *, max_sessions: int, max_messages: int, max_bytes: int = 32_000_000) -> None:
        self.max_sessions = max_sessions
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._entries: OrderedDict[SessionRef, Held] = OrderedDict()
        self._count = 0
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def messages(self) -> int:
        """How many messages are held in all."""
        return self._count

    @property
    def bytes(self) -> int:
        """About how much they take in all (:attr:`Held.size`)."""
        return self._bytes

    def get(self, ref: SessionRef) -> Held | None:
        with self._lock:
            held = self._entries.get(ref)
            if held is None:
                self.misses += 1
                return None
            self._entries.move_to_end(ref)
            self.hits += 1
            return held

    def put(self, ref: SessionRef, generation: int, messages: list[Message]) -> None:
        """Hold ``messages`` (committed, in order from index 0) as generation ``generation`` of ``ref``'s transcript."""
        with self._lock:
            before = self._pop(ref)
            if self.max_sessions <= 0 or len(messages) > self.max_messages:
                return
            n, size = 0, 0
            if before is not None and before.generation == generation and 0 < len(before.messages) <= len(messages):
                if messages[len(before.messages) - 1] is before.messages[-1]:  # it extends what was held
                    n, size = len(before.messages), before.size
            size += sum(map(_size, messages[n:]))
            if size > self.max_bytes:
                return
            self._entries[ref] = Held(generation=generation, messages=messages, size=size)
            self._count += len(messages)
            self._bytes += size
            while (
                len(self._entries) > self.max_sessions
                or self._count > self.max_messages
                or self._bytes > self.max_bytes
            ):
                self._pop(next(iter(self._entries)))

    def drop(self, ref: SessionRef) -> None:
        with self._lock:
            self._pop(ref)

    def _pop(self, ref: SessionRef) -> Held | None:
        held = self._entries.pop(ref, None)
        if held is not None:
            self._count -= len(held.messages)
            self._bytes -= held.size
        return held
