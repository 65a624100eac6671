"""The session queue on Postgres: leases with fencing tokens, the next turn, and what the sweeper finds.

A session's turns run one at a time under its **lease**: ``(owner, expires, fence)`` on the
session row. Taking the lease bumps ``fence``; every step commit carries the fence it was
given and is refused once another worker took over (:class:`~june_worker.errors.LeaseLostError`).

The rule a reader must not break: **the lease is released only by a statement that also
checks the queue is empty** (here, and in the turn's last commit:
:meth:`~june_worker.stores.postgres.PostgresStore.commit_releasing`). A worker that records a
turn and finds the lease taken relies on the holder to run it; the holder's release fails while
that turn is queued, or if it was recorded after the release's snapshot (``next_position``
moved), so the holder loops back and runs it. Nothing is left behind between "queue empty" and
"lease released".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from psycopg_pool import ConnectionPool

from ..engine.failures import DEFAULT_MAX_ATTEMPTS
from ..engine.store import (
    INITIATOR_STEP,
    Commit,
    SessionRef,
    SessionSnapshot,
    SuspendedCheckpoint,
    TurnPayload,
    TurnRecord,
)
from ..errors import UnusableTurnError
from ..stores._pg_commit import NOTHING_NEW, event_rest
from ..stores._pg_conn import pooled
from ..stores._sql import dumps, message_body, one_line
from ..stores.postgres import TURN_WIDTH, session_snapshot, stored_turn, turn_columns, turn_from_row
from .transcripts import Held, held_params

__all__ = ["Intake", "Lease", "SessionQueue", "Stranded"]

_NOW = "extract(epoch from clock_timestamp())"

_PARKED_ON_ENDED_CHILDREN = """
select distinct s.agent, s.session from june_sessions s
 cross join lateral (
       select s.suspended->'request'->>'id' as input_id, s.suspended->>'call_id' as call_id
       union all
       select m->'request'->>'id', m->>'call_id' from json_array_elements(coalesce(s.suspended->'more', '[]')) m
      ) o
  join june_turns c
    on c.agent = split_part(o.input_id, ':', 2)
   and c.session = s.session || ':sub:' || o.call_id || '.' || substr(split_part(o.input_id, ':', 3), 4, 12)
   and c.turn_id = split_part(o.input_id, ':', 3)
 where s.suspended is not null
   and o.input_id like 'child:%%'
   and c.status in ('completed', 'failed', 'cancelled', 'rejected')
 limit %(limit)s
"""
"""Parents with an open child request (``child:<agent>:<turn>``, the first or one of ``more``) naming a turn of
``<session>:sub:<call id>.<12 digits of the child turn id>`` (engine.children.child_session_id) that ended."""
_INTAKE_ATTEMPTS = 3

# A lease may be taken when nobody holds it, when it expired, or when its holder's process is
# no longer alive (its june_workers row lapsed): the fence makes a zombie harmless either way.
_LEASE_IS_FREE = f"""(
    {{s}}.lease_owner is null
    or {{s}}.lease_expires < {_NOW}
    or not exists (select 1 from june_workers w where w.owner = {{s}}.lease_owner and w.alive_until >= {_NOW}))"""


# Intake in one statement: june_intake (migrations 8, 10, 13 and 17 in stores/_pg_schema.py, where the whole statement
# is, with why each part is there) records the turn and takes the lease, and with the lease reads the session: only the
# messages after those the worker holds (`held`), when what it holds is still the session's transcript; and when the
# turn it recorded is the one to run, opens it (the o_* parameters: SessionQueue.intake's `opening`; null: it does not).
_INTAKE = one_line(f"""
select r.recorded, r.took, r.retry, r.fence, r.generation, r.status, r.suspended, r.event_seq, r.reset_pending,
       r.valid, r.compacted_at, r.messages, r.steps, {turn_columns("(r.existing).")}, {turn_columns("(r.first_turn).")},
       r.counted, r.opened_seq, r.opened_idx
  from june_intake(%(agent)s, %(session)s, %(turn_id)s, %(payload)s::json, %(o)s, %(l)s, %(g)s, %(have)s, %(last)s,
                   %(max)s, %(o_role)s, %(o_body)s::json, %(o_event)s, %(o_seat)s::json) r
""")

# The session for its next turn, under a lease already held: what the intake reads with the lease.
_READ = one_line("""
select s.generation, s.status, s.suspended::text, s.event_seq, s.reset_pending, s.park_expires_at,
       tr.valid, tr.compacted_at, tr.messages, tr.steps
  from (select 1) one
  left join june_sessions s on s.agent = %(agent)s and s.session = %(session)s
  cross join june_transcript(%(agent)s, %(session)s, %(g)s, %(have)s, %(last)s) tr
