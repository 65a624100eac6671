"""PostgresStore: the source of truth for workers. psycopg 3 over a ``psycopg_pool`` pool.

Per step the cost is **one round trip**: a plain :class:`Commit` is ONE data-modifying
statement (a CTE, built in :mod:`._pg_commit`) sent in autocommit and prepared once per
connection. It updates the session row only if the fencing token (and ``expect_suspended``)
match, bumping ``event_seq``; the message, step and event inserts and the turn update select
``from`` that update, so they write nothing unless it returned the row. Only when nothing was
written does the store ask why, in a second query (:class:`LeaseLostError`,
:class:`ResumeConflictError`, or a session's first write: create its row and go again). A
taken message index is a unique violation: the statement fails whole, :class:`StoreError`.

A commit given as a builder (a sync tool runs inside it) gets a handle whose first use sends
``BEGIN``; the same statement then runs in that transaction and ``COMMIT`` follows, or
``ROLLBACK`` on any error (the tool's writes go with it; the exception propagates unchanged).
A tool that never touches the handle costs what a plain commit costs.

Per-step work never reads the transcript: only :meth:`PostgresStore.load` does, in one
statement (one snapshot, one round trip).

JSON columns are ``json``, not ``jsonb``: rows are written once and read whole, ``json`` keeps
the exact text and is cheaper both ways, and it accepts every JSON string SQLite accepts
(``jsonb`` refuses ``\\u0000``, which a tool result may well contain). Times are unix seconds
(``double precision``) from the server's clock, as in SQLite, so lease and sweeper queries
compare them with plain numbers. Identifier columns collate ``"C"``: byte comparisons in every
key index, whatever the database's locale.

Connections that die while idle (``pg_terminate_backend``, a server restart) are caught at
checkout without a round trip and replaced; an idempotent read that meets a dead connection
runs once more on a fresh one.

The one rule a reader must not break: **a commit either applies whole, in one statement or
one transaction, or writes nothing**; never retry a commit whose outcome is unknown (a
connection lost mid-commit raises ``psycopg.OperationalError``).
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar, cast

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import TupleRow
from psycopg.types.numeric import Int8
from psycopg_pool import ConnectionPool
from pydantic import TypeAdapter, ValidationError

from june_wire.storable import unstorable_reason

from ..engine.endings import rejection_event
from ..engine.events import Rejected, TurnEvent, TurnResultAdapter
from ..engine.store import (
    ENDED_TURN_STATUSES,
    UNFINISHED_TURN_STATUSES,
    Commit,
    CommitBuilder,
    ResetResult,
    SessionRef,
    SessionSnapshot,
    SessionStatus,
    StepRecord,
    SuspendedCheckpoint,
    TurnPayload,
    TurnRecord,
    parked_on,
)
from ..engine.types import Message
from ..errors import (
    CancelRequestedError,
    LeaseLostError,
    MessageIndexTakenError,
    ResumeConflictError,
    StoreError,
    StoreUnavailableError,
    TurnEndedError,
)
from ._pg_commit import commit_statement
from ._pg_conn import Conn, ToolHandle, check_connection, configure_connection, pooled
from ._pg_partition import partition_count, partition_tables
from ._pg_schema import MIGRATION_LOCK, MIGRATIONS

__all__ = [
    "MESSAGES_JSON",
    "STEPS_JSON",
    "TURN_COLUMNS",
    "TURN_WIDTH",
    "PostgresStore",
    "session_snapshot",
    "stored_turn",
    "turn_columns",
    "turn_from_row",
]

T = TypeVar("T")

_COMMIT_ATTEMPTS = 3
_MessagesAdapter: TypeAdapter[list[Message]] = TypeAdapter(list[Message])
_EventsAdapter: TypeAdapter[list[TurnEvent]] = TypeAdapter(list[TurnEvent])


_WHY_NOT = """
select s.fence, s.suspended::text,
       coalesce(s.park_expires_at <= extract(epoch from now()), false), t.status, t.cancel_reason
  from june_sessions s
  left join june_turns t on t.agent = s.agent and t.session = s.session and t.turn_id = %(t_id)s::text
 where s.agent = %(agent)s and s.session = %(session)s
