"""What the operator console reads from Postgres: sessions, the approvals inbox, failed turns, a turn's timeline.

Every list is a page of at most ``limit`` rows in a fixed order, and the next page starts after
the last row of this one (keyset pagination: a cursor, never an offset), along an index of its
own (migrations 9, 12 and 15): ``june_sessions_activity`` (newest activity first), ``june_sessions_parked``
(longest waiting first, by ``parked_at``), ``june_turns_failed`` (latest first). So a page costs the same at the
10,000th session as at the first (bench/console.py). Lists show the agents the caller sees only.

Failed turns include the **rejected** ones (refused at intake: an unknown agent, a payload no worker
can use, a parked session), with ``status: "rejected"``, phase ``intake`` and their reason as the
error. A session is shown ``rejected`` when every turn of its generation was rejected (and it has
one): its row stays ``new``, which the engine and the store read as "nothing opened it", so its
next turn runs as in any new session; the rule is ``june_turns_all_rejected`` (migration 15).

A cursor is the last row's sort key, as base64url JSON: opaque to clients, checked when read
(a cursor that does not parse is a 422 naming it).

The rule a reader must not break: **a console read never returns message text or tool
arguments**: ids, statuses, times, prompts of pending input (what an approver must read), tool
names, and error messages (what an operator must read).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from typing import Any

from ..engine.children import parse_child_input
from ..engine.types import InputRequest, PolicyAnswerer, UserAnswerer
from .auth import Principal

__all__ = [
    "BadCursor",
    "answerers_text",
    "decode_cursor",
    "encode_cursor",
    "failed_page",
    "inbox_page",
    "may_answer",
    "sessions_page",
    "session_turns",
    "timeline",
]

SESSION_STATUSES = ("new", "running", "suspended", "done", "rejected")
"""The statuses the console shows a session in: the row's, and ``rejected`` (see the module docstring)."""

# --- the statements, whole -----------------------------------------------------------------------------

_SESSION_COLUMNS = """s.agent, s.session,
       case when s.status = 'new' and june_turns_all_rejected(s.agent, s.session, s.generation) then 'rejected'
            else s.status end,
       s.updated_at, s.suspended is not null, s.lease_owner is not null, s.generation, s.reset_pending"""

_SESSIONS_FIRST = f"""
select {_SESSION_COLUMNS}
  from june_sessions s
 where s.agent = any(%(agents)s::text[])
 order by s.updated_at desc, s.agent desc, s.session desc
 limit %(limit)s
"""

_SESSIONS_AFTER = f"""
select {_SESSION_COLUMNS}
  from june_sessions s
 where (s.updated_at, s.agent, s.session) < (%(at)s::float8, %(agent)s::text, %(session)s::text)
   and s.agent = any(%(agents)s::text[])
 order by s.updated_at desc, s.agent desc, s.session desc
 limit %(limit)s
"""

# One status: the row's (`stored`: `new` for new and rejected), and for a new row whether its turns were all
# rejected (`rejected`); the rule is read for new rows only, so the other statuses cost what the row's status does.
_SESSIONS_BY_STATUS_FIRST = f"""
select {_SESSION_COLUMNS}
  from june_sessions s
 where s.agent = any(%(agents)s::text[]) and s.status = %(stored)s::text
   and (s.status <> 'new' or june_turns_all_rejected(s.agent, s.session, s.generation) = %(rejected)s::boolean)
 order by s.updated_at desc, s.agent desc, s.session desc
 limit %(limit)s
"""

_SESSIONS_BY_STATUS_AFTER = f"""
select {_SESSION_COLUMNS}
  from june_sessions s
 where (s.updated_at, s.agent, s.session) < (%(at)s::float8, %(agent)s::text, %(session)s::text)
   and s.agent = any(%(agents)s::text[]) and s.status = %(stored)s::text
   and (s.status <> 'new' or june_turns_all_rejected(s.agent, s.session, s.generation) = %(rejected)s::boolean)
 order by s.updated_at desc, s.agent desc, s.session desc
 limit %(limit)s
"""

_INBOX_FIRST = """
select s.agent, s.session, s.parked_at, s.suspended::text, s.park_expires_at, s.reset_pending
  from june_sessions s
 where s.suspended is not null and s.agent = any(%(agents)s::text[])
 order by s.parked_at, s.agent, s.session
 limit %(limit)s
"""