""")

# Take the lease if it is free or already ours (bumping the fence); no row comes back otherwise.
_ACQUIRE = f"""
    insert into june_sessions (agent, session, lease_owner, lease_expires, fence)
    values (%(agent)s, %(session)s, %(o)s, {_NOW} + %(l)s, 1)
    on conflict (agent, session) do update
       set lease_owner = excluded.lease_owner,
           lease_expires = excluded.lease_expires,
           fence = june_sessions.fence + 1
     where june_sessions.lease_owner = excluded.lease_owner or {_LEASE_IS_FREE.format(s="june_sessions")}
"""


def _first_unfinished(agent: str, session: str) -> str:
    """The session's first unfinished turn (queued or running, by position), as a subquery to join laterally;
    ``agent`` and ``session`` are SQL: a placeholder or a column of the outer query."""
    return f"""(
            select * from june_turns t
             where t.agent = {agent} and t.session = {session} and t.status in ('queued', 'running')
             order by t.position limit 1)"""


# A start of the turn a worker picks is counted in the statement that picks it, up to max_attempts: a process that
# dies before the turn's first commit, every time, still uses up its attempts. A turn queued behind a pending
# reset is not counted yet (the holder performs the reset first and picks it again).
_COUNT_FIRST = """
    counted as (
        update june_turns c set attempts = c.attempts + 1
          from first f
         where c.agent = %(agent)s and c.session = %(session)s and c.turn_id = f.turn_id
           and c.attempts < %(max)s and (not f.resetting or f.cancel_reason is not null)
        returning 1
    )"""

# Take the lease and read its first unfinished turn (as it was before this statement), counting its start.
_TAKE = f"""
with acquired as ({_ACQUIRE} returning fence, event_seq, reset_pending),
first as (
    select {turn_columns("t.")}, a.reset_pending as resetting
      from acquired a
      join lateral {_first_unfinished("%(agent)s", "%(session)s")} t on true
), {_COUNT_FIRST}
select a.fence, a.event_seq, a.reset_pending, exists (select 1 from counted), {turn_columns("f.")}
  from acquired a left join first f on true
"""

# Give the lease up if nothing is unfinished and nothing new was recorded; else read the first unfinished turn
# (as it was before this statement) and count its start, all in one snapshot.
_RELEASE_OR_NEXT = f"""
with released as (
    update june_sessions s set lease_owner = null, lease_expires = null
     where s.agent = %(agent)s and s.session = %(session)s and s.fence = %(f)s
       and not s.reset_pending
       and not exists (
            select 1 from june_turns t
             where t.agent = s.agent and t.session = s.session
               and t.status in ('queued', 'running'))
       and {NOTHING_NEW}
    returning 1
),
first as (
    select {turn_columns("t.")}, s.reset_pending as resetting
      from june_sessions s
      join lateral {_first_unfinished("s.agent", "s.session")} t on true
     where s.agent = %(agent)s and s.session = %(session)s and s.fence = %(f)s
       and not exists (select 1 from released)
), {_COUNT_FIRST}
select exists (select 1 from released), s.fence, s.reset_pending, exists (select 1 from counted),
       {turn_columns("f.")}
  from june_sessions s left join first f on true
 where s.agent = %(agent)s and s.session = %(session)s