"""

_ENSURE_SESSION = "insert into june_sessions (agent, session) values (%(agent)s, %(session)s) on conflict do nothing"

MESSAGES_JSON = """(select '[' || coalesce(string_agg(june_message(m.role, m.turn_id, m.body), ',' order by m.idx), '')
       || ']' from june_messages m where m.agent = %(agent)s and m.session = %(session)s)"""
"""The session's transcript as one JSON text (a scalar subquery), as :func:`session_snapshot` reads it."""

STEPS_JSON = """(select coalesce(json_agg(json_build_array(st.step_id, st.turn_id, st.data)), '[]'::json)::text
       from june_steps st where st.agent = %(agent)s and st.session = %(session)s)"""
"""The session's steps as one JSON text (a scalar subquery), as :func:`session_snapshot` reads it."""

_LOAD = f"""
select s.generation, s.status, s.suspended::text, s.event_seq, s.reset_pending, {MESSAGES_JSON}, {STEPS_JSON},
       s.park_expires_at,
       (select max(m.idx) from june_messages m
         where m.agent = %(agent)s and m.session = %(session)s and m.role = 'summary')
from (select 1) as one
left join june_sessions s on s.agent = %(agent)s and s.session = %(session)s
"""


def turn_columns(alias: str = "") -> str:
    """A turn row's columns in the order :func:`turn_from_row` reads them, each prefixed with ``alias``
    (``"t."``), JSON as text."""
    names = (
        "turn_id position status payload::text cancel_reason attempts result::text generation created_at finished_at"
        " last_error"
    )
    return ", ".join(alias + name for name in names.split())


TURN_COLUMNS = turn_columns()
"""A turn row's columns in the order :func:`turn_from_row` reads them."""
TURN_WIDTH = len(TURN_COLUMNS.split(","))
"""How many columns :data:`TURN_COLUMNS` selects."""

_ENQUEUE = f"""
select e.recorded, {turn_columns("(e.turn).")}
  from june_enqueue_turn(%(agent)s, %(session)s, %(turn_id)s, %(payload)s::json) e
"""
"""Record a queued turn (migration 5's function, as migration 11 left it; durable producers call it too)."""

_SESSION_EXISTS = "select exists (select 1 from june_sessions where agent = %(agent)s and session = %(session)s)"
_PARK_AGE = """
select extract(epoch from now()) - parked_at from june_sessions
 where agent = %(agent)s and session = %(session)s and suspended is not null
"""

_GET_TURN = (
    f"select {TURN_COLUMNS} from june_turns where agent = %(agent)s and session = %(session)s and turn_id = %(turn_id)s"
)

_CHILD_TURNS = (
    f"select agent, session, {TURN_COLUMNS} from june_turns"
    " where agent = any(%(agents)s) and session >= %(low)s and session < %(high)s"
    " and payload->'parent'->>'turn_id' = %(parent_turn)s and payload->'parent'->>'agent' = %(parent_agent)s"
    " and payload->'parent'->>'session' = %(parent_session)s"
    " order by session, position"
)
"""The child turns of one turn: a range of the child sessions' ids (``<session>:sub:...``; ';' follows ':'), along
the primary key, each turn's parent link checked."""

_UNFINISHED = (
    f"select {TURN_COLUMNS} from june_turns where agent = %(agent)s and session = %(session)s "
    "and status in ('queued', 'running') order by position"
)

_CANCEL = """
with marked as (
    update june_turns set cancel_reason = coalesce(cancel_reason, %(reason)s::text)
    where agent = %(agent)s and session = %(session)s and status in ('queued', 'running')
      and (%(ids)s::text[] is null or turn_id = any(%(ids)s::text[]))
    returning turn_id, position
)
select turn_id from marked order by position
"""

