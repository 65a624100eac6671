"""The Postgres commit statement: one checkpoint as ONE data-modifying statement (a CTE).

``upd`` updates the session row only if the fencing token (and the expected park) match,
bumps ``event_seq`` (and sets ``relay_due`` when the commit has events) and returns it; every
other part selects ``from upd``, so it writes nothing unless ``upd`` returned the row. What
``upd`` returns is the whole answer on the happy path; when it returns nothing the caller asks
why, off the happy path. A plain step (no status, park, turn status or release) leaves the
row's indexed columns as they were, so its update is a HOT one (migration 16 of ``_pg_schema``).

The statement is specialised to the commit's *shape* (which parts it has, how many rows of
each) and cached: a shape the engine repeats every step (one message, one step, one or two
events) is a short statement whose rows are plain parameters, prepared once per connection.
Past :data:`VALUES_MAX` rows, a part's rows travel as two parameters zipped with ``ROWS
FROM``: the small columns as one JSON array of arrays, the JSON documents joined by newlines
(compact JSON never holds a raw newline). The documents never pass through a JSON operator,
which would refuse a ``\\u0000`` in them.

Event bodies are sent without their leading ``{``; the statement puts ``{"seq":<n>,`` in
front, since the sequence number is known only once the session row is updated.

With ``release`` (a fenced commit that ends its turn), ``upd`` also gives the session's lease
up, unless another turn is queued or running or one was recorded after the statement's
snapshot (``next_position`` moved: the same guard as the worker queue's release). It then
returns whether the lease is free as a second column.

With ``deliver_due`` (the commit that ends a turn with a delivery target), the turn row is marked
due for delivery in the same statement; the worker clears the mark once the agent's ``deliver``
hook ran, and its sweeper re-sends a turn whose mark stayed (at-least-once delivery).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

from psycopg.types.numeric import Int8

from ..engine.events import TurnEvent
from ..engine.store import Commit, SessionRef
from ._sql import dumps, message_body

__all__ = ["NOTHING_NEW", "VALUES_MAX", "commit_statement", "event_rest"]

NOTHING_NEW = (
    "s.next_position = (select s2.next_position from june_sessions s2"
    " where s2.agent = %(agent)s::text and s2.session = %(session)s::text)"
)
"""Part of every lease release (here and in the worker's queue), on the session row ``s``: no turn
was recorded after the statement's snapshot. Every enqueue bumps ``next_position``; the row's
re-check sees the newest value while this scalar subquery keeps the snapshot's (a NOT EXISTS on
the turns alone would still read the old snapshot)."""

VALUES_MAX = 4
"""Up to this many rows of a part are sent as plain parameters; more go as JSON arrays."""


class _Shape(NamedTuple):
    messages: int
    steps: int
    events: int
    status: bool
    suspended: str  # "keep" | "set" | "repark" | "clear"
    fenced: bool
    expect: bool
    expired: bool
    turn: bool
    not_cancelled: bool
    turn_error: bool
    cancel: bool
    release: bool
    deliver: bool


def commit_statement(
    ref: SessionRef, commit: Commit, fence: int | None, *, release: bool = False, deliver_due: bool = False
) -> tuple[str, dict[str, Any]]:
    """The statement for this commit and its parameters; ``release``, ``deliver_due``: see the module docstring."""
    messages, steps, events = commit.messages, commit.steps, commit.events
    turn = commit.turn_id is not None and commit.turn_status is not None
    if release and (fence is None or not turn):
        raise ValueError("only a fenced commit that sets its turn's status can release the lease")
    if deliver_due and not turn:
        raise ValueError("only a commit that sets its turn's status can make its delivery due")
    shape = _Shape(
        messages=_count(len(messages)),
        steps=_count(len(steps)),
        events=_count(len(events)),
        status=commit.status is not None,
        suspended=(
            # a park rewritten by an answer that left others open (it expects the park) is the same park, with
            # or without an expiry to carry (repark_from): its expiry and its age still count from when it began
            ("repark" if commit.repark_from is not None or commit.expect_suspended is not None else "set")
            if commit.suspended is not None
            else "clear"
            if commit.clear_suspended
            else "keep"
        ),
        fenced=fence is not None,
        expect=commit.expect_suspended is not None,
        expired=commit.expect_expired,
        turn=turn,
        not_cancelled=commit.expect_not_cancelled and commit.turn_id is not None,
        turn_error=commit.turn_error is not None and commit.turn_id is not None,
        cancel=commit.cancel_reason is not None and commit.turn_id is not None,
        release=release,
        deliver=deliver_due,
    )
    p: dict[str, Any] = {"agent": ref.agent, "session": ref.session, "n_events": Int8(len(events))}
    if fence is not None:
        p["fence"] = Int8(fence)  # one parameter type whatever the value: one prepared statement
    if commit.status is not None:
        p["status"] = commit.status
    if commit.suspended is not None:
        p["suspended"] = commit.suspended.model_dump_json(by_alias=True)
        p["park_timeout"] = commit.suspended.park_timeout()
        if commit.repark_from is not None or commit.expect_suspended is not None:
            p["repark_from"] = commit.repark_from
    if commit.expect_suspended is not None:
        p["exp_turn"], p["exp_input"] = commit.expect_suspended
        p["exp_version"] = commit.expect_version
    _rows(
        p,
        "m",
        shape.messages,
        [(Int8(i), m.turn_id, m.role) for i, m in messages],
        [message_body(m) for _, m in messages],
    )
    _rows(p, "s", shape.steps, [(s.step_id, s.turn_id) for s in steps], [dumps(s.data) for s in steps])
    _rows(
        p,
        "e",
        shape.events,
        [(e.turn_id, e.type) for e in events],
        [event_rest(e) for e in events],
    )
    if commit.turn_id is not None:
        p["t_id"] = commit.turn_id
    if turn:
        p["t_status"] = commit.turn_status
        p["t_count"] = int(commit.count_attempt)
        p["t_result"] = commit.turn_result.model_dump_json(by_alias=True) if commit.turn_result is not None else None
    if shape.turn_error:
        p["t_error"] = commit.turn_error
    if shape.cancel:
        p["t_cancel"] = commit.cancel_reason
    return _sql(shape), p


def event_rest(event: TurnEvent) -> str:
    """An event's JSON as a statement sends it: without its ``seq`` and its leading ``{`` (the statement puts
    ``{"seq":<n>,`` in front once it knows the number)."""
    return event.model_dump_json(by_alias=True, exclude={"seq"})[1:]


def _count(n: int) -> int:
    return n if n <= VALUES_MAX else VALUES_MAX + 1


def _keys(prefix: str, width: int) -> list[tuple[str, ...]]:
    return [tuple(f"{prefix}{i}_{j}" for j in range(width)) + (f"{prefix}{i}_doc",) for i in range(VALUES_MAX)]


_KEYS = {"m": _keys("m", 3), "s": _keys("s", 2), "e": _keys("e", 2)}
"""Parameter names of the VALUES rows, made once: this runs on every step."""


def _rows(p: dict[str, Any], prefix: str, shape: int, small: Sequence[tuple[Any, ...]], docs: list[str]) -> None:
    if shape == 0:
        return
    if shape <= VALUES_MAX:
        for keys, cols, doc in zip(_KEYS[prefix], small, docs, strict=False):
            p.update(zip(keys, (*cols, doc), strict=True))
        return
    p[f"{prefix}_small"] = "[" + ",".join("[" + ",".join(_json_scalar(v) for v in cols) + "]" for cols in small) + "]"
    p[f"{prefix}_docs"] = "\n".join(docs)


def _json_scalar(value: Any) -> str:
    return str(int(value)) if isinstance(value, int) else dumps(value)


# --- the SQL, per shape ----------------------------------------------------------------------------------


def _source(prefix: str, n: int, columns: list[tuple[str, str]], doc: str, *, ordinal: bool = False) -> str:
    """A row source ``v(<columns>, <doc>[, n])``: a VALUES list, or JSON arrays zipped with ROWS FROM."""
    names = [c for c, _ in columns] + [doc] + (["n"] if ordinal else [])
    if n <= VALUES_MAX:
        rows = []
        for i in range(n):
            cells = [f"%({prefix}{i}_{j})s::{t}" for j, (_, t) in enumerate(columns)]
            cells.append(f"%({prefix}{i}_doc)s::text")
            if ordinal:
                cells.append(str(i + 1))
            rows.append("(" + ", ".join(cells) + ")")
        return f"(values {', '.join(rows)}) as v({', '.join(names)})"
    small = ", ".join(f"(r.small->>{j})::{t} as {c}" for j, (c, t) in enumerate(columns))
    return (
        f"(select {small}, r.{doc}{', r.n' if ordinal else ''} from rows from ("
        f"json_array_elements(%({prefix}_small)s::json), unnest(string_to_array(%({prefix}_docs)s::text, E'\\n'))"
        f"){' with ordinality' if ordinal else ''} as r(small, {doc}{', n' if ordinal else ''})) as v"
    )


@functools.lru_cache(maxsize=256)
def _sql(shape: _Shape) -> str:
    sets = ["event_seq = s.event_seq + %(n_events)s::bigint"]
    if shape.events:
        sets.append("relay_due = true")  # already set in a turn's later steps: the update stays HOT
    if shape.status or shape.suspended != "keep" or shape.turn or shape.release:
        sets.append("updated_at = extract(epoch from now())")  # an indexed column: not moved by a plain step
    if shape.status:
        sets.append("status = %(status)s::text")
    if shape.suspended == "set":
        sets.append("suspended = %(suspended)s::json")
        sets.append("park_expires_at = extract(epoch from now()) + %(park_timeout)s::float8")
        sets.append("parked_at = extract(epoch from now())")
    elif shape.suspended == "repark":  # the same park, fewer requests: its expiry and its age still count from the park
        sets.append("suspended = %(suspended)s::json")
        sets.append("park_expires_at = s.park_expires_at - %(repark_from)s::float8 + %(park_timeout)s::float8")
    elif shape.suspended == "clear":
        sets.append("suspended = null, park_expires_at = null, parked_at = null")
    if shape.release:
        free = (
            "not s.reset_pending and not exists (select 1 from june_turns t where t.agent = s.agent and t.session = s.session"
            f" and t.status in ('queued', 'running') and t.turn_id <> %(t_id)s::text) and {NOTHING_NEW}"
        )
        sets.append(f"lease_owner = case when {free} then null else s.lease_owner end")
        sets.append(f"lease_expires = case when {free} then null else s.lease_expires end")
    where = ["s.agent = %(agent)s::text", "s.session = %(session)s::text"]
    if shape.fenced:
        where.append("s.fence = %(fence)s::bigint")
    if shape.expect:
        where.append("s.suspended->>'turn_id' = %(exp_turn)s::text")
        where.append("coalesce((s.suspended->>'version')::integer, 0) = %(exp_version)s::integer")
        where.append(
            "(s.suspended->'request'->>'id' = %(exp_input)s::text or exists (select 1 from "
            "json_array_elements(coalesce(s.suspended->'more', '[]'::json)) o where o->'request'->>'id' = %(exp_input)s::text))"
        )
    if shape.expired:
        where.append("s.park_expires_at <= extract(epoch from now())")
    refused = []  # the turn's own state that refuses the commit: it ended, or (opening) a cancel is stored
    if shape.turn:
        refused.append("g.status in ('completed', 'failed', 'cancelled', 'rejected')")
    if shape.not_cancelled:
        refused.append("g.cancel_reason is not null")
    if refused:
        where.append(
            "not exists (select 1 from june_turns g where g.agent = %(agent)s::text and g.session = %(session)s::text"
            f" and g.turn_id = %(t_id)s::text and ({' or '.join(refused)}))"
        )
    returning = "s.event_seq, s.lease_owner is null as released" if shape.release else "s.event_seq"
    parts = [
        f"upd as (\n    update june_sessions s set {', '.join(sets)}\n    where {' and '.join(where)}\n"
        f"    returning {returning}\n)"
    ]
    if shape.messages:
        source = _source("m", shape.messages, [("idx", "integer"), ("turn_id", "text"), ("role", "text")], "body")
        parts.append(
            "msgs as (\n    insert into june_messages (agent, session, idx, turn_id, role, body)\n"
            "    select %(agent)s::text, %(session)s::text, v.idx, v.turn_id, v.role, v.body::json\n"
            f"    from upd, {source}\n)"
        )
    if shape.steps:
        source = _source("s", shape.steps, [("step_id", "text"), ("turn_id", "text")], "data")
        parts.append(
            "steps as (\n    insert into june_steps (agent, session, step_id, turn_id, data)\n"
            "    select %(agent)s::text, %(session)s::text, v.step_id, v.turn_id, v.data::json\n"
            f"    from upd, {source}\n    on conflict do nothing\n)"
        )
    if shape.events:
        source = _source("e", shape.events, [("turn_id", "text"), ("type", "text")], "rest", ordinal=True)
        seq = "(upd.event_seq - %(n_events)s::bigint + v.n)"
        parts.append(
            "evs as (\n    insert into june_events (agent, session, seq, turn_id, type, body)\n"
            f"    select %(agent)s::text, %(session)s::text, {seq}, v.turn_id, v.type,\n"
            f"        ('{{\"seq\":' || {seq} || ',' || v.rest)::json\n"
            f"    from upd, {source}\n)"
        )
    if shape.turn or shape.turn_error or shape.cancel:
        sets_t = []
        if shape.turn:
            sets_t += [
                "status = %(t_status)s::text",
                "result = %(t_result)s::json",
                # a start counts an attempt (unless its host counted it when it picked the turn: t_count 0); a
                # resume (queued again) starts the count over
                "attempts = case %(t_status)s::text when 'running' then t.attempts + %(t_count)s::integer"
                " when 'queued' then 0"
                " else t.attempts end",
                "finished_at = case when %(t_status)s::text in ('queued', 'running') then null"
                " else extract(epoch from now()) end",
            ]
        if shape.turn_error:
            sets_t.append("last_error = %(t_error)s::text")
        if shape.cancel:  # a mark already there stays; an ended turn keeps none (t.status: before this statement)
            sets_t.append(
                "cancel_reason = case when t.status in ('completed', 'failed', 'cancelled', 'rejected')"
                " then t.cancel_reason else coalesce(t.cancel_reason, %(t_cancel)s::text) end"
            )
        if shape.deliver:
            sets_t.append("deliver_due = true, delivery_attempts = 0")
        parts.append(
            f"turn as (\n    update june_turns t set {', '.join(sets_t)}\n    from upd\n"
            "    where t.agent = %(agent)s::text and t.session = %(session)s::text and t.turn_id = %(t_id)s::text\n)"
        )
    return "with " + ", ".join(parts) + f"\nselect {'event_seq, released' if shape.release else 'event_seq'} from upd"
