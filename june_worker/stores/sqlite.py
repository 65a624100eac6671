"""SQLiteStore: the embedded default. stdlib ``sqlite3``, a file or ``:memory:``, no server.

A commit is one ``BEGIN IMMEDIATE`` ... ``COMMIT``. A sync tool's writes through
``ctx.store`` happen inside it, so they commit or roll back with the checkpoint. The file
runs in WAL mode with ``synchronous=NORMAL``: a killed process loses nothing it
committed; a power cut may lose the last few commits.

One open store serves a file at a time (:mod:`._filelock`): the in-process runtime takes no
lease, so a second process on the same file waits for the first to close its store, then
finds the turns it finished finished, instead of running them again.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import weakref
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..engine.endings import rejection_event
from ..engine.events import Rejected, TurnEvent, TurnEventAdapter, TurnResultAdapter
from ..engine.store import (
    ENDED_TURN_STATUSES,
    UNFINISHED_TURN_STATUSES,
    Commit,
    CommitBuilder,
    ResetResult,
    SessionRef,
    SessionSnapshot,
    StepRecord,
    SuspendedCheckpoint,
    TurnPayload,
    TurnRecord,
    park_expiry,
    parked_on,
)
from ..errors import (
    CancelRequestedError,
    LeaseLostError,
    MessageIndexTakenError,
    ResumeConflictError,
    TurnEndedError,
)
from ._filelock import FileLock
from ._sql import dumps, event_rows, message_body, message_from_row

__all__ = ["SQLiteStore"]

_MIGRATIONS: list[str] = [
    # 1: the whole schema
    """
    create table june_sessions (
        agent text not null,
        session text not null,
        generation integer not null default 0,
        status text not null default 'new',
        suspended text,
        event_seq integer not null default 0,
        relayed_seq integer not null default 0,
        next_position integer not null default 1,
        fence integer not null default 0,
        lease_owner text,
        lease_expires real,
        reset_pending integer not null default 0,
        primary key (agent, session)
    );
    create table june_turns (
        agent text not null,
        session text not null,
        turn_id text not null,
        position integer not null,
        status text not null,
        payload text not null,
        cancel_reason text,
        attempts integer not null default 0,
        result text,
        generation integer not null default 0,
        created_at real not null,
        finished_at real,
        primary key (agent, session, turn_id)
    );
    create index june_turns_unfinished on june_turns (agent, session, position)
        where status in ('queued', 'running');
    create table june_messages (
        agent text not null,
        session text not null,
        idx integer not null,
        turn_id text not null,
        role text not null,
        body text not null,
        primary key (agent, session, idx)
    );
    create table june_steps (
        agent text not null,
        session text not null,
        step_id text not null,
        turn_id text,
        data text not null,
        primary key (agent, session, step_id)
    );
    create table june_events (
        agent text not null,
        session text not null,
        seq integer not null,
        turn_id text not null,
        type text not null,
        body text not null,
        created_at real not null,
        primary key (agent, session, seq)
    );
    create table june_archived_messages (
        agent text not null,
        session text not null,
        generation integer not null,
        idx integer not null,
        turn_id text not null,
        role text not null,
        body text not null,
        primary key (agent, session, generation, idx)
    );
    create table june_archived_steps (
        agent text not null,
        session text not null,
        generation integer not null,
        step_id text not null,
        turn_id text,
        data text not null,
        primary key (agent, session, generation, step_id)
    );
    """,
    # 2: why a turn's last attempt ended, and the park's expiry stamped by the store
    """
    alter table june_turns add column last_error text;
    alter table june_sessions add column park_expires_at real;
    """,
    # 3: the latest context summary of a session, found without reading its transcript
    """
    create index june_messages_summaries on june_messages (agent, session, idx) where role = 'summary';
    """,
]


class _Handle:
    """A sync tool's view of the open transaction (``?`` placeholders, as sqlite3 has them)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, *params: Any) -> int:
        return self._conn.execute(sql, params).rowcount

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self._conn.execute(sql, params).fetchall()]

    def unwrap(self) -> sqlite3.Connection:
        return self._conn