_EVENTS = """
select coalesce(json_agg(body order by seq), '[]'::json)::text from june_events
where agent = %(agent)s and session = %(session)s and seq > %(after)s::bigint
  and (%(turn_id)s::text is null or turn_id = %(turn_id)s::text)
"""

_LOCK_SESSION = """
insert into june_sessions as s (agent, session) values (%(agent)s, %(session)s)
on conflict (agent, session) do update set generation = s.generation
returning s.fence, s.event_seq, s.generation
"""

# A rejection in the transaction that locked the session row: the turn inserted as rejected when it is new
# (never queued, so no drain can run it), else set rejected (the caller checked it has not ended), its payload
# replaced when the stored one cannot be used (`replace`); its turn.failed event in the outbox; the session's
# counters moved.
_REJECT = f"""
with sess as (
    update june_sessions set event_seq = %(seq)s, relay_due = true,
           next_position = next_position + case when %(new)s then 1 else 0 end
     where agent = %(agent)s and session = %(session)s
    returning next_position - 1 as position, generation
), ev as (
    insert into june_events (agent, session, seq, turn_id, type, body)
    values (%(agent)s, %(session)s, %(seq)s, %(turn_id)s, 'turn.failed', %(body)s::json)
), ins as (
    insert into june_turns (agent, session, turn_id, position, status, payload, result, generation, finished_at)
    select %(agent)s, %(session)s, %(turn_id)s, sess.position, 'rejected', %(payload)s::json, %(result)s::json,
           sess.generation, extract(epoch from now())
      from sess where %(new)s
    returning {TURN_COLUMNS}
), upd as (
    update june_turns set status = 'rejected', result = %(result)s::json, finished_at = extract(epoch from now()),
           payload = case when %(replace)s then %(payload)s::json else payload end
     where agent = %(agent)s and session = %(session)s and turn_id = %(turn_id)s and not %(new)s
    returning {TURN_COLUMNS}
)
select * from ins union all select * from upd
"""

_RESET = """
with am as (
    insert into june_archived_messages (agent, session, generation, idx, turn_id, role, body)
    select agent, session, %(generation)s::integer, idx, turn_id, role, body
    from june_messages where agent = %(agent)s and session = %(session)s
), ast as (
    insert into june_archived_steps (agent, session, generation, step_id, turn_id, data)
    select agent, session, %(generation)s::integer, step_id, turn_id, data
    from june_steps where agent = %(agent)s and session = %(session)s
), dm as (
    delete from june_messages where agent = %(agent)s and session = %(session)s
), ds as (
    delete from june_steps where agent = %(agent)s and session = %(session)s
)
update june_sessions set generation = generation + 1, status = 'new', suspended = null, parked_at = null,
       reset_pending = false, updated_at = extract(epoch from now())
where agent = %(agent)s and session = %(session)s
"""

_ACQUIRE_FENCE = """
insert into june_sessions as s (agent, session, fence) values (%(agent)s, %(session)s, 1)
on conflict (agent, session) do update set fence = s.fence + 1
returning s.fence
"""