"""


_NO_OPENING = {"o_role": None, "o_body": None, "o_event": None, "o_seat": None}


def _as_opened(opening: Commit, snapshot: SessionSnapshot, seq: int, idx: int) -> Commit:
    """``opening`` as ``june_intake`` wrote it on ``snapshot`` (the session before it): its message at ``idx``
    (the transcript's end), its event numbered ``seq``, its initiator step only if the session had none."""
    (_, message), (event,) = opening.messages[0], opening.events
    seated = INITIATOR_STEP in snapshot.steps
    return replace(
        opening,
        messages=[(int(idx), message)],
        events=[event.model_copy(update={"seq": int(seq)})],
        steps=[] if seated else opening.steps,
    )


@dataclass(frozen=True)
class Lease:
    """A lease just taken: its fence, the session's committed event count, and its oldest unfinished turn."""

    fence: int
    event_seq: int
    turn: TurnRecord | None
    reset_pending: bool
    snapshot: SessionSnapshot | None = None
    """The session as it stood when the lease was taken, when it was read with it (:meth:`SessionQueue.intake`)."""
    read_from: int = 0
    """The index from which the snapshot's messages were read (those before it were held by the worker)."""
    counted: bool = False
    """Whether the statement that took the lease counted a start of ``turn`` (its ``attempts`` is the count
    before it); not when the turn had its ``max_attempts`` already, or waits for a pending reset."""
    opened: Commit | None = None
    """The opening of ``turn``, committed with the intake (:meth:`SessionQueue.intake`'s ``opening``, placed at
    the transcript's end, its event numbered, its initiator step only if the session had none); ``snapshot`` is
    the session as it was before it."""


@dataclass(frozen=True)
class Intake:
    """What :meth:`SessionQueue.intake` found and did."""

    existing: TurnRecord | None
    """The turn as it stood before this call, if it was recorded already (a redelivery)."""
    parked: SuspendedCheckpoint | None
    """The session's parked checkpoint; a new turn is not recorded while another one is parked."""
    recorded: bool
    lease: Lease | None
    """Taken when a turn is there to run (recorded now, or recorded before and unfinished) and nobody holds it."""
    unusable: UnusableTurnError | None = None
    """Set when the lease was taken for a first turn no worker can run (``lease`` is None then): the caller
    holds the lease (the error's fence), rejects that turn under it and drains the session on."""


@dataclass(frozen=True)
class Stranded:
    """A session with unfinished work and nobody holding it: the sweeper re-sends its first turn."""

    ref: SessionRef
    turn: TurnRecord | None
    """None when the turn's stored record cannot be read (``unusable`` says why): the sweeper rejects it."""
    turn_id: str
    unusable: str | None = None
    """Why no worker can run the turn's record (:func:`~june_worker.stores.postgres.stored_turn`); None: one can."""


def _picked(ref: SessionRef, row: Sequence[Any], fence: int) -> TurnRecord | None:
    """The first turn a pick hands over with the lease (None: there is none). A record no worker can run (a
    durable producer's: unreadable, or holding a string no store holds) raises :class:`UnusableTurnError`,
    for the picker to reject under the lease it now holds: left queued, it would be picked again forever."""
    if row[0] is None:
        return None
    rec, unusable = stored_turn(ref, row)
    if rec is None or unusable is not None:
        raise UnusableTurnError(str(ref), str(row[0]), unusable or "its stored record cannot be read", fence)
    return rec


class SessionQueue:
    def __init__(self, pool: ConnectionPool[Any], *, lease_s: float, max_attempts: int = DEFAULT_MAX_ATTEMPTS) -> None:
        self.pool = pool
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        """Starts of a turn its picks count, at most (the failure policy's poison: the runner gives it up then)."""

    def acquire(self, ref: SessionRef, owner: str) -> int | None:
        """Take the session's lease if it is free, expired or already ours; return the new fence."""
        with pooled(self.pool) as conn:
            row = conn.execute(
                f"{_ACQUIRE} returning fence",
                {"agent": ref.agent, "session": ref.session, "o": owner, "l": self.lease_s},
            ).fetchone()
        return int(row[0]) if row else None

    def take(self, ref: SessionRef, owner: str) -> Lease | None:
        """:meth:`acquire` and :meth:`next_turn` in one round trip, counting a start of that turn
        (:attr:`Lease.counted`); None when another worker holds the session. A turn no worker can run
        raises :class:`UnusableTurnError` (the lease taken: reject it under the error's fence)."""
        with pooled(self.pool) as conn:
            row = conn.execute(
                _TAKE,
                {"agent": ref.agent, "session": ref.session, "o": owner, "l": self.lease_s, "max": self.max_attempts},
            ).fetchone()
        if row is None:
            return None
        fence, event_seq, reset_pending, counted, *turn = row
        rec = _picked(ref, turn, int(fence))
        return Lease(
            fence=int(fence),
            event_seq=int(event_seq),
            turn=rec,
            reset_pending=bool(reset_pending),
            counted=bool(counted),
        )

    def intake(
        self,
        ref: SessionRef,
        turn_id: str,
        payload: TurnPayload,
        owner: str,
        *,
        held: Held | None = None,
        opening: Commit | None = None,
    ) -> Intake:
        """Record a turn and take the session's lease with its snapshot, in one statement (one round trip, one commit).

        The turn is recorded unless it already is, or another turn is parked (the caller rejects
        it then). The lease is taken if there is a turn to run and it is free, expired, held by a
        dead worker or already ours; otherwise its holder runs the turn: recording it made the
        holder's release fail (:data:`~june_worker.stores._pg_commit.NOTHING_NEW`). With the
        lease comes the session as it is now (:attr:`Lease.snapshot`), read in the same
        statement (``june_intake``, migrations 8 and 10): only the messages after ``held`` (what this
        worker holds of the transcript) when the statement finds ``held`` still valid, else all. The
        statement counts a start of the turn the lease is taken for (:attr:`Lease.counted`).

        ``opening`` (:func:`~june_worker.engine.loop.opening_commit`): when the turn is recorded now, the lease is
        taken for it and it is the session's first unfinished turn, not behind a park or a pending reset, the same
        statement opens it (``june_intake``, migration 17): one round trip and one commit fewer per turn.
        :attr:`Lease.opened` then says what was written; otherwise the runner opens the turn itself.
        """
        params = {
            "agent": ref.agent,
            "session": ref.session,
            "turn_id": turn_id,
            "payload": payload.model_dump_json(),
            "o": owner,
            "l": self.lease_s,
            "max": self.max_attempts,
            **held_params(held),
            **_NO_OPENING,
        }
        if opening is not None:
            (_, message), (event,) = opening.messages[0], opening.events
            seat = opening.steps[0].data if opening.steps else None
            params.update(
                o_role=message.role,
                o_body=message_body(message),
                o_event=event_rest(event),
                o_seat=dumps(seat) if seat is not None else None,
            )
        recorded = False
        for _ in range(_INTAKE_ATTEMPTS):
            with pooled(self.pool) as conn:
                row = conn.execute(_INTAKE, params).fetchone()
            assert row is not None
            inserted, took, retry, fence, generation, status, suspended, event_seq, reset_pending = row[:9]
            valid, compacted_at, messages, steps = row[9:13]
            existing, first = row[13 : 13 + TURN_WIDTH], row[13 + TURN_WIDTH : 13 + 2 * TURN_WIDTH]
            counted = row[13 + 2 * TURN_WIDTH]
            opened_seq, opened_idx = row[14 + 2 * TURN_WIDTH : 16 + 2 * TURN_WIDTH]
            recorded = recorded or bool(inserted)
            if not retry:
                break
        lease, unusable = None, None
        if took:
            try:
                first_turn = _picked(ref, first, int(fence))
            except UnusableTurnError as exc:
                first_turn, unusable, took = None, exc, False
        if took:
            kept = held.messages if held is not None and valid else ()
            snapshot = session_snapshot(
                ref, generation, status, suspended, event_seq, reset_pending, messages, steps,
                compacted_at=compacted_at, held=kept,
            )  # fmt: skip
            lease = Lease(
                fence=int(fence),
                event_seq=int(event_seq),
                turn=first_turn,
                reset_pending=bool(reset_pending),
                snapshot=snapshot,
                read_from=len(kept),
                counted=bool(counted),
                opened=(
                    _as_opened(opening, snapshot, opened_seq, opened_idx)
                    if opening is not None and opened_seq is not None
                    else None
                ),
            )
        elif retry and unusable is None:
            try:
                lease = self.take(ref, owner)  # the row kept changing under us: the lease without a snapshot
            except UnusableTurnError as exc:
                unusable = exc
        rec = turn_from_row(ref, existing) if existing[0] is not None else None
        return Intake(
            existing=None if recorded else rec,
            parked=SuspendedCheckpoint.model_validate_json(suspended) if suspended else None,
            recorded=recorded,
            lease=lease,
            unusable=unusable,
        )

    def read(self, ref: SessionRef, *, held: Held | None = None) -> tuple[SessionSnapshot, int]:
        """The session for its next turn, in one round trip: what :meth:`intake` reads with the lease (only the
        messages after ``held`` when it is still valid). Returns the snapshot and the index the messages were
        read from (0: all of them)."""
        params = {"agent": ref.agent, "session": ref.session, **held_params(held)}
        with pooled(self.pool) as conn:
            row = conn.execute(_READ, params).fetchone()
        assert row is not None
        generation, status, suspended, event_seq, reset_pending, expires_at, valid, compacted_at, messages, steps = row
        kept = held.messages if held is not None and valid else ()
        snapshot = session_snapshot(
            ref, generation, status, suspended, event_seq, reset_pending, messages, steps, expires_at, compacted_at,
            held=kept,
        )  # fmt: skip
        return snapshot, len(kept)

    def beat(self, owner: str, alive_s: float, *, relayed: dict[SessionRef, int] | None = None) -> None:
        """This worker process is alive for ``alive_s`` more seconds; after that its leases may be taken over.

        ``relayed``: sessions whose streams this process saw hold their events up to a seq (its publishes'
        replies), written to their relay marks in the same statement (:meth:`mark_relayed`), so that the
        sweeper finds only the sessions that are really behind, without a statement of their own.
        """
        with pooled(self.pool) as conn:
            if not relayed:
                conn.execute(_BEAT, {"o": owner, "l": alive_s})
                return
            marks = sorted(relayed.items(), key=lambda m: (m[0].agent, m[0].session))
            conn.execute(_BEAT_AND_MARK, {"o": owner, "l": alive_s, **_marks_params(marks)})

    def forget_dead_workers(self, *, older_than_s: float) -> int:
        with pooled(self.pool) as conn:
            cur = conn.execute(f"delete from june_workers where alive_until < {_NOW} - %s", (older_than_s,))
            return int(cur.rowcount)

    def renew(self, ref: SessionRef, fence: int) -> bool:
        return ref in self.renew_all([(ref, fence)])

    def renew_all(self, leases: Sequence[tuple[SessionRef, int]]) -> set[SessionRef]:
        """Renew every lease this process holds (each session with its fence), in one statement; the sessions
        whose lease is still ours. One statement whatever the number of turns in flight."""
        if not leases:
            return set()
        with pooled(self.pool) as conn:
            rows = conn.execute(_RENEW_ALL, {"l": self.lease_s, **_leases_params(leases)}).fetchall()
        return {SessionRef(a, s) for a, s in rows}

    def release(self, ref: SessionRef, fence: int, *, force: bool = False) -> bool:
        """Give the lease up, unless a turn is still queued or running (then keep draining).

        ``force`` releases regardless: the holder stops because a reset waits for the session.
        """
        with pooled(self.pool) as conn:
            cur = conn.execute(
                f"""
                update june_sessions s set lease_owner = null, lease_expires = null
                 where s.agent = %(agent)s and s.session = %(session)s and s.fence = %(f)s
                   and (%(force)s or (not exists (
                        select 1 from june_turns t
                         where t.agent = s.agent and t.session = s.session
                           and t.status in ('queued', 'running')) and {NOTHING_NEW}))
                """,
                {"agent": ref.agent, "session": ref.session, "f": fence, "force": force},
            )
            return bool(cur.rowcount == 1)

    def hand_off(self, ref: SessionRef, fence: int, turn_id: str, *, uncount: bool) -> bool:
        """Give the lease up (whatever is queued) and mark ``turn_id`` dispatched now, for another worker to run it;
        ``uncount``: the pick that took the lease counted a start of it, which did not happen here. False when
        the fence was no longer ours."""
        with pooled(self.pool) as conn:
            row = conn.execute(
                _HAND_OFF,
                {"agent": ref.agent, "session": ref.session, "f": fence, "t": turn_id, "uncount": uncount},
            ).fetchone()
        return bool(row and row[0])

    def intake_view(self, ref: SessionRef, turn_id: str) -> tuple[TurnRecord | None, SuspendedCheckpoint | None]:
        """The turn's row if it was recorded, and the session's parked checkpoint, in one round trip.

        A park a pending reset is about to end does not count: a new turn queues behind the reset.
        """
        with pooled(self.pool) as conn:
            row = conn.execute(
                f"""
                select (select suspended::text from june_sessions
                         where agent = %(agent)s and session = %(session)s and not reset_pending),
                       {turn_columns("t.")}
                  from (select 1) one
                  left join june_turns t on t.agent = %(agent)s and t.session = %(session)s and t.turn_id = %(t)s
                """,
                {"agent": ref.agent, "session": ref.session, "t": turn_id},
            ).fetchone()
        assert row is not None
        suspended, *turn = row
        parked = SuspendedCheckpoint.model_validate_json(suspended) if suspended else None
        return (turn_from_row(ref, turn) if turn[0] is not None else None), parked

    def release_or_next(self, ref: SessionRef, fence: int) -> tuple[str, TurnRecord | None, bool, bool]:
        """After a turn: :meth:`release` if the queue is empty, else :meth:`next_turn`, in one round trip.

        Returns ``("released", None, _, _)``, ``("lost", None, _, _)`` when the fence is no longer ours,
        or ``("next", turn, reset_pending, counted)``: the statement counted a start of ``turn`` as
        :meth:`take` does (a turn no worker can run raises :class:`UnusableTurnError`, the lease kept). The release and the turn are read in one snapshot: the release fails
        exactly when that snapshot holds an unfinished turn, which is returned. ``("next", None, _, _)``
        means the row changed under the statement: ask again.
        """
        with pooled(self.pool) as conn:
            row = conn.execute(
                _RELEASE_OR_NEXT, {"agent": ref.agent, "session": ref.session, "f": fence, "max": self.max_attempts}
            ).fetchone()
        if row is None:
            return "lost", None, False, False
        released, current, reset_pending, counted, *turn = row
        if released:
            return "released", None, False, False
        if int(current) != fence:
            return "lost", None, False, False
        return "next", _picked(ref, turn, fence), bool(reset_pending), bool(counted)

    def next_turn(self, ref: SessionRef) -> tuple[TurnRecord | None, bool]:
        """The oldest unfinished turn and whether a reset is waiting, in one round trip."""
        with pooled(self.pool) as conn:
            rows = conn.execute(
                f"""
                select s.reset_pending, {turn_columns("t.")}
                  from june_sessions s
                  left join lateral {_first_unfinished("s.agent", "s.session")} t on true
                 where s.agent = %s and s.session = %s
                """,
                (ref.agent, ref.session),
            ).fetchall()
        if not rows:
            return None, False
        reset_pending, *turn = rows[0]
        return (turn_from_row(ref, turn) if turn[0] is not None else None), bool(reset_pending)

    def request_reset(self, ref: SessionRef) -> list[str]:
        """Make a reset of the session pending and ask every unfinished turn to cancel (reason ``reset``), in
        one statement; return the turns asked. The reset is durable work from now on: whoever holds the session
        next performs it (the holder of a busy session when its running turn ends, the next intake, the sweeper).
        """
        with pooled(self.pool) as conn:
            rows = conn.execute(
                """
                with pending as (
                    insert into june_sessions as s (agent, session, reset_pending) values (%(agent)s, %(session)s, true)
                    on conflict (agent, session) do update set reset_pending = true
                    returning 1
                ), marked as (
                    update june_turns set cancel_reason = coalesce(cancel_reason, 'reset')
                     where agent = %(agent)s and session = %(session)s and status in ('queued', 'running')
                    returning turn_id, position
                )
                select turn_id from marked, (select count(*) from pending) p order by position
                """,
                {"agent": ref.agent, "session": ref.session},
            ).fetchall()
        return [r[0] for r in rows]

    def pending_resets(self, *, limit: int) -> list[SessionRef]:
        """Sessions with a reset pending that nobody holds (its holder died, or gave the lease up)."""
        with pooled(self.pool) as conn:
            rows = conn.execute(
                f"select s.agent, s.session from june_sessions s where s.reset_pending and {_LEASE_IS_FREE.format(s='s')}"
                " limit %(limit)s",
                {"limit": limit},
            ).fetchall()
        return [SessionRef(a, s) for a, s in rows]

    def reset_pending(self, ref: SessionRef) -> bool:
        with pooled(self.pool) as conn:
            row = conn.execute(
                "select reset_pending from june_sessions where agent = %s and session = %s", (ref.agent, ref.session)
            ).fetchone()
        return bool(row and row[0])

    def cancel_reason(self, ref: SessionRef, turn_id: str) -> str | None:
        return self.cancel_reasons([(ref, turn_id)]).get((ref, turn_id))

    def cancel_reasons(self, turns: Sequence[tuple[SessionRef, str]]) -> dict[tuple[SessionRef, str], str]:
        """The stored cancel of each of these turns that has one, in one statement."""
        if not turns:
            return {}
        with pooled(self.pool) as conn:
            rows = conn.execute(
                _CANCEL_REASONS,
                {
                    "agents": [r.agent for r, _ in turns],
                    "sessions": [r.session for r, _ in turns],
                    "turns": [t for _, t in turns],
                },
            ).fetchall()
        return {(SessionRef(a, s), t): str(reason) for a, s, t, reason in rows}

    # --- the sweeper ------------------------------------------------------------------------------

    def stranded(self, *, grace_s: float, limit: int) -> list[Stranded]:
        """Sessions with a queued or running turn, no live lease, and no dispatch in the last ``grace_s``.

        A turn whose session nobody held yet is left alone for ``grace_s`` after it was recorded
        (its own message is normally on its way); one whose holder died is re-sent at once.
        Every time here is the database's.

        Marks what it returns as dispatched now, so two sweepers do not both re-send it. A row whose
        record no worker can use (made outside the workers) comes back with the reason, never raises:
        one such row must not keep the others from being re-sent.
        """
        with pooled(self.pool) as conn:
            rows = conn.execute(
                f"""
                with first as (
                    select distinct on (t.agent, t.session) t.agent, t.session, t.turn_id
                      from june_turns t
                      join june_sessions s on s.agent = t.agent and s.session = t.session
                     where t.status in ('queued', 'running')
                       and {_LEASE_IS_FREE.format(s="s")}
                       and coalesce(t.dispatched_at, 0) < {_NOW} - %(grace)s
                       -- a dead holder's turn goes at once; a turn nobody held yet gets the grace
                       -- period in which its own message normally arrives
                       and (s.lease_owner is not null or t.created_at < {_NOW} - %(grace)s)
                     order by t.agent, t.session, t.position
                     limit %(limit)s
                ), marked as (
                    update june_turns t set dispatched_at = {_NOW}
                      from first f
                     where t.agent = f.agent and t.session = f.session and t.turn_id = f.turn_id
                    returning t.agent, t.session, {turn_columns("t.")}
                )
                select * from marked
                """,
                {"grace": grace_s, "limit": limit},
            ).fetchall()
        out = []
        for agent, session, *turn in rows:
            ref = SessionRef(agent, session)
            rec, unusable = stored_turn(ref, turn)
            out.append(Stranded(ref=ref, turn=rec, turn_id=turn[0], unusable=unusable))
        return out

    # --- delivery to a turn's target (at least once) ---------------------------------------------

    def claim_delivery(self, ref: SessionRef, turn_id: str, owner: str) -> int | None:
        """Count one delivery attempt of a turn whose delivery is due; None if it is not due, or not ``owner``'s yet.

        The worker that ran the turn delivers it under the session's lease (rendering it live until then): while
        another live worker holds that lease and no later turn of the session has started, the delivery is that
        worker's, and a copy of the turn's message arriving meanwhile must not render it a second time beside
        it. The claim also stamps ``dispatched_at``, so the sweeper leaves the turn alone for a sweep period while
        this attempt runs.
        """
        with pooled(self.pool) as conn:
            row = conn.execute(
                f"""
                update june_turns t set delivery_attempts = delivery_attempts + 1, dispatched_at = {_NOW}
                 where t.agent = %(agent)s and t.session = %(session)s and t.turn_id = %(t)s and t.deliver_due
                   and not exists (
                       select 1 from june_sessions s
                        where s.agent = t.agent and s.session = t.session and s.lease_owner <> %(o)s
                          and not {_LEASE_IS_FREE.format(s="s")}
                          and not exists (
                              select 1 from june_turns later
                               where later.agent = t.agent and later.session = t.session
                                 and later.position > t.position and later.status <> 'queued'))
                returning delivery_attempts
                """,
                {"agent": ref.agent, "session": ref.session, "t": turn_id, "o": owner},
            ).fetchone()
        return None if row is None else int(row[0])

    def delivery_done(self, ref: SessionRef, turn_id: str) -> None:
        """The turn's delivery is no longer due: its hook ran, or its attempts ran out."""
        with pooled(self.pool) as conn:
            conn.execute(
                "update june_turns set deliver_due = false where agent = %s and session = %s and turn_id = %s",
                (ref.agent, ref.session, turn_id),
            )

    def undelivered(self, *, grace_s: float, limit: int) -> list[TurnRecord]:
        """Turns whose delivery stayed due for ``grace_s`` since they ended or were last attempted.

        Marks what it returns as dispatched now, so two sweepers do not both re-send it.
        """
        with pooled(self.pool) as conn:
            rows = conn.execute(
                f"""
                with due as (
                    select agent, session, turn_id from june_turns
                     where deliver_due and finished_at < {_NOW} - %(grace)s
                       and coalesce(dispatched_at, 0) < {_NOW} - %(grace)s
                     limit %(limit)s
                    for update skip locked
                )
                update june_turns t set dispatched_at = {_NOW}
                  from due
                 where t.agent = due.agent and t.session = due.session and t.turn_id = due.turn_id
                returning t.agent, t.session, {turn_columns("t.")}
                """,
                {"grace": grace_s, "limit": limit},
            ).fetchall()
        return [turn_from_row(SessionRef(a, s), turn) for a, s, *turn in rows]

    def expired_parks(self, *, limit: int) -> list[SessionRef]:
        """Sessions parked on a request whose expiry (stamped by the database when the turn parked) has passed."""
        with pooled(self.pool) as conn:
            rows = conn.execute(
                f"select agent, session from june_sessions where park_expires_at < {_NOW} limit %s", (limit,)
            ).fetchall()
        return [SessionRef(a, s) for a, s in rows]

    def parked_on_ended_children(self, *, limit: int) -> list[SessionRef]:
        """Sessions parked on a child turn (``child:<agent>:<turn>``, :mod:`~june_worker.engine.children`) that has
        ended: the worker that ended it died before answering. Read along the parked sessions' index."""
        with pooled(self.pool) as conn:
            rows = conn.execute(_PARKED_ON_ENDED_CHILDREN, {"limit": limit}).fetchall()
        return [SessionRef(a, s) for a, s in rows]

    # --- the relay -----------------------------------------------------------------------------------

    def unrelayed(self, *, limit: int, after: SessionRef | None = None) -> list[tuple[SessionRef, int]]:
        """Sessions nobody holds whose outbox may be ahead of their stream (``relay_due``, a partial
        index), however long ago they were active; with their committed event count. In key order, from
        past ``after``: a caller that pages on from the last one it got reaches every such session."""
        with pooled(self.pool) as conn:
            rows = conn.execute(
                f"""
                select s.agent, s.session, s.event_seq from june_sessions s
                 where s.relay_due and {_LEASE_IS_FREE.format(s="s")}
                   and (s.agent, s.session) > (%(agent)s, %(session)s)
                 order by s.agent, s.session
                 limit %(limit)s
                """,
                {"limit": limit, "agent": after.agent if after else "", "session": after.session if after else ""},
            ).fetchall()
        return [(SessionRef(a, s), int(seq)) for a, s, seq in rows]

    def outbox_sessions(self, *, limit: int, after: SessionRef | None = None) -> list[tuple[SessionRef, int]]:
        """Sessions with events in the outbox, held or not, with their committed event count: the ones whose streams
        a rebuild after a Redis data loss refills. In key order, from past ``after``; found along the outbox's
        primary key one session at a time (a skip scan), so a page costs ``limit`` index probes however many
        sessions have no events left."""
        params = {"limit": limit, "agent": after.agent if after else "", "session": after.session if after else ""}
        with pooled(self.pool) as conn:
            rows = conn.execute(_OUTBOX_SESSIONS, params).fetchall()
        return [(SessionRef(a, s), int(seq)) for a, s, seq in rows]

    def mark_relayed(self, marks: list[tuple[SessionRef, int]]) -> None:
        """Record that each session's stream holds its events up to the given seq (never moves a mark back)."""
        if not marks:
            return
        with pooled(self.pool) as conn:
            conn.execute(_MARK_RELAYED, _marks_params(sorted(marks, key=lambda m: (m[0].agent, m[0].session))))


_BEAT = f"""
    insert into june_workers (owner, alive_until) values (%(o)s, {_NOW} + %(l)s)
    on conflict (owner) do update set alive_until = excluded.alive_until
"""

# The distinct sessions of june_events past a key, by its primary key (agent, session, seq): each step of the
# recursion jumps to the next session's first row, so no session's rows are read one by one. The recursion is
# lazy: it stops once the outer limit is met.
_OUTBOX_SESSIONS = """
    with recursive outbox(agent, session) as (
        (select e.agent, e.session from june_events e
          where (e.agent, e.session) > (%(agent)s, %(session)s)
          order by e.agent, e.session limit 1)
        union all
        select n.agent, n.session from outbox o, lateral (
            select e.agent, e.session from june_events e
             where (e.agent, e.session) > (o.agent, o.session)
             order by e.agent, e.session limit 1) n
    )
    select o.agent, o.session, coalesce(s.event_seq, 0) from (select * from outbox limit %(limit)s) o
      left join june_sessions s on s.agent = o.agent and s.session = o.session
     order by o.agent, o.session
"""

# Marks only move forward: two writers (the holder's heartbeat, a sweeper) may mark one session in either order.
# relay_due (the relay's partial index) is cleared once the mark reaches event_seq; a session marked again past
# its mark still clears it (a flag left set by a mark that was skipped or raced a commit).
_MARK_RELAYED = """
    update june_sessions s set relayed_seq = greatest(s.relayed_seq, m.seq),
           relay_due = s.event_seq > greatest(s.relayed_seq, m.seq)
      from (select * from unnest(%(agents)s::text[], %(sessions)s::text[], %(seqs)s::bigint[])
            as m(agent, session, seq)) m
     where s.agent = m.agent and s.session = m.session and (s.relayed_seq < m.seq or s.relay_due)
"""


# The heartbeat's marks skip a session row another transaction holds (a reset archiving a long transcript, a
# step's commit): waiting there would hold up this process's liveness, and past JUNE_ALIVE_S other workers
# would take its leases. A mark skipped is no loss: the sweeper reads that stream's markers instead.
# relay_due stays set on a session this process still holds: its next step's commit would set it again, and
# flipping it there and back makes two updates that are not HOT; the holder releasing the lease leaves it to
# the sweeper's mark, or the mark of a heartbeat after the release.
_MARK_RELAYED_UNLOCKED = """
    update june_sessions s set relayed_seq = greatest(s.relayed_seq, m.seq),
           relay_due = case when s.lease_owner = %(o)s then s.relay_due
                            else s.event_seq > greatest(s.relayed_seq, m.seq) end
      from (select * from unnest(%(agents)s::text[], %(sessions)s::text[], %(seqs)s::bigint[])
            as m(agent, session, seq)) m
     where s.agent = m.agent and s.session = m.session
       and (s.relayed_seq < m.seq or (s.relay_due and s.lease_owner is distinct from %(o)s))
       and (s.agent, s.session) in (
            select j.agent, j.session from june_sessions j
             where (j.agent, j.session) in (select * from unnest(%(agents)s::text[], %(sessions)s::text[]))
               for update skip locked)
"""

_BEAT_AND_MARK = f"with alive as ({_BEAT}), marked as ({_MARK_RELAYED_UNLOCKED}) select 1"
"""A heartbeat that also writes the relay marks a holder's publishes confirmed: one statement, one round trip."""


_RENEW_ALL = one_line(f"""
update june_sessions s set lease_expires = {_NOW} + %(l)s
  from (select * from unnest(%(agents)s::text[], %(sessions)s::text[], %(fences)s::bigint[]) as h(agent, session, fence)) h
 where s.agent = h.agent and s.session = h.session and s.fence = h.fence and s.lease_owner is not null
returning s.agent, s.session
""")

_HAND_OFF = one_line(f"""
with released as (
    update june_sessions set lease_owner = null, lease_expires = null
     where agent = %(agent)s and session = %(session)s and fence = %(f)s
    returning 1
), turn as (
    update june_turns
       set attempts = case when %(uncount)s and attempts > 0 then attempts - 1 else attempts end,
           dispatched_at = {_NOW}
     where agent = %(agent)s and session = %(session)s and turn_id = %(t)s and exists (select 1 from released)
    returning 1
)
select exists (select 1 from released), (select count(*) from turn)
""")

_CANCEL_REASONS = one_line("""
select t.agent, t.session, t.turn_id, t.cancel_reason
  from (select * from unnest(%(agents)s::text[], %(sessions)s::text[], %(turns)s::text[]) as r(agent, session, turn_id)) r
  join june_turns t on t.agent = r.agent and t.session = r.session and t.turn_id = r.turn_id
 where t.cancel_reason is not null
""")


def _leases_params(leases: Sequence[tuple[SessionRef, int]]) -> dict[str, Any]:
    return {
        "agents": [r.agent for r, _ in leases],
        "sessions": [r.session for r, _ in leases],
        "fences": [f for _, f in leases],
    }


def _marks_params(marks: list[tuple[SessionRef, int]]) -> dict[str, Any]:
    return {
        "agents": [r.agent for r, _ in marks],
        "sessions": [r.session for r, _ in marks],
        "seqs": [seq for _, seq in marks],
    }
