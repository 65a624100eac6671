"""The workers' rule for strings no store can hold, for what a durable producer records.

Two characters cannot be stored: a **NUL** (Postgres text refuses it, and its JSON operators
refuse ``\\u0000``) and a **lone surrogate** (``"\\udcff"``, what ``surrogateescape`` makes of
bytes that are not UTF-8; it has no UTF-8 encoding, and the workers cannot read a record that
holds one). A worker refuses a message holding either; a durable producer must refuse it too,
before recording, since Postgres' ``json`` type takes both escapes and a record the workers
cannot use would sit in their queue.

The rule a reader must not break: **this is a copy of** ``unstorable_reason`` **in
june_worker/engine/storable.py** (producers import nothing of june_worker);
``tests/producers/test_durable.py`` checks that the two agree.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["unstorable_reason"]

_BAD = re.compile("[\x00\ud800-\udfff]")


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
