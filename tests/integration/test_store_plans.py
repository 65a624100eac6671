"""The plans the store's statements keep: made once per connection (generic plans), they must stay good as the
tables grow.

A worker prepares its statements on its first turns, often when the tables are empty or small (a new
deployment, a new partition), and keeps those plans for the life of its connections: Postgres plans a
prepared statement again only when something invalidates it (an ANALYZE of a table it reads, at most once
a minute per database from autovacuum, while a busy table grows tenfold in that minute). A plan made on a
near-empty table scans it whole (cheapest then), and keeps scanning it whole as it grows: Postgres' CPU per
turn rises round after round until the next ANALYZE (docs/benchmarks.md, issue 19). So every per-turn
statement must keep to its keys' indexes whatever the statistics said when it was planned.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from june_worker.stores import PostgresStore
from june_worker.worker import control
from june_worker.worker.host import WorkerHost
from june_worker.worker.payloads import TurnMessage
from june_worker.worker.settings import WorkerSettings

from . import agents
from .conftest import _database

pytestmark = pytest.mark.integration

TABLES = ("june_sessions", "june_turns", "june_messages", "june_steps", "june_events")


@pytest.fixture
def db(database_url: str) -> Iterator[str]:
    yield from _database(database_url)


def _seq_scans(db_url: str) -> dict[str, int]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "select relname, seq_scan from pg_stat_user_tables where relname = any(%s)", (list(TABLES),)
        ).fetchall()
    return {name: int(n) for name, n in rows}


def _turn(host: WorkerHost, session: str) -> dict[str, Any]:
    message = TurnMessage.model_validate(
        {"turn_id": f"t_{uuid.uuid4().hex}", "agent": "ops", "session": session, "text": "order 1 widget"}
    )
    return control.intake(host, message)


def test_statements_prepared_on_empty_tables_keep_to_their_indexes_as_the_tables_grow(db: str, redis_url: str) -> None:
    # Given a fresh database (autovacuum kept away: the test gathers statistics itself) and a worker whose
    # connections prepare their statements on its first turns
    PostgresStore(db).close()
    with psycopg.connect(db, autocommit=True) as conn:
        for table in TABLES:
            conn.execute(f"alter table {table} set (autovacuum_enabled = false)")
    env = {"JUNE_DATABASE_URL": db, "JUNE_REDIS_URL": redis_url, "JUNE_KEY_PREFIX": f"it-{uuid.uuid4().hex[:8]}"}
    host = WorkerHost(WorkerSettings.from_env(env), agents={a.name: a for a in agents.ALL()})
    try:
        for i in range(3):
            assert _turn(host, f"first-{i}")["status"] == "completed"
        # statistics of a few rows (as autovacuum gathers them after a worker's first turns); the next turn plans
        # its statements again on them
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(f"analyze {', '.join(TABLES)}")
        assert _turn(host, "after-analyze")["status"] == "completed"
        # When the tables grow by thousands of sessions and the same worker goes on running turns
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(
                """
                with s as (
                    insert into june_sessions (agent, session, event_seq)
                    select 'bulk', 's' || g, 2 from generate_series(1, 20000) g returning agent, session
                ), t as (
                    insert into june_turns (agent, session, turn_id, position, status, payload)
                    select agent, session, 't1', 1, 'completed', '{}' from s returning agent, session
                ), m as (
                    insert into june_messages (agent, session, idx, turn_id, role, body)
                    select agent, session, 0, 't1', 'user', '{}' from t returning agent, session
                ), st as (
                    insert into june_steps (agent, session, step_id, turn_id, data)
                    select agent, session, 'model:1', 't1', '{}' from m returning agent, session
                )
                insert into june_events (agent, session, seq, turn_id, type, body)
                select agent, session, 1, 't1', 'turn.started', '{}' from st
                """
            )
        before = _seq_scans(db)
        for i in range(5):
            assert _turn(host, f"later-{i}")["status"] == "completed"
    finally:
        host.close()  # its connections end: their statistics are in the counters below
    after = _seq_scans(db)
    # Then none of its statements read a whole table
    assert {t: after[t] - before[t] for t in TABLES} == dict.fromkeys(TABLES, 0)
