"""Turn ids: ``t_`` + a ULID (26 characters of Crockford base32: 48 bits of milliseconds, 80 random bits).

The rule a reader must not break: **ids minted by one process sort in the order they were
minted**, also within one millisecond and when the clock steps back. Within a millisecond (or
while the clock is behind the last id) the next id keeps the last timestamp and adds one to
the random part, as the ULID spec's monotonic mode does; if the random part would overflow,
the timestamp moves one millisecond ahead instead.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

__all__ = ["CROCKFORD", "UlidGenerator", "new_turn_id", "ulid"]

CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_RANDOM_BITS = 80
_RANDOM_MAX = (1 << _RANDOM_BITS) - 1
_TIME_MAX = (1 << 48) - 1


def _encode(value: int) -> str:
    chars = []
    for _ in range(26):
        chars.append(CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _random80() -> int:
    return int.from_bytes(os.urandom(10), "big")


class UlidGenerator:
    """Mints monotonic ULIDs; thread-safe. ``clock_ms`` and ``random80`` are seams for tests."""

    def __init__(
        self,
        clock_ms: Callable[[], int] = _now_ms,
        random80: Callable[[], int] = _random80,
    ) -> None:
        self._clock_ms = clock_ms
        self._random80 = random80
        self._lock = threading.Lock()
        self._last_ms = -1
        self._last_random = 0

    def reseed(self) -> None:
        """Forget the last id: the next one draws a fresh random part (a forked child must not share its parent's)."""
        self._lock = threading.Lock()  # the parent's may have been held by a thread that does not exist here
        self._last_ms, self._last_random = -1, 0

    def __call__(self) -> str:
        with self._lock:
            ms = self._clock_ms()
            if ms > self._last_ms:
                rand = self._random80() & _RANDOM_MAX
            elif self._last_random < _RANDOM_MAX:
                ms, rand = self._last_ms, self._last_random + 1
            else:
                ms, rand = self._last_ms + 1, self._random80() & _RANDOM_MAX
            if not 0 <= ms <= _TIME_MAX:
                raise ValueError(f"clock value {ms} ms does not fit a ULID's 48-bit timestamp")
            self._last_ms, self._last_random = ms, rand
        return _encode((ms << _RANDOM_BITS) | rand)


ulid = UlidGenerator()
"""The process-wide generator: one sequence, so every id this process mints sorts in mint order."""
if hasattr(os, "register_at_fork"):  # POSIX: a forked producer (a prefork pool, gunicorn) mints on its own
    os.register_at_fork(after_in_child=ulid.reseed)


def new_turn_id() -> str:
    """A fresh turn id, ``t_`` + a ULID: unique, and ordered by creation time within this process."""
    return f"t_{ulid()}"
