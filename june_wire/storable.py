"""Making foreign strings storable: what tools, models and exceptions hand us must fit Postgres, SQLite and JSON.

Two things no store can hold: a **lone surrogate** (``"\\udcff"``, what Python's
``surrogateescape`` makes of a non-UTF-8 file name; it has no UTF-8 encoding) and a **NUL**
character (Postgres text refuses it, and its JSON operators refuse ``\\u0000``). Both are
replaced by U+FFFD, the Unicode replacement character. A third hazard is an exception whose
``__str__`` raises: :func:`safe_str` falls back to the class name.

The rule a reader must not break: **every string that reaches a commit from outside the
engine's own code passes through here first** (tool results and errors, model replies, error
reports). Payloads from producers are *refused* instead (:func:`unstorable_reason`): a user's
text is not ours to alter. A worker refuses a message holding either; a durable producer refuses
it before recording (Postgres' ``json`` type takes both escapes, and a record the workers cannot
read would sit in their queue): both by this one rule.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = [
    "REPLACEMENT",
    "json_text",
    "safe_str",
    "storable_json",
    "storable_json_text",
    "storable_text",
    "unstorable_reason",
]

REPLACEMENT = "\ufffd"
_BAD = re.compile("[\x00\ud800-\udfff]")


def storable_text(text: str) -> str:
    """``text`` with every NUL and lone surrogate replaced by U+FFFD; the same object when it has none."""
    if text.isascii():
        return text.replace("\x00", REPLACEMENT) if "\x00" in text else text
    return _BAD.sub(REPLACEMENT, text)


def storable_json(value: Any) -> Any:
    """A JSON value (``dict``/``list``/``str``/numbers) with :func:`storable_text` applied to every string and key.

    Returns ``value`` itself when nothing needs replacing (the common case costs one walk, which builds no
    field paths: only :func:`unstorable_reason` names where the bad character is).
    """
    if _clean(value):
        return value
    return _rebuild(value)


_JSON_TEXT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def json_text(value: Any) -> str:
    """``value`` as compact JSON, non-ASCII as it is, refusing NaN and infinities (ValueError): what the stores
    write and the checks of a step's values read. (One encoder, made once: ``json.dumps`` makes one per call
    with these options, about half of its cost on a small value.)"""
    return _JSON_TEXT.encode(value)


def storable_json_text(text: str) -> bool:
    """True when the value whose JSON ``text`` this is (made without escaping non-ASCII, as :func:`json_text`
    and pydantic do) has no NUL and no lone surrogate: JSON writes a NUL as ``\\u0000``
    and a lone surrogate as it is. (A string that holds a backslash and ``u0000`` reads as a NUL here: the
    caller then walks the value, which finds there is none.)"""
    if "\\u0000" in text:
        return False
    return text.isascii() or _BAD.search(text) is None


def _clean(value: Any) -> bool:
    """True if no string or key in ``value`` holds a NUL or a lone surrogate: the check of
    :func:`unstorable_reason` without the path it reports, which a step's commit need not build."""
    if isinstance(value, str):
        return "\x00" not in value if value.isascii() else _BAD.search(value) is None
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and not _clean(k):
                return False
            if not _clean(v):
                return False
    elif isinstance(value, list | tuple):
        for v in value:
            if not _clean(v):
                return False
    return True


def _rebuild(value: Any) -> Any:
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_text(k) if isinstance(k, str) else k: _rebuild(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_rebuild(v) for v in value]
    return value


def safe_str(exc: BaseException) -> str:
    """``str(exc)`` made storable; the class name when ``__str__`` raises or says nothing."""
    try:
        text = str(exc)
    except Exception:
        return type(exc).__name__
    return storable_text(text) if text else type(exc).__name__


def unstorable_reason(value: Any, where: str = "") -> str | None:
    """Why ``value`` (a JSON-like payload) cannot be stored as it is, naming the first bad field; None if it can."""
    if isinstance(value, str):
        bad = _BAD.search(value)
        if bad is None:
            return None
        char = bad.group()
        what = "a NUL character" if char == "\x00" else f"a lone surrogate (U+{ord(char):04X})"
        return f"{where or '(payload)'}: contains {what} at index {bad.start()}, which cannot be stored"
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and (reason := unstorable_reason(k, f"{where or '(payload)'} (a key)")):
                return reason
            path = f"{where}.{k}" if where else str(k)
            if reason := unstorable_reason(v, path):
                return reason
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            if reason := unstorable_reason(v, f"{where}[{i}]"):
                return reason
    return None