class SQLiteStore:
    """The SessionStore on a SQLite file (or ``:memory:``).

    On a file it holds the file's lock (``<path>.lock``) until :meth:`close`: a second store on the
    same file, in another process, waits up to ``lock_timeout_s`` for it, then raises
    :class:`~june_worker.errors.StoreLockedError`; in the same process it raises at once.
    """

    supports_rollback = True

    def __init__(self, path: str | Path = ":memory:", *, lock_timeout_s: float = 10.0) -> None:
        self.path = str(path)
        self._file_lock: FileLock | None = None
        if self.path not in (":memory:", ""):
            self._file_lock = FileLock.acquire(self.path, timeout_s=lock_timeout_s)
            weakref.finalize(self, self._file_lock.release)  # a store dropped without close() lets go too
        try:
            self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
        except BaseException:
            if self._file_lock is not None:
                self._file_lock.release()
            raise
        self._lock = threading.RLock()
        self._depth = 0
        if self.path != ":memory:":
            self._conn.execute("pragma journal_mode=wal")
            self._conn.execute("pragma synchronous=normal")
        self._conn.execute("pragma foreign_keys=on")
        self.migrate()

    # --- schema ------------------------------------------------------------------------------------

    def migrate(self) -> None:
        """Apply missing migrations, each in its own transaction; safe to run from many processes."""
        with self._lock:
            self._conn.execute("create table if not exists june_schema (version integer primary key, applied_at real)")
            for version, script in enumerate(_MIGRATIONS, start=1):
                with self._tx():
                    done = self._conn.execute("select 1 from june_schema where version = ?", (version,)).fetchone()
                    if done:
                        continue
                    for statement in script.split(";"):
                        if statement.strip():
                            self._conn.execute(statement)
                    self._conn.execute("insert into june_schema values (?, ?)", (version, time.time()))

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """A transaction; nested in an open one (a sync tool calling the store) it is a savepoint."""
        with self._lock:
            if self._conn.in_transaction:
                self._depth += 1
                name = f"june_sp{self._depth}"
                self._conn.execute(f"savepoint {name}")
                try:
                    yield self._conn
                except BaseException:
                    self._conn.execute(f"rollback to {name}")
                    self._conn.execute(f"release {name}")
                    raise
                finally:
                    self._depth -= 1
                self._conn.execute(f"release {name}")
                return
            self._conn.execute("begin immediate")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("rollback")
                raise
            self._conn.execute("commit")

    def _ensure_session(self, conn: sqlite3.Connection, ref: SessionRef) -> None:
        conn.execute("insert or ignore into june_sessions (agent, session) values (?, ?)", (ref.agent, ref.session))

    # --- reads -------------------------------------------------------------------------------------

    def load(self, ref: SessionRef) -> SessionSnapshot:
        with self._lock:
            conn = self._conn
            row = conn.execute(
                "select generation, status, suspended, event_seq, reset_pending, park_expires_at from june_sessions "
                "where agent = ? and session = ?",
                (ref.agent, ref.session),
            ).fetchone()
            messages = [
                message_from_row(role, turn_id, body)
                for role, turn_id, body in conn.execute(
                    "select role, turn_id, body from june_messages where agent = ? and session = ? order by idx",
                    (ref.agent, ref.session),
                )
            ]
            steps = {
                step_id: StepRecord(step_id=step_id, turn_id=turn_id, data=json.loads(data))
                for step_id, turn_id, data in conn.execute(
                    "select step_id, turn_id, data from june_steps where agent = ? and session = ?",
                    (ref.agent, ref.session),
                )
            }
            (compacted_at,) = conn.execute(
                "select max(idx) from june_messages where agent = ? and session = ? and role = 'summary'",
                (ref.agent, ref.session),
            ).fetchone()
        if row is None:
            return SessionSnapshot(
                ref_agent=ref.agent, ref_session=ref.session, messages=messages, steps=steps, compacted_at=compacted_at
            )
        generation, status, suspended, event_seq, reset_pending, expires_at = row
        return SessionSnapshot(
            ref_agent=ref.agent,
            ref_session=ref.session,
            generation=generation,
            status=status,
            suspended=_parked(suspended, expires_at),
            reset_pending=bool(reset_pending),
            messages=messages,
            steps=steps,
            event_seq=event_seq,
            compacted_at=compacted_at,
        )

    def pending(self, ref: SessionRef) -> SuspendedCheckpoint | None:
        with self._lock:
            row = self._conn.execute(
                "select suspended, park_expires_at from june_sessions where agent = ? and session = ?",
                (ref.agent, ref.session),
            ).fetchone()
        return _parked(row[0], row[1]) if row else None

    def get_turn(self, ref: SessionRef, turn_id: str) -> TurnRecord | None:
        with self._lock:
            row = self._conn.execute(
                f"select {_TURN_COLUMNS} from june_turns where agent = ? and session = ? and turn_id = ?",
                (ref.agent, ref.session, turn_id),
            ).fetchone()
        return _turn(ref, row) if row else None

    def child_turns(self, parent: SessionRef, parent_turn_id: str, agents: Collection[str]) -> list[TurnRecord]:
        low, high = f"{parent.session}:sub:", f"{parent.session}:sub;"  # ';' follows ':': the ids under the prefix
        out: list[TurnRecord] = []
        with self._lock:
            for agent in sorted(agents):
                rows = self._conn.execute(
                    f"select session, {_TURN_COLUMNS} from june_turns where agent = ? and session >= ? and session < ? "
                    "and json_extract(payload, '$.parent.turn_id') = ? and json_extract(payload, '$.parent.agent') = ? "
                    "and json_extract(payload, '$.parent.session') = ? order by session, position",
                    (agent, low, high, parent_turn_id, parent.agent, parent.session),
                ).fetchall()
                out.extend(_turn(SessionRef(agent, row[0]), row[1:]) for row in rows)
        return out

    def unfinished_turns(self, ref: SessionRef) -> list[TurnRecord]:
        with self._lock:
            rows = self._conn.execute(
                f"select {_TURN_COLUMNS} from june_turns where agent = ? and session = ? "
                "and status in ('queued', 'running') order by position",
                (ref.agent, ref.session),
            ).fetchall()
        return [_turn(ref, r) for r in rows]

    def events(self, ref: SessionRef, *, turn_id: str | None = None, after_seq: int = 0) -> list[TurnEvent]:
        sql = "select body from june_events where agent = ? and session = ? and seq > ?"
        params: list[Any] = [ref.agent, ref.session, after_seq]
        if turn_id is not None:
            sql += " and turn_id = ?"
            params.append(turn_id)
        with self._lock:
            rows = self._conn.execute(sql + " order by seq", params).fetchall()
        return [TurnEventAdapter.validate_json(body) for (body,) in rows]

    # --- writes ------------------------------------------------------------------------------------

    def commit(self, ref: SessionRef, commit: Commit | CommitBuilder, *, fence: int | None = None) -> list[TurnEvent]:
        with self._tx() as conn:
            if not isinstance(commit, Commit):
                commit = commit(_Handle(conn))
            self._ensure_session(conn, ref)
            key = (ref.agent, ref.session)
            row = conn.execute(
                "select fence, suspended, event_seq, park_expires_at from june_sessions where agent = ? and session = ?",
                key,
            ).fetchone()
            current_fence, suspended, event_seq, park_expires_at = row
            _check_fence(ref, current_fence, fence)
            now = time.time()
            if commit.expect_suspended is not None:
                parked = SuspendedCheckpoint.model_validate_json(suspended) if suspended else None
                turn_id, input_id = commit.expect_suspended
                if not parked_on(parked, turn_id, input_id, commit.expect_version):
                    raise ResumeConflictError(f"session {ref} is not parked on turn {turn_id} input {input_id!r}")
                if commit.expect_expired and (park_expires_at is None or park_expires_at > now):
                    raise ResumeConflictError(f"session {ref}: input {input_id!r} has not expired")
            if commit.turn_id is not None and (commit.turn_status is not None or commit.expect_not_cancelled):
                turn = conn.execute(
                    "select status, cancel_reason from june_turns where agent = ? and session = ? and turn_id = ?",
                    (*key, commit.turn_id),
                ).fetchone()
                if turn is not None and commit.turn_status is not None and turn[0] in ENDED_TURN_STATUSES:
                    raise TurnEndedError(
                        f"session {ref}: turn {commit.turn_id} has ended ({turn[0]}); its status stays"
                    )
                if turn is not None and commit.expect_not_cancelled and turn[1] is not None:
                    raise CancelRequestedError(turn[1])
            try:
                conn.executemany(
                    "insert into june_messages (agent, session, idx, turn_id, role, body) values (?, ?, ?, ?, ?, ?)",
                    [(*key, idx, m.turn_id, m.role, message_body(m)) for idx, m in commit.messages],
                )
            except sqlite3.IntegrityError as exc:
                raise MessageIndexTakenError(f"session {ref}: a message index of this commit is taken ({exc})") from exc
            conn.executemany(
                "insert or ignore into june_steps (agent, session, step_id, turn_id, data) values (?, ?, ?, ?, ?)",
                [(*key, s.step_id, s.turn_id, dumps(s.data)) for s in commit.steps],
            )
            stamped, rows = event_rows(commit.events, event_seq)
            if rows:
                conn.executemany(
                    "insert into june_events (agent, session, seq, turn_id, type, body, created_at) "
                    "values (?, ?, ?, ?, ?, ?, ?)",
                    [(*key, *r, now) for r in rows],
                )
            sets, params = ["event_seq = ?"], [event_seq + len(rows)]
            if commit.status is not None:
                sets.append("status = ?")
                params.append(commit.status)
            if commit.suspended is not None:
                sets += ["suspended = ?", "park_expires_at = ?"]
                params += [commit.suspended.model_dump_json(by_alias=True), park_expiry(commit, now, park_expires_at)]
            elif commit.clear_suspended:
                sets.append("suspended = null, park_expires_at = null")
            conn.execute(f"update june_sessions set {', '.join(sets)} where agent = ? and session = ?", (*params, *key))
            if commit.turn_id is not None and commit.turn_status is not None:
                finished = commit.turn_status not in ("queued", "running")
                conn.execute(
                    "update june_turns set status = ?, result = ?, finished_at = ?, attempts = case ? "
                    "when 'running' then attempts + ? when 'queued' then 0 else attempts end "
                    "where agent = ? and session = ? and turn_id = ?",
                    (
                        commit.turn_status,
                        commit.turn_result.model_dump_json(by_alias=True) if commit.turn_result else None,
                        now if finished else None,
                        commit.turn_status,
                        int(commit.count_attempt),
                        *key,
                        commit.turn_id,
                    ),
                )
            if commit.turn_id is not None and commit.turn_error is not None:
                conn.execute(
                    "update june_turns set last_error = ? where agent = ? and session = ? and turn_id = ?",
                    (commit.turn_error, *key, commit.turn_id),
                )
            if commit.turn_id is not None and commit.cancel_reason is not None:
                conn.execute(
                    "update june_turns set cancel_reason = coalesce(cancel_reason, ?) where agent = ? and session = ? "
                    "and turn_id = ? and status not in ('completed', 'failed', 'cancelled', 'rejected')",
                    (commit.cancel_reason, *key, commit.turn_id),
                )
            return stamped

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
        with self._tx() as conn:
            self._ensure_session(conn, ref)
            key = (ref.agent, ref.session)
            current_fence, event_seq = conn.execute(
                "select fence, event_seq from june_sessions where agent = ? and session = ?", key
            ).fetchone()
            _check_fence(ref, current_fence, fence)
            existing = self._turn_row(conn, ref, turn_id)
            if existing is not None and (new_only or existing.status not in UNFINISHED_TURN_STATUSES):
                return existing, []
            now = time.time()
            result = Rejected(turn_id=turn_id, reason=reason).model_dump_json()
            if existing is None:
                (position,) = conn.execute(
                    "update june_sessions set next_position = next_position + 1 where agent = ? and session = ? "
                    "returning next_position - 1",
                    key,
                ).fetchone()
                conn.execute(
                    "insert into june_turns (agent, session, turn_id, position, status, payload, result, generation, "
                    "created_at, finished_at) select ?, ?, ?, ?, 'rejected', ?, ?, generation, ?, ? "
                    "from june_sessions where agent = ? and session = ?",
                    (*key, turn_id, position, payload.model_dump_json(), result, now, now, *key),
                )
            else:
                conn.execute(
                    "update june_turns set status = 'rejected', result = ?, finished_at = ? "
                    "where agent = ? and session = ? and turn_id = ?",
                    (result, now, *key, turn_id),
                )
            stamped, rows = event_rows([rejection_event(turn_id, reason)], event_seq)
            conn.executemany(
                "insert into june_events (agent, session, seq, turn_id, type, body, created_at) "
                "values (?, ?, ?, ?, ?, ?, ?)",
                [(*key, *r, now) for r in rows],
            )
            conn.execute(
                "update june_sessions set event_seq = ? where agent = ? and session = ?", (event_seq + 1, *key)
            )
            rec = self._turn_row(conn, ref, turn_id)
            assert rec is not None
            return rec, stamped

    def _turn_row(self, conn: sqlite3.Connection, ref: SessionRef, turn_id: str) -> TurnRecord | None:
        row = conn.execute(
            f"select {_TURN_COLUMNS} from june_turns where agent = ? and session = ? and turn_id = ?",
            (ref.agent, ref.session, turn_id),
        ).fetchone()
        return _turn(ref, row) if row else None

    def enqueue_turn(self, ref: SessionRef, turn_id: str, payload: TurnPayload) -> tuple[TurnRecord, bool]:
        with self._tx() as conn:
            self._ensure_session(conn, ref)
            key = (ref.agent, ref.session)
            existing = conn.execute(
                f"select {_TURN_COLUMNS} from june_turns where agent = ? and session = ? and turn_id = ?",
                (*key, turn_id),
            ).fetchone()
            if existing:
                return _turn(ref, existing), False
            position, generation = conn.execute(
                "update june_sessions set next_position = next_position + 1 where agent = ? and session = ? "
                "returning next_position - 1, generation",
                key,
            ).fetchone()
            now = time.time()
            conn.execute(
                "insert into june_turns (agent, session, turn_id, position, status, payload, generation, created_at) "
                "values (?, ?, ?, ?, 'queued', ?, ?, ?)",
                (*key, turn_id, position, payload.model_dump_json(), generation, now),
            )
            return (
                TurnRecord(
                    turn_id=turn_id,
                    agent=ref.agent,
                    session=ref.session,
                    position=position,
                    payload=payload,
                    generation=generation,
                    created_at=now,
                ),
                True,
            )

    def request_cancel(self, ref: SessionRef, reason: str, *, turn_ids: Sequence[str] | None = None) -> list[str]:
        sql = (
            "update june_turns set cancel_reason = coalesce(cancel_reason, ?) where agent = ? and session = ? "
            "and status in ('queued', 'running')"
        )
        params: list[Any] = [reason, ref.agent, ref.session]
        if turn_ids is not None:
            sql += f" and turn_id in ({', '.join('?' for _ in turn_ids)})"
            params.extend(turn_ids)
        with self._tx() as conn:
            return [r[0] for r in conn.execute(sql + " returning turn_id", params).fetchall()]

    def reset(self, ref: SessionRef, *, fence: int | None = None) -> ResetResult:
        with self._tx() as conn:
            self._ensure_session(conn, ref)
            key = (ref.agent, ref.session)
            generation, current_fence = conn.execute(
                "select generation, fence from june_sessions where agent = ? and session = ?", key
            ).fetchone()
            _check_fence(ref, current_fence, fence)
            conn.execute(
                "insert into june_archived_messages select agent, session, ?, idx, turn_id, role, body "
                "from june_messages where agent = ? and session = ?",
                (generation, *key),
            )
            conn.execute(
                "insert into june_archived_steps select agent, session, ?, step_id, turn_id, data "
                "from june_steps where agent = ? and session = ?",
                (generation, *key),
            )
            conn.execute("delete from june_messages where agent = ? and session = ?", key)
            conn.execute("delete from june_steps where agent = ? and session = ?", key)
            conn.execute(
                "update june_sessions set generation = generation + 1, status = 'new', suspended = null, "
                "park_expires_at = null, reset_pending = 0 where agent = ? and session = ?",
                key,
            )
        return ResetResult(previous_session=f"{ref.session}#g{generation}", generation=generation)

    def acquire_fence(self, ref: SessionRef) -> int:
        """Take the session's fencing token (tests of fenced commits; the worker uses Postgres leases)."""
        with self._tx() as conn:
            self._ensure_session(conn, ref)
            (fence,) = conn.execute(
                "update june_sessions set fence = fence + 1 where agent = ? and session = ? returning fence",
                (ref.agent, ref.session),
            ).fetchone()
        return int(fence)

    def close(self) -> None:
        """Close the connection and let the file's lock go: another process may serve the file now."""
        with self._lock:
            self._conn.close()
            if self._file_lock is not None:
                self._file_lock.release()


_TURN_COLUMNS = (
    "turn_id, position, status, payload, cancel_reason, attempts, result, generation, created_at, finished_at, "
    "last_error"
)


def _check_fence(ref: SessionRef, current: int, fence: int | None) -> None:
    if fence is not None and fence != current:
        raise LeaseLostError(f"session {ref} is leased under fence {current}, not {fence}")


def _parked(suspended: str | None, expires_at: float | None) -> SuspendedCheckpoint | None:
    """The stored checkpoint, its request's expiry being the store's own stamp."""
    if not suspended:
        return None
    return SuspendedCheckpoint.model_validate_json(suspended).with_expiry(expires_at)


def _turn(ref: SessionRef, row: Sequence[Any]) -> TurnRecord:
    turn_id, position, status, payload, cancel_reason, attempts, result, generation, created_at, finished_at = row[:10]
    return TurnRecord(
        turn_id=turn_id,
        agent=ref.agent,
        session=ref.session,
        position=position,
        status=status,
        payload=TurnPayload.model_validate_json(payload),
        cancel_reason=cancel_reason,
        attempts=attempts,
        result=TurnResultAdapter.validate_json(result) if result else None,
        generation=generation,
        created_at=created_at,
        finished_at=finished_at,
        last_error=row[10],
    )