_INBOX_AFTER = """
select s.agent, s.session, s.parked_at, s.suspended::text, s.park_expires_at, s.reset_pending
  from june_sessions s
 where s.suspended is not null
   and (s.parked_at, s.agent, s.session) > (%(at)s::float8, %(agent)s::text, %(session)s::text)
   and s.agent = any(%(agents)s::text[])
 order by s.parked_at, s.agent, s.session
 limit %(limit)s
"""

_FAILED_COLUMNS = """t.agent, t.session, t.turn_id, t.status, t.finished_at, t.attempts,
       case when t.status = 'rejected' then 'intake' else t.result->>'phase' end, t.result->>'step',
       t.result->'error'->>'type', coalesce(t.result->'error'->>'message', t.result->>'reason')"""

_FAILED_FIRST = f"""
select {_FAILED_COLUMNS}
  from june_turns t
 where t.status in ('failed', 'rejected') and t.agent = any(%(agents)s::text[])
 order by t.finished_at desc, t.agent desc, t.session desc, t.turn_id desc
 limit %(limit)s
"""

_FAILED_AFTER = f"""
select {_FAILED_COLUMNS}
  from june_turns t
 where t.status in ('failed', 'rejected')
   and (t.finished_at, t.agent, t.session, t.turn_id) < (%(at)s::float8, %(agent)s::text, %(session)s::text, %(turn)s::text)
   and t.agent = any(%(agents)s::text[])
 order by t.finished_at desc, t.agent desc, t.session desc, t.turn_id desc
 limit %(limit)s
"""

_SESSION_TURNS = """
select t.turn_id, t.position, t.status, t.created_at, t.finished_at, t.attempts
  from june_turns t
 where t.agent = %(agent)s and t.session = %(session)s
 order by t.position desc
 limit %(limit)s
"""

_TURN = """
select t.turn_id, t.position, t.status, t.created_at, t.finished_at, t.attempts, t.last_error, t.cancel_reason,
       case when t.status = 'rejected' then 'intake' else t.result->>'phase' end, t.result->>'step',
       t.result->'error'->>'type', coalesce(t.result->'error'->>'message', t.result->>'reason'),
       extract(epoch from now())
  from june_turns t
 where t.agent = %(agent)s and t.session = %(session)s and t.turn_id = %(turn)s
"""

_TURN_EVENTS = """
select e.seq, e.type, e.created_at, e.body::text
  from june_events e
 where e.agent = %(agent)s and e.session = %(session)s and e.turn_id = %(turn)s
 order by e.seq
"""

_TURN_STEPS = """
select st.step_id, st.data::text
  from june_steps st
 where st.agent = %(agent)s and st.session = %(session)s and st.turn_id = %(turn)s
"""


class BadCursor(ValueError):
    """A ``cursor`` that this console did not make."""


def encode_cursor(key: Sequence[Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key), separators=(",", ":")).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, width: int) -> list[Any]:
    """The sort key a cursor holds: ``[time, agent, session, ...]`` with ``width`` entries."""
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, binascii.Error):
        raise BadCursor("cursor is not one this console made") from None
    if (
        not isinstance(key, list)
        or len(key) != width
        or not isinstance(key[0], int | float)
        or not all(isinstance(k, str) for k in key[1:])
    ):
        raise BadCursor("cursor is not one this console made")
    return key


def _page(rows: list[Any], limit: int, key: Any) -> tuple[list[Any], str | None]:
    """The page's rows and the cursor of the next page (None: this is the last)."""
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    return rows, encode_cursor(key(rows[-1]))


# --- the lists -------------------------------------------------------------------------------------


def sessions_page(
    conn: Any, agents: list[str], status: str | None, limit: int, cursor: str | None
) -> tuple[list[dict[str, Any]], str | None]:
    """Sessions, most recent activity first (``updated_at``: the last turn opening, park, answer, end or
    reset); of one status if given."""
    params: dict[str, Any] = {"agents": agents, "limit": limit + 1}
    if status is not None:
        params["stored"], params["rejected"] = ("new" if status == "rejected" else status), status == "rejected"
    if cursor is not None:
        params["at"], params["agent"], params["session"] = decode_cursor(cursor, 3)
    statement = {
        (False, False): _SESSIONS_FIRST, (False, True): _SESSIONS_AFTER,
        (True, False): _SESSIONS_BY_STATUS_FIRST, (True, True): _SESSIONS_BY_STATUS_AFTER,
    }[(status is not None, cursor is not None)]  # fmt: skip
    rows = conn.execute(statement, params).fetchall()
    rows, nxt = _page(rows, limit, lambda r: (r[3], r[0], r[1]))
    items = [
        {
            "agent": a, "session": s, "status": shown, "last_activity": at, "parked": parked, "held": held,
            "generation": generation, "reset_pending": reset_pending,
        }
        for a, s, shown, at, parked, held, generation, reset_pending in rows
    ]  # fmt: skip
    return items, nxt


