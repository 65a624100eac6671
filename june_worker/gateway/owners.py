"""Who opened each session through the gateway: ``june_gateway_sessions``, the gateway's own table.

One row per session a gateway opened: ``(agent, session) → owner`` (the principal whose turn
created it) and when. The workers never read or write it; the gateway creates it on first use
(``create table if not exists`` under an advisory lock, so gateways starting together do not
race), so it needs no migration of the store's. A row is written once and never changed: a
reset keeps the session's owner.

The rule a reader must not break: **a claim never takes over a session**: it inserts only where
no row exists, and the owner is whatever row the database kept.
"""

from __future__ import annotations

from typing import Any

from psycopg_pool import ConnectionPool

from ..engine.store import SessionRef

__all__ = ["SessionOwners"]

_LOCK = 0x6A756E65_6777  # "june" "gw": the advisory lock of this table's creation

_SCHEMA = """
create table if not exists june_gateway_sessions (
    agent text collate "C" not null,
    session text collate "C" not null,
    owner text not null,
    opened_at timestamptz not null default now(),
    primary key (agent, session)
)
"""

_OWNER = "select owner from june_gateway_sessions where agent = %(agent)s and session = %(session)s"

_CLAIM = """
insert into june_gateway_sessions (agent, session, owner) values (%(agent)s, %(session)s, %(owner)s)
on conflict (agent, session) do nothing
"""


class SessionOwners:
    """The owner table over the gateway's connection pool (autocommit connections; blocking calls)."""

    def __init__(self, pool: ConnectionPool[Any]) -> None:
        self._pool = pool
        self._ready = False

    def _ensure(self, conn: Any) -> None:
        if self._ready:
            return
        with conn.transaction():
            conn.execute("select pg_advisory_xact_lock(%s)", (_LOCK,))
            conn.execute(_SCHEMA)
        self._ready = True

    def owner(self, ref: SessionRef) -> str | None:
        """The principal that opened the session here; None when no gateway opened it."""
        with self._pool.connection() as conn:
            self._ensure(conn)
            row = conn.execute(_OWNER, {"agent": ref.agent, "session": ref.session}).fetchone()
        return str(row[0]) if row else None

    def claim(self, ref: SessionRef, owner: str) -> str:
        """Record ``owner`` as the session's opener unless someone was first; return the owner that stands."""
        key = {"agent": ref.agent, "session": ref.session, "owner": owner}
        with self._pool.connection() as conn:
            self._ensure(conn)
            conn.execute(_CLAIM, key)
            row = conn.execute(_OWNER, key).fetchone()
        assert row is not None, "a claimed session has an owner row"
        return str(row[0])
