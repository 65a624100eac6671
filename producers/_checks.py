"""What a producer checks in a call's arguments before anything is sent, and the summary a message shows.

Names are checked by the workers' own rules (:mod:`june_wire.ids`), so a bad name fails at the call
instead of as a rejection on the worker; texts, ids and JSON values by the bounds the workers' payloads
take. Each check returns the value it was given, or raises a ``ValueError`` naming what was wrong and
what was expected.

The rule a reader must not break: **a message's summary (its ``argsrepr``, what Flower and worker logs
show) holds ids only** (:func:`summary`), never the text, an inbound event, an answer's value or anything
else that could hold a secret.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from june_wire.ids import AGENT_NAME, SESSION_ID, TURN_ID

__all__ = [
    "MAX_TEXT",
    "agent",
    "bounded",
    "json_object",
    "json_value",
    "positive_timeout",
    "session",
    "stream_id",
    "summary",
    "turn_id",
]

MAX_TEXT = 200_000
_STREAM_ID = re.compile(r"\d+(-\d+)?|\$")


def agent(value: object) -> str:
    return AGENT_NAME.check(value, "agent name")


def session(value: object) -> str:
    return SESSION_ID.check(value, "session id")


def turn_id(value: object) -> str:
    return TURN_ID.check(value, "turn id")


def stream_id(value: object) -> str:
    """A position to follow from: a stream id (``1700000000000-0``), ``0-0`` or ``$``."""
    if not isinstance(value, str) or not _STREAM_ID.fullmatch(value):
        raise ValueError(f"invalid last_id {value!r}: expected a stream id such as 1700000000000-0, 0-0 or $")
    return value


def bounded(value: object, what: str, *, low: int, high: int) -> str:
    if not isinstance(value, str) or not low <= len(value) <= high:
        raise ValueError(f"invalid {what}: expected a string of {low}-{high} characters")
    return value


def json_object(value: Mapping[str, Any] | None, what: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"invalid {what}: expected a JSON object (a mapping), got {type(value).__name__}")
    json_value(value, what)
    return dict(value)


def json_value(value: Any, what: str) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid {what}: it does not serialize to JSON ({exc})") from None
    return value


def positive_timeout(value: float) -> float:
    if not value > 0:
        raise ValueError(f"timeout_s must be positive, not {value}")
    return value


def summary(**fields: str | None) -> str:
    """The ``argsrepr`` of a message: ids only, the turn's first, ``{turn_id=t_... agent=ops session=s1}`` (Flower
    cuts a long arguments cell at its end: the id a person searches for must be what shows)."""
    first = {"turn_id": fields.pop("turn_id")} if "turn_id" in fields else {}
    return "{" + " ".join(f"{k}={v}" for k, v in {**first, **fields}.items() if v is not None) + "}"
