"""Turn ids: ``t_`` + a ULID, minted by whoever enqueues the turn, so a resend is the same turn."""

from __future__ import annotations

import os
import re
import time

__all__ = ["new_turn_id", "validate_session_id"]

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_SESSION_RE = re.compile(r"^[\x21-\x7e]{1,256}$")


def _ulid() -> str:
    value = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def new_turn_id() -> str:
    """A fresh, time-ordered, globally unique turn id."""
    return f"t_{_ulid()}"


def validate_session_id(session: str, *, what: str = "session key") -> str:
    """Session ids and agent names are printable ASCII without spaces: they end up in keys and headers."""
    if not isinstance(session, str) or not _SESSION_RE.match(session):
        raise ValueError(f"invalid {what} {session!r}: use 1-256 printable ASCII characters, no spaces or line breaks")
    return session
