"""The per-session tables hash-partitioned by session (``june migrate --partitions N``): what a turn's statements
touch, and the conversion of a database that already holds sessions.

The contract suite (tests/contract) runs on a partitioned database too; this module checks the two rules
that only partitioning has: every statement a turn sends reads and writes its own session's partition and
no other (the plans the workers run, generic plans, looked at with EXPLAIN ANALYZE), and converting a live
database loses nothing: not a turn, not a message, not an event, also while a worker keeps committing.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import ClientCursor

from june_worker.engine.store import SessionRef, TurnPayload
from june_worker.errors import StoreUnavailableError
from june_worker.stores import PostgresStore
from june_worker.stores._pg_partition import SESSION_TABLES, partition_tables
from june_worker.worker import control
from june_worker.worker.host import WorkerHost
from june_worker.worker.payloads import ResumeMessage, TurnMessage
from june_worker.worker.settings import WorkerSettings

from . import agents
from .conftest import _database, wait_for

pytestmark = pytest.mark.integration

PARTITIONS = 8


@pytest.fixture
def db(database_url: str) -> Iterator[str]:
    yield from _database(database_url)


def _host(db_url: str, redis_url: str) -> WorkerHost:
    env = {"JUNE_DATABASE_URL": db_url, "JUNE_REDIS_URL": redis_url, "JUNE_KEY_PREFIX": f"it-{uuid.uuid4().hex[:8]}"}
    return WorkerHost(WorkerSettings.from_env(env), agents={a.name: a for a in agents.ALL()})


def _turn(host: WorkerHost, session: str, text: str, agent: str = "ops", turn_id: str | None = None) -> dict[str, Any]:
    message = TurnMessage.model_validate(
        {"turn_id": turn_id or f"t_{uuid.uuid4().hex}", "agent": agent, "session": session, "text": text}
    )
    return control.intake(host, message)


# --- every statement of a turn stays in its session's partition --------------------------------------------

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%s|%%")
_SCANS = ("Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan", "Tid Scan")


def _numbered(query: str, params: Any) -> tuple[str, list[Any]]:
    """``query`` with psycopg's placeholders as ``$1, $2...`` (named ones numbered once), and the values in order."""
    names: dict[str, int] = {}
    values: list[Any] = []

    def number(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        name = match.group(1)
        if name is None:
            values.append(params[len(values)])
            return f"${len(values)}"
        if name not in names:
            values.append(params[name])
            names[name] = len(values)
        return f"${names[name]}"

    return _PLACEHOLDER.sub(number, query), values


def _touched(plan: Any, out: list[str]) -> list[str]:
    """Relations that a scan node of an EXPLAIN ANALYZE plan (JSON) actually ran on (``Actual Loops`` > 0)."""
    if isinstance(plan, dict):
        if plan.get("Node Type") in _SCANS and plan.get("Actual Loops", 0) > 0:
            out.append(plan["Relation Name"])
        for value in plan.values():
            _touched(value, out)
    elif isinstance(plan, list):
        for value in plan:
            _touched(value, out)
    return out


class PlanProbe:
    """Runs, before each statement the host sends on its own thread, the same statement under EXPLAIN ANALYZE as a
    generic plan (as the store's connections plan it: ``plan_cache_mode = force_generic_plan``), on a connection of
    its own, in a transaction rolled back; keeps which relations its scans ran on."""

    def __init__(self, db_url: str) -> None:
        self.conn = psycopg.connect(db_url, autocommit=True)
        self.conn.execute("set plan_cache_mode = force_generic_plan")
        self.seen: list[tuple[str, list[str]]] = []
        self._thread = threading.current_thread()
        self._busy = False

    def explain(self, query: Any, params: Any) -> None:
        text = query if isinstance(query, str) else query.as_string(self.conn) if hasattr(query, "as_string") else None
        if threading.current_thread() is not self._thread or not isinstance(text, str) or "june_" not in text:
            return
        if self._busy:
            return  # the probe's own statements
        self._busy = True
        try:
            self._explain(text, params)
        finally:
            self._busy = False

    def _explain(self, text: str, params: Any) -> None:
        if not text.lstrip().lower().startswith(("select", "with", "insert", "update", "delete")):
            return
        numbered, values = _numbered(text, params or ())
        args = ClientCursor(self.conn).mogrify(", ".join(["%s"] * len(values)), values) if values else ""
        self.conn.execute("begin")
        try:
            self.conn.execute(f"prepare june_probe as {numbered}")
            (plan,) = self.conn.execute(f"explain (analyze, format json) execute june_probe({args})").fetchone()
        finally:
            self.conn.execute("rollback")
            self.conn.execute("deallocate june_probe")
        self.seen.append((" ".join(text.split())[:80], _touched(plan, [])))

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        original = psycopg.Cursor.execute

        def execute(cur: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
            self.explain(query, params)
            return original(cur, query, params, **kwargs)

        psycopg.Cursor.execute = execute  # type: ignore[method-assign]
        try:
            yield
        finally:
            psycopg.Cursor.execute = original  # type: ignore[method-assign]


def test_every_statement_of_a_turn_reads_and_writes_only_its_sessions_partition(db: str, redis_url: str) -> None:
    # Given a database whose per-session tables are hash-partitioned, and a worker host on it
    store = PostgresStore(db)
    assert store.partition(PARTITIONS) is True
    store.close()
    host = _host(db, redis_url)
    probe = PlanProbe(db)
    session = f"part-{uuid.uuid4().hex[:8]}"
    try:
        # When a session runs a turn with a sync tool, then a turn that parks, is answered and goes on
        _turn(host, session, "hello")  # the session's first turn creates its rows
        with probe.watching():
            assert _turn(host, session, "order 2 widget")["status"] == "completed"
            parked = _turn(host, session, "refund")
            assert parked["status"] == "suspended"
            answer = {"agent": "ops", "session": session, "turn_id": parked["turn_id"], "input_id": "approve-refund"}
            resumed = control.resume(
                host, ResumeMessage.model_validate({**answer, "value": True, "by": "op-1"}), lambda rec: None
            )
            assert resumed["status"] == "accepted"
            host.drain(SessionRef("ops", session))
    finally:
        host.close()
    with psycopg.connect(db, autocommit=True) as conn:
        (home,) = conn.execute(
            "select tableoid::regclass::text from june_sessions where agent = 'ops' and session = %s", (session,)
        ).fetchone()  # type: ignore[misc]
    probe.conn.close()
    own = home.removeprefix("june_sessions")  # "_p<n>": the same remainder in every per-session table
    # Then every statement ran its scans on the session's partition of each table, never another one
    assert len(probe.seen) >= 10, probe.seen
    strays = [
        (statement, rel)
        for statement, rels in probe.seen
        for rel in rels
        if any(rel.startswith(f"{t}_p") for t in SESSION_TABLES) and not rel.endswith(own)
    ]
    assert strays == []
    assert any(rels for _, rels in probe.seen)  # and the probe saw the scans it checks
    parents = [(s, r) for s, rels in probe.seen for r in rels if r in SESSION_TABLES]
    assert parents == []  # a partitioned parent holds no rows: nothing scans it


# --- converting a database that holds sessions -------------------------------------------------------------


def _contents(db_url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every per-session table, as text, in a fixed order."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        return {
            t: conn.execute(f"select t::text from {t} t order by 1").fetchall()  # noqa: S608 - our table names
            for t in SESSION_TABLES
        }


def _behind(db_url: str) -> int:
    """Sessions whose relay mark is behind their outbox."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("select count(*) from june_sessions where relayed_seq < event_seq").fetchone()
    return int(row[0]) if row else 0


def _events(db_url: str, agent: str, session: str) -> list[tuple[int, str]]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "select seq, type from june_events where agent = %s and session = %s order by seq", (agent, session)
        ).fetchall()
    return [(int(seq), str(kind)) for seq, kind in rows]


def test_converting_a_database_that_holds_sessions_keeps_every_row_and_every_turn_goes_on(
    db: str, redis_url: str
) -> None:
    # Given an unpartitioned database with a finished turn, a parked one, a reset session, and a queued turn
    host = _host(db, redis_url)
    tag = uuid.uuid4().hex[:6]
    done, parked_s, reset_s, queued_s = (f"{name}-{tag}" for name in ("done", "parked", "reset", "queued"))
    try:
        assert _turn(host, done, "order 3 widget")["status"] == "completed"
        parked = _turn(host, parked_s, "refund")
        assert parked["status"] == "suspended"
        assert _turn(host, reset_s, "hello")["status"] == "completed"
        assert control.reset(host, _reset(reset_s), lambda rec: None)["status"] == "reset"
        assert _turn(host, reset_s, "hello again")["status"] == "completed"
        queued_id = f"t_{uuid.uuid4().hex}"
        host.store.enqueue_turn(SessionRef("ops", queued_s), queued_id, TurnPayload(text="order 1 bolt"))
        # (the host's heartbeat writes the relay marks of what it published: let them land before the snapshot)
        wait_for(lambda: _behind(db) == 0, what="the host's heartbeat to mark its sessions relayed")
        before = _contents(db)
        assert all(before[t] for t in SESSION_TABLES), {t: len(rows) for t, rows in before.items()}
        # When the tables are converted to hash partitions
        store = PostgresStore(db)
        try:
            assert store.partition(PARTITIONS) is True
            assert store.partitions() == dict.fromkeys(SESSION_TABLES, PARTITIONS)
            assert store.partition(PARTITIONS) is False  # once
        finally:
            store.close()
        # Then every row is there as it was, and every session goes on from where it stood
        assert _contents(db) == before
        answer = {"agent": "ops", "session": parked_s, "turn_id": parked["turn_id"], "input_id": "approve-refund"}
        assert (
            control.resume(host, ResumeMessage.model_validate({**answer, "value": True, "by": "op-1"}), lambda r: 0)[
                "status"
            ]
            == "accepted"
        )
        host.drain(SessionRef("ops", parked_s))
        assert host.store.get_turn(SessionRef("ops", parked_s), parked["turn_id"]).status == "completed"  # type: ignore[union-attr]
        host.drain(SessionRef("ops", queued_s))
        assert host.store.get_turn(SessionRef("ops", queued_s), queued_id).status == "completed"  # type: ignore[union-attr]
        assert _turn(host, done, "order 1 nut")["status"] == "completed"
        # and a turn recorded before its message is sent (june_enqueue_turn, made again over the new june_turns)
        late = f"t_{uuid.uuid4().hex}"
        assert host.store.enqueue_turn(SessionRef("ops", queued_s), late, TurnPayload(text="order 2 nut"))[1] is True
        host.drain(SessionRef("ops", queued_s))
        assert host.store.get_turn(SessionRef("ops", queued_s), late).status == "completed"  # type: ignore[union-attr]
    finally:
        host.close()
    for session in (done, parked_s, reset_s, queued_s):
        seqs = [seq for seq, _ in _events(db, "ops", session)]
        assert seqs == list(range(1, len(seqs) + 1)), (session, seqs)


def _waiting_on_a_lock(db_url: str) -> bool:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "select count(*) from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock'"
        ).fetchone()
    return bool(row and row[0])


def _reset(session: str) -> Any:
    from june_worker.worker.payloads import ResetMessage

    return ResetMessage.model_validate({"agent": "ops", "session": session})


def test_a_worker_that_keeps_running_turns_while_the_database_is_converted_loses_none(db: str, redis_url: str) -> None:
    # Given a worker host running turn after turn (a few sessions, several turns each) on an unpartitioned database
    PostgresStore(db).close()
    host = _host(db, redis_url)
    sessions = [f"live-{uuid.uuid4().hex[:6]}-{i}" for i in range(4)]
    outcomes: list[str] = []
    errors: list[BaseException] = []
    retried: list[int] = []  # turns whose statement met the conversion mid-way (a transient fault)
    stop = threading.Event()

    def run() -> None:
        try:
            n = 0
            while not stop.is_set() or n < 8:
                turn_id = f"t_{n}_{uuid.uuid4().hex}"
                while True:
                    try:
                        outcome = _turn(host, sessions[n % len(sessions)], f"order {n + 1} widget", turn_id=turn_id)
                        break
                    except StoreUnavailableError:
                        retried.append(n)  # as june.turn's autoretry does: the same message again
                outcomes.append(outcome["status"])
                n += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            errors.append(exc)

    worker = threading.Thread(target=run, name="live-turns")
    worker.start()
    try:
        wait_for(lambda: len(outcomes) >= 4 or errors, what="the first turns")
        # When the tables are converted under it, the conversion's transaction held open until one of the worker's
        # statements waits for the tables it locked (so that statement runs on the new tables once it commits)
        with psycopg.connect(db) as conn, conn.transaction():
            assert partition_tables(conn, PARTITIONS) is True
            wait_for(lambda: _waiting_on_a_lock(db), what="a statement of the worker to wait for the conversion")
        converted_at = len(outcomes)
        wait_for(lambda: len(outcomes) >= converted_at + 4 or errors, what="turns after the conversion")
    finally:
        stop.set()
        worker.join(60)
        host.close()
    # Then every turn it ran completed, before, during and after, and every session's log is whole, in order
    assert errors == []
    assert outcomes and set(outcomes) == {"completed"}
    with psycopg.connect(db, autocommit=True) as conn:
        statuses = conn.execute("select status, count(*) from june_turns group by status").fetchall()
        orders = conn.execute("select count(*) from it_orders").fetchone()
    assert statuses == [("completed", len(outcomes))]
    assert orders == (len(outcomes),)  # each turn's sync tool wrote its row once
    for session in sessions:
        seqs = [seq for seq, _ in _events(db, "ops", session)]
        assert seqs == list(range(1, len(seqs) + 1)), (session, seqs)


def test_the_conversion_keeps_what_other_migrations_added_and_later_ones_still_apply(db: str) -> None:
    # Given migrations (besides june's own) that gave the tables a column, an index, a function over a row type
    # and a view, before the conversion
    PostgresStore(db).close()
    role = f"june_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(f"create role {role}")
        conn.execute(f"grant select on june_turns to {role}")
        conn.execute("revoke execute on function june_enqueue_turn(text, text, text, json, boolean) from public")
        conn.execute(f"grant execute on function june_enqueue_turn(text, text, text, json, boolean) to {role}")
        conn.execute("create table june_turn_audit (turn_id text)")
        conn.execute(
            "create function june_audit() returns trigger language plpgsql as "
            "'begin insert into june_turn_audit values (new.turn_id); return new; end'"
        )
        conn.execute(
            "create trigger june_turns_audit after insert on june_turns for each row execute function june_audit()"
        )
        conn.execute("alter table june_turns add column channel text not null default 'cli'")
        conn.execute("create index june_turns_by_channel on june_turns (channel) where channel <> 'cli'")
        conn.execute("create function june_steps_of(a text, s text) returns setof june_steps language sql as "
                     "'select * from june_steps where agent = a and session = s'")  # fmt: skip
        conn.execute(
            "create view june_open_sessions as select agent, session from june_sessions where status <> 'done'"
        )
        conn.execute("insert into june_steps (agent, session, step_id, data) values ('ops', 's1', 'model:1', '{}')")
    # When the tables are converted
    store = PostgresStore(db)
    try:
        assert store.partition(4) is True
    finally:
        store.close()
    with psycopg.connect(db, autocommit=True) as conn:
        # Then they are all there, on the partitioned tables
        default = conn.execute(
            "select column_default from information_schema.columns where table_name = 'june_turns' and column_name = 'channel'"
        ).fetchone()
        assert default == ("'cli'::text",)
        index = conn.execute("select c.relkind from pg_class c where c.relname = 'june_turns_by_channel'").fetchone()
        assert index == ("I",)  # a partitioned index, with one on each partition
        assert conn.execute("select step_id from june_steps_of('ops', 's1')").fetchall() == [("model:1",)]
        assert conn.execute("select count(*) from june_open_sessions").fetchone() == (0,)
        # with their privileges (the function's EXECUTE still not public) and triggers
        privileges = conn.execute(
            "select has_table_privilege(%(r)s, 'june_turns', 'select'), has_table_privilege(%(r)s, 'june_turns', 'insert'),"
            " has_function_privilege(%(r)s, 'june_enqueue_turn(text,text,text,json,boolean)', 'execute'),"
            " has_function_privilege('public', 'june_enqueue_turn(text,text,text,json,boolean)', 'execute')",
            {"r": role},
        ).fetchone()
        assert privileges == (True, False, True, False)
        conn.execute("insert into june_turns (agent, session, turn_id, position, status, payload) "
                     "values ('ops', 's9', 't9', 1, 'queued', '{}')")  # fmt: skip
        assert conn.execute("select turn_id from june_turn_audit").fetchall() == [("t9",)]
        # the channels' foreign key into june_turns still holds: a render needs its turn, and goes with it
        conn.execute("insert into june_channel_renders values ('ops', 's9', 't9', 'reply', '{}')")
        with pytest.raises(psycopg.errors.ForeignKeyViolation):
            conn.execute("insert into june_channel_renders values ('ops', 's9', 'no-such-turn', 'reply', '{}')")
        conn.execute("delete from june_turns where turn_id = 't9'")
        assert conn.execute("select count(*) from june_channel_renders").fetchone() == (0,)
        # and a later migration applies as it would have before
        conn.execute("alter table june_messages add column lang text")
        conn.execute("create index june_messages_lang on june_messages (lang)")
        per_partition = conn.execute(
            "select count(*) from pg_indexes where tablename like 'june_messages_p%' and indexdef like '%(lang)%'"
        ).fetchone()
        assert per_partition == (4,)
        conn.execute(f"drop owned by {role}")
        conn.execute(f"drop role {role}")


def test_june_migrate_partitions_converts_once_and_refuses_a_count_out_of_range(db: str) -> None:
    def june(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "JUNE_DATABASE_URL": db}
        return subprocess.run(
            [sys.executable, "-m", "june_worker.cli", "migrate", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    first, again, bad = june("--partitions", "4"), june("--partitions", "4"), june("--partitions", "1")
    assert first.returncode == 0 and "per-session tables now in 4 hash partitions" in first.stdout, first.stderr
    assert again.returncode == 0 and "already in 4 hash partitions" in again.stdout, again.stderr
    assert bad.returncode == 2 and "partitions must be between 2 and 1024, not 1" in bad.stderr
    store = PostgresStore(db)
    try:
        assert store.partitions() == dict.fromkeys(SESSION_TABLES, 4)
    finally:
        store.close()
