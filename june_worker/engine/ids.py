"""Turn ids: ``t_`` + a ULID, minted by whoever enqueues the turn, so a resend is the same turn.

A ULID is 26 Crockford base32 characters: 48 bits of Unix milliseconds, then 80 random bits.
The rule a reader must not break: **ids minted by one process sort in the order they were
minted** (S54), also many in one millisecond, from many threads, or while the clock is behind
the last id: then the last timestamp is kept and the random part counts up by one (the ULID
spec's monotonic mode); a random part that would overflow carries into the next millisecond.
A forked child (a Celery prefork pool process) starts afresh: it would otherwise count up from its
parent's last id, as would each of its siblings, and two of them could mint the same id.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable

__all__ = ["MonotonicUlid", "new_turn_id", "validate_session_id"]

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_SESSION_RE = re.compile(r"^[\x21-\x7e]{1,256}$")
_RANDOM_BITS = 80
_RANDOM_MAX = (1 << _RANDOM_BITS) - 1


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
                self._ms, self._random = now, self._random80() & _RANDOM_MAX
            elif self._random < _RANDOM_MAX:
                self._random += 1  # same millisecond, or the clock stepped back: count up
            else:
                self._ms, self._random = self._ms + 1, self._random80() & _RANDOM_MAX
            value = (self._ms << _RANDOM_BITS) | self._random
        return "".join(_CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))


_mint = MonotonicUlid()
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_mint.reseed)


def new_turn_id() -> str:
    """A fresh, globally unique turn id that sorts after every id this process minted before."""
    return f"t_{_mint()}"


def validate_session_id(session: str, *, what: str = "session key") -> str:
    """Session ids and agent names are printable ASCII without spaces: they end up in keys and headers."""
    if not isinstance(session, str) or not _SESSION_RE.match(session):
        raise ValueError(f"invalid {what} {session!r}: use 1-256 printable ASCII characters, no spaces or line breaks")
    return session