def answerers_text(request: InputRequest) -> str:
    """Who may answer, in words."""
    who = request.answerers
    if who is None:
        return "anyone who may use the session"
    if isinstance(who, UserAnswerer):
        return f"user {who.user}"
    return f"policy {who.policy}" + (f" (scope {who.scope})" if who.scope else "")


def may_answer(request: InputRequest, principal: Principal) -> bool | None:
    """Whether ``principal`` may answer: True, False, or None when the agent's ``authorize_answer`` decides."""
    who = request.answerers
    if who is None:
        return True
    if isinstance(who, UserAnswerer):
        return who.user == principal.id
    assert isinstance(who, PolicyAnswerer)
    return None


def inbox_page(
    conn: Any, agents: list[str], principal: Principal, limit: int, cursor: str | None, now: float
) -> tuple[list[dict[str, Any]], str | None]:
    """Parked sessions, longest waiting first: what each waits for (an item per open request), who may answer,
    and since when (``parked_at``, stamped when the park was set: an answer that leaves others open keeps it)."""
    from ..engine.store import SuspendedCheckpoint

    params: dict[str, Any] = {"agents": agents, "limit": limit + 1}
    if cursor is None:
        rows = conn.execute(_INBOX_FIRST, params).fetchall()
    else:
        params["at"], params["agent"], params["session"] = decode_cursor(cursor, 3)
        rows = conn.execute(_INBOX_AFTER, params).fetchall()
    rows, nxt = _page(rows, limit, lambda r: (r[2], r[0], r[1]))
    items = []
    for agent, session, parked_at, suspended, expires_at, reset_pending in rows:
        parked = SuspendedCheckpoint.model_validate_json(suspended).with_expiry(expires_at)
        for open_input in parked.inputs():  # a turn whose calls ran in parallel may wait on several requests
            request = open_input.request
            item = {
                "agent": agent,
                "session": session,
                "turn_id": parked.turn_id,
                "input_id": request.id,
                "prompt": request.prompt,
                "schema": request.json_schema,
                "who_may_answer": answerers_text(request),
                "may_answer": False if reset_pending else may_answer(request, principal),
                "parked_at": parked_at,
                "age_s": max(now - parked_at, 0.0),
                "expires_at": request.expires_at,
            }
            child = parse_child_input(request.id)
            if child is not None:  # a subagent's request: its child turn answers it when it ends, nobody else
                item.update(
                    prompt=f"waiting on child agent {child[0]} (turn {child[1]})",
                    who_may_answer=f"child agent {child[0]}, when its turn ends",
                    may_answer=False,
                    child={"agent": child[0], "turn_id": child[1]},
                )
            items.append(item)
    return items, nxt


def failed_page(
    conn: Any, agents: list[str], limit: int, cursor: str | None
) -> tuple[list[dict[str, Any]], str | None]:
    """Failed and rejected turns, latest first: the phase and step they failed at and their error (a
    rejected turn's: phase ``intake``, no step, its reason)."""
    params: dict[str, Any] = {"agents": agents, "limit": limit + 1}
    if cursor is None:
        rows = conn.execute(_FAILED_FIRST, params).fetchall()
    else:
        params["at"], params["agent"], params["session"], params["turn"] = decode_cursor(cursor, 4)
        rows = conn.execute(_FAILED_AFTER, params).fetchall()
    rows, nxt = _page(rows, limit, lambda r: (r[4], r[0], r[1], r[2]))
    items = [
        {
            "agent": a, "session": s, "turn_id": t, "status": status, "finished_at": at, "attempts": attempts,
            "phase": phase, "step": step, "error_type": error_type, "error": error,
        }
        for a, s, t, status, at, attempts, phase, step, error_type, error in rows
    ]  # fmt: skip
    return items, nxt


def session_turns(conn: Any, agent: str, session: str, limit: int) -> list[dict[str, Any]]:
    """A session's latest turns, newest first."""
    rows = conn.execute(_SESSION_TURNS, {"agent": agent, "session": session, "limit": limit}).fetchall()
    return [
        {"turn_id": t, "position": p, "status": st, "created_at": c, "finished_at": f, "attempts": a}
        for t, p, st, c, f, a in rows
    ]


