"""The EventSink seam's Redis side: key names, the stream sink (with its outbox relay), readers.

:mod:`june_wire.keys` (key names) needs nothing but the standard library; the rest needs the ``redis``
extra and is imported on first use, so ``from june_worker.events import EventKeys`` works without it.
This package imports no celery and no psycopg.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from june_wire.keys import DEFAULT_KEYS, EventKeys

if TYPE_CHECKING:
    from .reader import (
        StreamEvent,
        ack,
        afollow,
        claim_stale,
        ensure_group,
        follow,
        read_firehose,
        read_group,
    )
    from .redis_stream import RedisStreamSink, Trim

__all__ = [
    "DEFAULT_KEYS",
    "EventKeys",
    "RedisStreamSink",
    "StreamEvent",
    "Trim",
    "ack",
    "afollow",
    "claim_stale",
    "ensure_group",
    "follow",
    "read_firehose",
    "read_group",
]

_LAZY = {
    "RedisStreamSink": "redis_stream",
    "Trim": "redis_stream",
    "StreamEvent": "reader",
    "ack": "reader",
    "afollow": "reader",
    "claim_stale": "reader",
    "ensure_group": "reader",
    "follow": "reader",
    "read_firehose": "reader",
    "read_group": "reader",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{module}", __name__), name)
