"""Turn ids, minted by whoever enqueues the turn so a resend is the same turn, and the names a message may carry.

A turn id is ``t_`` + a ULID: 26 Crockford base32 characters, 48 bits of Unix milliseconds, then
80 random bits. The rule a reader must not break: **ids minted by one process sort in the order
they were minted** (S54), also many in one millisecond, from many threads, or while the clock is
behind the last id: then the last timestamp is kept and the random part counts up by one (the ULID
spec's monotonic mode); a random part that would overflow carries into the next millisecond. A
forked child (a Celery prefork pool process, a web server's worker) starts afresh: it would
otherwise count up from its parent's last id, as would each of its siblings, and two of them could
mint the same id. One process has one sequence, whether the engine or a producer mints.

Names (:data:`AGENT_NAME`, :data:`SESSION_ID`, :data:`TURN_ID`) end up in Redis keys, HTTP paths
and headers; a value must match its rule whole (a trailing line break included).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "AGENT_NAME",
    "CROCKFORD",
    "SENT_AT_HEADER",
    "SESSION_ID",
    "TURN_ID",
    "MonotonicUlid",
    "NameRule",
    "new_turn_id",
    "ulid",
]

SENT_AT_HEADER = "june_sent_at"
"""The ``june.turn`` message header a producer stamps with when it sent the turn (epoch seconds, as text): a header,
not a payload field, so that a worker older than the stamp ignores it instead of refusing the message."""

CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_RANDOM_BITS = 80
_RANDOM_MAX = (1 << _RANDOM_BITS) - 1
_TIME_MAX = (1 << 48) - 1


def _clock_ms() -> int:
    return time.time_ns() // 1_000_000


def _random80() -> int:
    return int.from_bytes(os.urandom(_RANDOM_BITS // 8), "big")


class MonotonicUlid:
    """A thread-safe source of ULIDs in mint order; ``clock_ms`` and ``random80`` are seams for tests."""

    def __init__(self, clock_ms: Callable[[], int] = _clock_ms, random80: Callable[[], int] = _random80) -> None:
        self._clock_ms = clock_ms
        self._random80 = random80
        self._lock = threading.Lock()
        self._ms = -1
        self._random = 0

    def reseed(self) -> None:
        """Forget the last id: the next one draws a fresh random part (a forked child must not share its parent's)."""
        self._lock = threading.Lock()  # the parent's may have been held by a thread that does not exist here
        self._ms, self._random = -1, 0

    def __call__(self) -> str:
        with self._lock:
            now = self._clock_ms()
            if now > self._ms:
                ms, rand = now, self._random80() & _RANDOM_MAX
            elif self._random < _RANDOM_MAX:
                ms, rand = self._ms, self._random + 1  # same millisecond, or the clock stepped back: count up
            else:
                ms, rand = self._ms + 1, self._random80() & _RANDOM_MAX
            if not 0 <= ms <= _TIME_MAX:
                raise ValueError(f"clock value {ms} ms does not fit a ULID's 48-bit timestamp")
            self._ms, self._random = ms, rand
        value = (ms << _RANDOM_BITS) | rand
        return "".join(CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))


ulid = MonotonicUlid()
"""The process-wide generator: one sequence, so every id this process mints sorts in mint order."""
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=ulid.reseed)


def new_turn_id() -> str:
    """A fresh, globally unique turn id, ``t_`` + a ULID, that sorts after every id this process minted before."""
    return f"t_{ulid()}"


@dataclass(frozen=True, slots=True)
class NameRule:
    """What one kind of name may be: a pattern the whole value matches, and how to say so."""

    pattern: re.Pattern[str]
    expected: str

    def check(self, value: object, what: str) -> str:
        """``value`` if it is such a name; else a ValueError naming ``what`` was wrong and what was expected."""
        if not isinstance(value, str) or not self.pattern.fullmatch(value):
            raise ValueError(f"invalid {what} {value!r}: expected {self.expected}")
        return value


AGENT_NAME = NameRule(re.compile(r"[A-Za-z0-9_.\-]{1,128}"), "1-128 characters of A-Z a-z 0-9 _ . -")
"""An agent's name, as a worker takes it in a message."""
SESSION_ID = NameRule(re.compile(r"[\x21-\x7e]{1,256}"), "1-256 printable ASCII characters, no spaces or line breaks")
"""A session id (the app's): printable ASCII without spaces."""
TURN_ID = NameRule(re.compile(r"[A-Za-z0-9_.:\-]{1,128}"), "1-128 characters of A-Z a-z 0-9 _ . : -")
"""A turn id a producer gives (a resend of an earlier turn, or an id derived from a channel's message)."""