# --- a turn's timeline ---------------------------------------------------------------------------------


def _summary(kind: str, body: dict[str, Any]) -> str:
    """What an event says, without message text or tool arguments."""
    if kind in ("action.requested", "action.completed"):
        call = body.get("call") or {}
        if kind == "action.completed" and body.get("error"):
            return f"{call.get('name')}: error: {str(body['error'])[:300]}"
        return str(call.get("name", ""))
    if kind == "input.requested":
        request = body.get("request") or {}
        return f"{request.get('id')}: {str(request.get('prompt', ''))[:300]}"
    if kind == "turn.failed":
        error = body.get("error") or {}
        return f"{error.get('type')}: {str(error.get('message', ''))[:300]}"
    if kind == "turn.cancelled":
        return str(body.get("reason", ""))
    if kind == "turn.started":
        trigger = body.get("trigger") or {}
        return str(trigger.get("kind", ""))
    if kind in ("message.completed", "turn.completed"):
        return f"{len(str(body.get('text', '')))} characters"
    if kind == "context.compacted":
        return f"{body.get('summarized')} messages summarised ({body.get('reason')}), kept from {body.get('kept_from')}"
    return ""


def timeline(conn: Any, agent: str, session: str, turn_id: str) -> dict[str, Any] | None:
    """The turn, its committed events with when each landed and how long since the one before, and its steps.

    A step's duration is the time from the commit before it to its own first event's commit (the
    events' ``created_at``, stamped by the database). Steps are the model, tool and input steps, and
    the compaction steps (``compact:<n>``: the summary that replaced the transcript's older part). Events are pruned after
    ``JUNE_OUTBOX_RETENTION_S`` once relayed, so an old turn shows its row and steps only.
    """
    key = {"agent": agent, "session": session, "turn": turn_id}
    row = conn.execute(_TURN, key).fetchone()
    if row is None:
        return None
    tid, position, status, created_at, finished_at, attempts, last_error, cancel, phase, step, etype, emsg, now = row
    events = []
    previous = created_at
    step_took: dict[str, float] = {}
    for seq, kind, at, body_text in conn.execute(_TURN_EVENTS, key).fetchall():
        body = json.loads(body_text)
        event_step = body.get("step")
        took = max(at - previous, 0.0)
        if isinstance(event_step, str) and event_step not in step_took and kind != "action.requested":
            step_took[event_step] = took  # a tool step ends at its action.completed, a model step at its reply
        events.append(
            {"seq": seq, "type": kind, "step": event_step, "at": at, "offset_s": max(at - created_at, 0.0),
             "since_previous_s": took, "summary": _summary(kind, body)}
        )  # fmt: skip
        previous = at
    steps = []
    for step_id, data_text in conn.execute(_TURN_STEPS, key).fetchall():
        if not step_id.startswith(("model:", "tool:", "input:", "compact:")):
            continue  # the session's reserved records (its initiator), not a step of the turn
        data = json.loads(data_text) if data_text else {}
        detail = ""
        if isinstance(data, dict) and step_id.startswith(("model:", "compact:")):
            usage = data.get("usage") or {}
            finish = (data.get("finish") or {}).get("reason")
            detail = f"{usage.get('input_tokens', 0)} in / {usage.get('output_tokens', 0)} out" + (
                f", {finish}" if finish else ""
            )
            if step_id.startswith("compact:"):  # a compaction of the transcript: what it replaced
                detail += f", compacted ~{data.get('tokens_before')} tokens, kept from message {data.get('kept_from')}"
        elif isinstance(data, dict) and data.get("error"):
            detail = f"error: {str(data['error'])[:300]}"
        steps.append({"step": step_id, "duration_s": step_took.get(step_id), "detail": detail})
    steps.sort(key=_step_order)
    return {
        "agent": agent, "session": session, "turn_id": tid, "position": position, "status": status,
        "created_at": created_at, "finished_at": finished_at, "attempts": attempts, "last_error": last_error,
        "cancel_reason": cancel, "phase": phase, "step": step, "error_type": etype, "error": emsg,
        "duration_s": (finished_at or now) - created_at, "events": events, "steps": steps,
    }  # fmt: skip


def _step_order(step: dict[str, Any]) -> tuple[int, str]:
    parts = str(step["step"]).split(":")
    n = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 1 << 30
    return n, str(step["step"])
