"""Pieces the SQL stores share: JSON encoding, event stamping, and ``?`` placeholders for psycopg."""

from __future__ import annotations

from collections.abc import Sequence

from june_wire.storable import json_text

from ..engine.events import TurnEvent
from ..engine.types import Message, MessageAdapter

__all__ = [
    "PSYCOPG_CACHED_QUERY_MAX",
    "dumps",
    "event_rows",
    "message_body",
    "message_from_row",
    "message_text",
    "one_line",
    "qmark_to_format",
]

PSYCOPG_CACHED_QUERY_MAX = 4096
"""psycopg caches its parse of a query (placeholders to ``$n``) only up to this many bytes
(``psycopg._queries.MAX_CACHED_STATEMENT_LENGTH``); a longer one is re-parsed on every execute,
about 0.3 ms of CPU for the intake statement. Statements run per turn stay under it."""


dumps = json_text
"""Compact JSON, non-ASCII as it is, no NaN: :func:`june_wire.storable.json_text`."""


def message_body(message: Message) -> str:
    """What a transcript row's ``body`` holds: the message's JSON without what the row's own columns say
    (``role``, ``turn_id``) and without fields at their defaults (a reply's empty ``tool_calls`` and
    ``reasoning``, a tool result's ``is_error: false``). About a fifth of a short message's row;
    :func:`message_text` puts it back together."""
    return message.model_dump_json(exclude={"role", "turn_id"}, exclude_defaults=True)


def message_text(role: str, turn_id: str, body: str) -> str:
    """A message's whole JSON from a transcript row's ``role``, ``turn_id`` and ``body``: the same text as
    the SQL function ``june_message`` (Postgres migration 14) makes. A row written before the body was
    trimmed holds ``role`` and ``turn_id`` in its body too: the same values twice, which a JSON reader takes
    once (the last of a repeated key wins)."""
    head = f'{{"role":{dumps(role)},"turn_id":{dumps(turn_id)}'
    rest = body.strip()
    return head + "}" if rest == "{}" else f"{head},{rest[1:]}"


def message_from_row(role: str, turn_id: str, body: str) -> Message:
    """The message a transcript row (or an archived one) holds."""
    return MessageAdapter.validate_json(message_text(role, turn_id, body))


def one_line(sql: str) -> str:
    """``sql`` with every run of whitespace made one space: shorter, same meaning (no ``--`` comments or
    quoted text with runs of spaces allowed, which this would change)."""
    if "--" in sql or "'  " in sql:
        raise ValueError("one_line: SQL with a -- comment or spaced literal would change meaning")
    return " ".join(sql.split())


def event_rows(events: Sequence[TurnEvent], last_seq: int) -> tuple[list[TurnEvent], list[tuple[int, str, str, str]]]:
    """Give each event the next ``seq`` after ``last_seq``; return the stamped events and their rows."""
    stamped: list[TurnEvent] = []
    rows: list[tuple[int, str, str, str]] = []
    for i, event in enumerate(events, start=1):
        e = event.model_copy(update={"seq": last_seq + i})
        stamped.append(e)
        rows.append((last_seq + i, e.turn_id, e.type, e.model_dump_json(by_alias=True)))
    return stamped, rows


def qmark_to_format(sql: str) -> str:
    """Rewrite ``?`` placeholders as ``%s`` (and ``%`` as ``%%``), leaving quoted text and comments alone."""
    out: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if ch in ("'", '"'):
            j = i + 1
            while j < n:
                if sql[j] == ch:
                    if j + 1 < n and sql[j + 1] == ch:  # doubled quote inside the literal
                        j += 2
                        continue
                    break
                j += 1
            out.append(sql[i : j + 1].replace("%", "%%"))
            i = j + 1
        elif sql.startswith("--", i):
            j = sql.find("\n", i)
            j = n if j < 0 else j
            out.append(sql[i:j].replace("%", "%%"))
            i = j
        elif ch == "?":
            out.append("%s")
            i += 1
        elif ch == "%":
            out.append("%%")
            i += 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)