class PostgresStore:
    """Sessions in Postgres. ``url_or_pool``: a libpq URL/DSN, or a ``ConnectionPool`` you own.

    The store's pool is opened at once and the schema migrated (``migrate=False`` to skip).
    Connections are used in autocommit mode. The store's statements are server-side prepared
    on first use with a generic plan; pass ``prepare=False`` behind a pooler that cannot keep
    prepared statements (PgBouncer before 1.21 in transaction mode).
    """

    supports_rollback = True

    def __init__(
        self,
        url_or_pool: str | ConnectionPool[Conn],
        *,
        min_size: int = 1,
        max_size: int = 4,
        timeout_s: float = 30.0,
        migrate: bool = True,
        prepare: bool = True,
    ) -> None:
        if isinstance(url_or_pool, ConnectionPool):
            self._pool: ConnectionPool[Conn] = url_or_pool
            self._owns_pool = False
        else:
            self._pool = ConnectionPool(
                url_or_pool,
                min_size=min_size,
                max_size=max(min_size, max_size),
                kwargs={"autocommit": True, "prepare_threshold": 0 if prepare else None},
                configure=configure_connection if prepare else None,
                check=check_connection,
                timeout=timeout_s,
                open=False,
                name="june-store",
            )
            self._pool.open(wait=True, timeout=timeout_s)
            self._owns_pool = True
        self._cursors: weakref.WeakKeyDictionary[Conn, psycopg.Cursor[TupleRow]] = weakref.WeakKeyDictionary()
        if migrate:
            self.migrate()

    @property
    def pool(self) -> ConnectionPool[Conn]:
        """The store's connection pool, for hosts that keep their own tables beside the store's (leases)."""
        return self._pool

    # --- plumbing ------------------------------------------------------------------------------------

    def _connection(self) -> contextlib.AbstractContextManager[Conn]:
        return pooled(self._pool)

    def _read(self, fn: Callable[[Conn], T]) -> T:
        """Run an idempotent read; once more on a fresh connection if the first one turned out dead."""
        used: Conn | None = None
        try:
            with self._connection() as conn:
                used = conn
                return fn(conn)
        except StoreUnavailableError:
            if used is None or not used.broken:
                raise
        with self._connection() as conn:
            return fn(conn)

    # --- schema ------------------------------------------------------------------------------------

    def migrate(self) -> None:
        """Apply missing migrations, each in its own transaction under an advisory lock: safe from many workers."""
        with self._connection() as conn:
            for version, script in enumerate(MIGRATIONS, start=1):
                with conn.transaction():
                    conn.execute("select pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
                    conn.execute(
                        "create table if not exists june_schema ("
                        "version integer primary key, applied_at timestamptz not null default now())"
                    )
                    done = conn.execute("select 1 from june_schema where version = %s", (version,)).fetchone()
                    if done:
                        continue
                    conn.execute(script, prepare=False)
                    conn.execute("insert into june_schema (version) values (%s)", (version,))

    def partition(self, partitions: int) -> bool:
        """Hash-partition the per-session tables by ``(agent, session)`` into ``partitions`` partitions (after
        :meth:`migrate`); False when they are partitioned so already. One transaction; the tables are locked while
        their rows are copied (workers wait, then go on). See :mod:`._pg_partition`."""
        self.migrate()
        with self._connection() as conn:
            conn.execute("select pg_advisory_lock(%s)", (MIGRATION_LOCK,))
            try:
                return partition_tables(conn, partitions)
            finally:
                conn.execute("select pg_advisory_unlock(%s)", (MIGRATION_LOCK,))

    def partitions(self) -> dict[str, int]:
        """How many hash partitions each per-session table has (0: not partitioned)."""
        with self._connection() as conn:
            return partition_count(conn)

    # --- reads -------------------------------------------------------------------------------------

    def load(self, ref: SessionRef) -> SessionSnapshot:
        key = {"agent": ref.agent, "session": ref.session}
        row = self._read(lambda c: c.execute(_LOAD, key).fetchone())
        assert row is not None
        return session_snapshot(ref, *row)

    def pending(self, ref: SessionRef) -> SuspendedCheckpoint | None:
        key = {"agent": ref.agent, "session": ref.session}
        row = self._read(
            lambda c: c.execute(
                "select suspended::text, park_expires_at from june_sessions"
                " where agent = %(agent)s and session = %(session)s",
                key,
            ).fetchone()
        )
        if not row or not row[0]:
            return None
        return SuspendedCheckpoint.model_validate_json(row[0]).with_expiry(row[1])

    def park_age(self, ref: SessionRef) -> float | None:
        """How long ago, by the database's clock, the session's park was set (``parked_at``); None: not parked."""
        key = {"agent": ref.agent, "session": ref.session}
        row = self._read(lambda c: c.execute(_PARK_AGE, key).fetchone())
        return float(row[0]) if row and row[0] is not None else None

    def session_exists(self, ref: SessionRef) -> bool:
        """Whether anything was ever recorded for the session (a turn, a lease, a reset)."""
        key = {"agent": ref.agent, "session": ref.session}
        row = self._read(lambda c: c.execute(_SESSION_EXISTS, key).fetchone())
        return bool(row and row[0])

    def get_turn(self, ref: SessionRef, turn_id: str) -> TurnRecord | None:
        key = {"agent": ref.agent, "session": ref.session, "turn_id": turn_id}
        row = self._read(lambda c: c.execute(_GET_TURN, key).fetchone())
        return turn_from_row(ref, row) if row else None

    def child_turns(self, parent: SessionRef, parent_turn_id: str, agents: Collection[str]) -> list[TurnRecord]:
        key = {
            "agents": sorted(agents),
            "low": f"{parent.session}:sub:",
            "high": f"{parent.session}:sub;",
            "parent_turn": parent_turn_id,
            "parent_agent": parent.agent,
            "parent_session": parent.session,
        }
        rows = self._read(lambda c: c.execute(_CHILD_TURNS, key).fetchall())
        return [turn_from_row(SessionRef(r[0], r[1]), r[2:]) for r in rows]

    def unfinished_turns(self, ref: SessionRef) -> list[TurnRecord]:
        key = {"agent": ref.agent, "session": ref.session}
        rows = self._read(lambda c: c.execute(_UNFINISHED, key).fetchall())
        return [turn_from_row(ref, r) for r in rows]

    def events(self, ref: SessionRef, *, turn_id: str | None = None, after_seq: int = 0) -> list[TurnEvent]:
        key = {"agent": ref.agent, "session": ref.session, "after": Int8(after_seq), "turn_id": turn_id}
        row = self._read(lambda c: c.execute(_EVENTS, key).fetchone())
        assert row is not None
        return _EventsAdapter.validate_json(row[0])

    # --- writes ------------------------------------------------------------------------------------

    def commit(self, ref: SessionRef, commit: Commit | CommitBuilder, *, fence: int | None = None) -> list[TurnEvent]:
        with self._connection() as conn:
            if isinstance(commit, Commit):
                return self._apply(conn, ref, commit, fence)[0]
            handle = ToolHandle(conn)
            try:
                try:
                    built = commit(handle)
                finally:
                    if handle.lost is not None or conn.broken:  # whatever the tool made of it, the transaction is gone
                        raise StoreUnavailableError(
                            f"session {ref}: the step's transaction was lost under the tool: "
                            f"{handle.lost or 'the connection broke'}"
                        ) from handle.lost
                if handle.begun and conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
                    raise StoreError(
                        f"session {ref}: a statement the tool ran on the raw connection (unwrap()) failed and was "
                        "caught without a savepoint of its own, so the step's transaction is aborted; nothing of the "
                        "step was written. Use ctx.store.execute / query, or wrap such statements in "
                        "conn.transaction()"
                    )
                events = self._apply(conn, ref, built, fence)[0]
            except BaseException:
                if handle.begun:
                    with contextlib.suppress(psycopg.Error):  # a dead connection has no transaction left
                        conn.execute("rollback", prepare=False)
                raise
            if handle.begun:
                conn.execute("commit", prepare=False)
            return events

    def commit_releasing(self, ref: SessionRef, commit: Commit, *, fence: int) -> tuple[list[TurnEvent], bool]:
        """:meth:`commit` the checkpoint that ends a turn and, in the same statement, give the lease up.

        For a host that leases sessions (``fence``, ``lease_owner`` on the session row): the lease
        is given up unless another turn of the session is queued or running, or one was recorded
        after this statement's snapshot (``next_position`` moved). Returns the events and whether
        the lease is free now; if not, the caller runs the session's next turn. ``commit`` must set
        its turn's status (``turn_id`` and ``turn_status``).
        """
        return self.commit_ending(ref, commit, fence=fence, release=True)

    def commit_ending(
        self, ref: SessionRef, commit: Commit, *, fence: int, release: bool = False, deliver_due: bool = False
    ) -> tuple[list[TurnEvent], bool]:
        """:meth:`commit` the checkpoint that ends a turn, with what a worker does in the same statement:
        ``release`` as :meth:`commit_releasing`; ``deliver_due`` marks the turn due for delivery to its
        target (the worker clears the mark once delivered). Returns the events and whether the lease is free."""
        with self._connection() as conn:
            return self._apply(conn, ref, commit, fence, release=release, deliver_due=deliver_due)

    def _apply(
        self,
        conn: Conn,
        ref: SessionRef,
        commit: Commit,
        fence: int | None,
        *,
        release: bool = False,
        deliver_due: bool = False,
    ) -> tuple[list[TurnEvent], bool]:
        sql, params = commit_statement(ref, commit, fence, release=release, deliver_due=deliver_due)
        cur = self._cursors.get(conn)
        if cur is None or cur.closed:
            cur = self._cursors[conn] = conn.cursor()  # one per connection: a step's commit skips making one
        for _ in range(_COMMIT_ATTEMPTS):
            try:
                row = cur.execute(sql, params).fetchone()
            except pg_errors.UniqueViolation as exc:
                if _names_messages_key(exc.diag.constraint_name, exc.diag.table_name):
                    raise MessageIndexTakenError(
                        f"session {ref}: a message index of this commit is taken ({exc.diag.message_detail})"
                    ) from exc
                raise StoreError(f"session {ref}: the commit broke a unique constraint: {exc}") from exc
            if row is not None:
                base = row[0] - len(commit.events)
                events = [e.model_copy(update={"seq": base + i}) for i, e in enumerate(commit.events, start=1)]
                return events, release and bool(row[1])
            # Nothing was written. Ask why: off the happy path, so a second round trip is fine.
            found = conn.execute(_WHY_NOT, {"t_id": None, **params}).fetchone()
            current_fence, parked_text, expired, turn_status, cancel_reason = (
                found if found is not None else (0, None, False, None, None)
            )
            if fence is not None and fence != current_fence:
                raise LeaseLostError(f"session {ref} is leased under fence {current_fence}, not {fence}")
            if commit.expect_suspended is not None:
                turn_id, input_id = commit.expect_suspended
                parked = SuspendedCheckpoint.model_validate_json(parked_text) if parked_text else None
                if not parked_on(parked, turn_id, input_id, commit.expect_version):
                    raise ResumeConflictError(f"session {ref} is not parked on turn {turn_id} input {input_id!r}")
                if commit.expect_expired and not expired:
                    raise ResumeConflictError(f"session {ref}: input {input_id!r} has not expired")
            if commit.turn_status is not None and turn_status in ENDED_TURN_STATUSES:
                raise TurnEndedError(
                    f"session {ref}: turn {commit.turn_id} has ended ({turn_status}); its status stays"
                )
            if commit.expect_not_cancelled and cancel_reason is not None:
                raise CancelRequestedError(cancel_reason)
            if found is None:  # the session's first write: create its row, then write
                conn.execute(_ENSURE_SESSION, params)
            # else the row changed between the statement and this look at it: run it again.
        raise StoreError(
            f"session {ref}: the commit kept racing concurrent changes of the session row; nothing written"
        )

    def enqueue_turn(self, ref: SessionRef, turn_id: str, payload: TurnPayload) -> tuple[TurnRecord, bool]:
        params = {
            "agent": ref.agent,
            "session": ref.session,
            "turn_id": turn_id,
            "payload": payload.model_dump_json(),
        }
        with self._connection() as conn:
            for _ in range(_COMMIT_ATTEMPTS):
                row = conn.execute(_ENQUEUE, params).fetchone()
                if row is not None:  # none: a concurrent enqueue of the same turn won; its row is visible now
                    return turn_from_row(ref, row[1:]), bool(row[0])
        raise StoreError(f"session {ref}: could not enqueue turn {turn_id}")

    def request_cancel(self, ref: SessionRef, reason: str, *, turn_ids: Sequence[str] | None = None) -> list[str]:
        params = {
            "agent": ref.agent,
            "session": ref.session,
            "reason": reason,
            "ids": list(turn_ids) if turn_ids is not None else None,
        }
        with self._connection() as conn:
            return [r[0] for r in conn.execute(_CANCEL, params).fetchall()]

    def reject_turn(
        self,
        ref: SessionRef,
        turn_id: str,
        payload: TurnPayload,
        reason: str,
        *,
        fence: int | None = None,
        new_only: bool = False,
    ) -> tuple[TurnRecord, list[TurnEvent]]:
        key: dict[str, Any] = {"agent": ref.agent, "session": ref.session, "turn_id": turn_id}
        event = rejection_event(turn_id, reason)
        with self._connection() as conn, conn.transaction():
            row = conn.execute(_LOCK_SESSION, key).fetchone()  # creates and locks the session row
            assert row is not None
            _check_fence(ref, int(row[0]), fence)
            event_seq = int(row[1])
            found = conn.execute(_GET_TURN + " for update", key).fetchone()
            existing, unusable = stored_turn(ref, found) if found else (None, None)
            # A record no worker can use, still queued (made outside the workers: a durable producer's; no runner
            # ever opened it, though picks may have counted starts of it), is rejected whatever new_only says,
            # since nothing else would ever end it; its payload is replaced by this one.
            replace = found is not None and unusable is not None and found[2] == "queued"
            if not replace:
                if found is not None and existing is None:
                    raise StoreError(f"turn {turn_id} of {ref}: {unusable}; it is {found[2]}, so it is left alone")
                if existing is not None and (new_only or existing.status not in UNFINISHED_TURN_STATUSES):
                    return existing, []
            seq = event_seq + 1
            params = {
                **key,
                "payload": payload.model_dump_json(),
                "result": Rejected(turn_id=turn_id, reason=reason).model_dump_json(),
                "seq": Int8(seq),
                "body": event.model_copy(update={"seq": seq}).model_dump_json(by_alias=True),
                "new": found is None,
                "replace": replace,
            }
            stored = conn.execute(_REJECT, params).fetchone()
            assert stored is not None
        return turn_from_row(ref, stored), [event.model_copy(update={"seq": seq})]

    def reset(self, ref: SessionRef, *, fence: int | None = None) -> ResetResult:
        key: dict[str, Any] = {"agent": ref.agent, "session": ref.session}
        with self._connection() as conn, conn.transaction():
            row = conn.execute(_LOCK_SESSION, key).fetchone()  # creates and locks the session row
            assert row is not None
            _check_fence(ref, int(row[0]), fence)
            generation = int(row[2])
            conn.execute(_RESET, {**key, "generation": generation})
        return ResetResult(previous_session=f"{ref.session}#g{generation}", generation=generation)

    def acquire_fence(self, ref: SessionRef) -> int:
        """Take the session's fencing token: every later commit with an older token fails."""
        with self._connection() as conn:
            row = conn.execute(_ACQUIRE_FENCE, {"agent": ref.agent, "session": ref.session}).fetchone()
        assert row is not None
        return int(row[0])

    def close(self) -> None:
        if self._owns_pool:
            self._pool.close()


def _names_messages_key(constraint: str | None, table: str | None) -> bool:
    """A unique violation of the transcript's key: ``june_messages_pkey``, or its partition's (``june_messages_p3_pkey``
    on ``june_messages_p3``) when the table is hash-partitioned."""
    if constraint == "june_messages_pkey":
        return True
    return bool(table and constraint and table.startswith("june_messages_p") and constraint == f"{table}_pkey")


def _check_fence(ref: SessionRef, current: int, fence: int | None) -> None:
    if fence is not None and fence != current:
        raise LeaseLostError(f"session {ref} is leased under fence {current}, not {fence}")


def session_snapshot(
    ref: SessionRef,
    generation: int | None,
    status: str | None,
    suspended: str | None,
    event_seq: int | None,
    reset_pending: bool | None,
    messages: str,
    steps: str,
    park_expires_at: float | None = None,
    compacted_at: int | None = None,
    *,
    held: Sequence[Message] = (),
) -> SessionSnapshot:
    """A session from its row's columns (None: no row yet), the messages as JSON text (:data:`MESSAGES_JSON`, or
    only those after ``held``, the messages a worker holds already) and the steps (:data:`STEPS_JSON`)."""
    transcript = _MessagesAdapter.validate_json(messages)
    if held:
        transcript = [*held, *transcript]
    # Built without validating again what was just parsed: at 10,000 messages that would cost 2.7 ms.
    return SessionSnapshot.model_construct(
        ref_agent=ref.agent,
        ref_session=ref.session,
        generation=generation or 0,
        status=cast(SessionStatus, status or "new"),  # the table's check constraint keeps it one of them
        suspended=SuspendedCheckpoint.model_validate_json(suspended).with_expiry(park_expires_at)
        if suspended
        else None,
        reset_pending=bool(reset_pending),
        messages=transcript,
        steps={
            step_id: StepRecord(step_id=step_id, turn_id=turn_id, data=data)
            for step_id, turn_id, data in json.loads(steps)
        },
        event_seq=event_seq or 0,
        compacted_at=compacted_at,
    )


def stored_turn(ref: SessionRef, row: Sequence[Any]) -> tuple[TurnRecord | None, str | None]:
    """A turn row read as :func:`turn_from_row` reads it (None when it cannot be), and why no worker can run its
    record (None: one can).

    Workers record only what they validated, but a durable producer records through ``june_enqueue_turn`` from
    outside, and Postgres' ``json`` takes what no worker can use: a lone surrogate escape (the record cannot be
    read) or a NUL (it can, but no store holds it, and the message it makes is refused).
    """
    try:
        rec = turn_from_row(ref, row)
    except ValidationError as exc:
        problem = exc.errors()[0]
        return None, f"its stored record cannot be read ({problem['msg']})"
    reason = unstorable_reason(rec.payload.model_dump(mode="json"), "payload")
    return rec, None if reason is None else f"its stored {reason}"


def turn_from_row(ref: SessionRef, row: Sequence[Any]) -> TurnRecord:
    """A turn from its columns in :data:`TURN_COLUMNS` order, JSON as text or as psycopg decoded it."""
    turn_id, position, status, payload, cancel_reason, attempts, result, generation, created_at, finished_at = row[:10]
    return TurnRecord(
        turn_id=turn_id,
        agent=ref.agent,
        session=ref.session,
        position=position,
        status=status,
        payload=TurnPayload.model_validate_json(payload)
        if isinstance(payload, str | bytes)
        else TurnPayload.model_validate(payload),
        cancel_reason=cancel_reason,
        attempts=attempts,
        result=None
        if result is None
        else TurnResultAdapter.validate_json(result)
        if isinstance(result, str | bytes)
        else TurnResultAdapter.validate_python(result),
        generation=generation,
        created_at=float(created_at),
        finished_at=float(finished_at) if finished_at is not None else None,
        last_error=row[10],
    )
