"""Postgres connections for the stores and the worker: the pool's checkout, what counts as the database
being unavailable, and a sync tool's handle on the step's transaction.

Owns :func:`pooled` (a pooled connection in autocommit whose faults become
:class:`~june_worker.errors.StoreUnavailableError`), :func:`is_unavailable` (the line between a fault of the
connection or server and a statement's own error), the per-connection setup and checkout check the store's
pool runs (:func:`configure_connection`, :func:`check_connection`), and :class:`ToolHandle`. Statements live with their users.
"""

from __future__ import annotations

import contextlib
import functools
import select
from collections.abc import Iterator
from typing import Any, TypeAlias

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import TupleRow
from psycopg_pool import ConnectionPool

from ..errors import StoreUnavailableError
from ._sql import qmark_to_format

__all__ = ["Conn", "ToolHandle", "check_connection", "configure_connection", "is_unavailable", "pooled"]

Conn: TypeAlias = psycopg.Connection[TupleRow]


@functools.lru_cache(maxsize=512)
def _format(sql: str) -> str:
    return qmark_to_format(sql)


# A tool's statement: under a savepoint of its own (a failure rolls back the statement alone), planned with the
# planner's defaults (the store's own statements run without sequential scans: see configure_connection).
_TOOL_STATEMENT = "savepoint june_stmt; set local enable_seqscan = on; {}; set local enable_seqscan = off; release savepoint june_stmt"


class ToolHandle:
    """A sync tool's view of the step's transaction. ``BEGIN`` goes out with the first use.

    Each statement runs under its own savepoint, in the same round trip (client-side binding,
    one simple query): a statement that fails rolls back alone, so a tool that catches the error
    leaves the step's transaction usable. It is planned with the planner's defaults (sequential
    scans allowed, unlike the store's own statements); on :meth:`unwrap`'s raw connection they are
    not. A statement that finds the connection lost is the
    store's failure, not the tool's: :attr:`lost` keeps it, and the step is not committed whatever
    the tool does with the error.
    """

    def __init__(self, conn: Conn) -> None:
        self._conn = conn
        self.begun = False
        self.lost: BaseException | None = None
        self._cursor: psycopg.ClientCursor[TupleRow] | None = None

    def begin(self) -> Conn:
        if not self.begun:
            self._conn.execute("begin; savepoint june_step", prepare=False)
            self.begun = True
        return self._conn

    def _run(self, sql: str, params: tuple[Any, ...]) -> psycopg.ClientCursor[TupleRow]:
        conn = self.begin()
        if self._cursor is None:
            self._cursor = psycopg.ClientCursor(conn)
        cur = self._cursor
        try:
            cur.execute(_TOOL_STATEMENT.format(_format(sql)), params, prepare=False)
        except psycopg.Error as exc:
            if conn.broken or is_unavailable(exc):
                self.lost = exc
                raise StoreUnavailableError(f"the step's transaction was lost: {type(exc).__name__}: {exc}") from exc
            with contextlib.suppress(psycopg.Error):
                conn.execute("rollback to savepoint june_stmt", prepare=False)
            raise
        cur.nextset()  # past the savepoint's and the setting's results, to the statement's own
        cur.nextset()
        return cur

    def execute(self, sql: str, *params: Any) -> int:
        return self._run(sql, params).rowcount

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        cur = self._run(sql, params)
        return cur.fetchall() if cur.description else []

    def unwrap(self) -> Conn:
        """The psycopg connection, inside the step's transaction: use it, never commit or roll it back.

        Statements run here have no savepoint of their own: a tool that catches a failed one must
        use one itself (``with conn.transaction():`` makes one), or the step fails. They are planned
        as the store's own are, without sequential scans (``set local enable_seqscan = on`` first for
        a statement that needs one).
        """
        return self.begin()


_UNAVAILABLE_SQLSTATES = frozenset(
    {
        "57P01",  # admin_shutdown: pg_terminate_backend, a fast shutdown
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now: the server is starting or in recovery
        "53300",  # too_many_connections
        "40001",  # serialization_failure: the transaction runs again
        "40P01",  # deadlock_detected: the transaction runs again
    }
)


def is_unavailable(exc: BaseException) -> bool:
    """A fault of the connection or the server, not of the statement: the connection lost (psycopg's own
    ``OperationalError`` without a SQLSTATE, ``InterfaceError``, class 08), the server shutting down or not
    taking connections, a serialization failure or deadlock to run again (:data:`_UNAVAILABLE_SQLSTATES`); also a
    statement that met a concurrent schema change mid-way (``cache lookup failed``: it resolved a type or function
    the change then dropped, as ``june migrate --partitions`` does), which runs again on the new schema.

    Anything else the server answers is the statement's own, even in the ``OperationalError`` family: a
    ``statement_timeout`` (57014), a ``NOWAIT`` lock not available (55P03), a program limit (54xxx) would
    fail the same way again, so a tool's statement that meets one is the tool's error, not a lost step."""
    if isinstance(exc, pg_errors.InternalError_) and "cache lookup failed" in str(exc):
        return True
    if isinstance(exc, psycopg.InterfaceError):
        return True
    if not isinstance(exc, psycopg.Error):
        return False
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError)  # raised by the client: the connection failed
    return state.startswith("08") or state in _UNAVAILABLE_SQLSTATES


@contextlib.contextmanager
def pooled(pool: ConnectionPool[Conn]) -> Iterator[Conn]:
    """A connection of ``pool`` in autocommit; a fault of the connection or the server (lost, shut down, no
    connection to be had, a deadlock) becomes :class:`StoreUnavailableError`, the failure policy's transient
    class. Statement errors propagate as psycopg raised them."""
    # getconn/putconn, not pool.connection(): every statement here runs in autocommit or
    # in a transaction its caller ends itself, and the plain pair costs half as much.
    try:
        conn = pool.getconn()
    except psycopg.Error as exc:  # PoolTimeout: no connection could be made or freed in time
        raise StoreUnavailableError(f"no database connection: {type(exc).__name__}: {exc}") from exc
    try:
        if not conn.autocommit:  # a pool handed in by the caller
            conn.autocommit = True
        yield conn
    except psycopg.Error as exc:
        if not (conn.broken or is_unavailable(exc)):
            raise
        raise StoreUnavailableError(f"the database is unavailable: {type(exc).__name__}: {exc}") from exc
    finally:
        pool.putconn(conn)


def _readable(conn: Conn) -> bool:
    """True when an idle connection has something to read: the server closed it (or sent a notice)."""
    try:
        fd = conn.pgconn.socket
        if hasattr(select, "poll"):  # no FD_SETSIZE limit, unlike select()
            poller = select.poll()
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(poller.poll(0))
        ready, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError, psycopg.OperationalError):
        return True
    return bool(ready)


def configure_connection(conn: Conn) -> None:
    """Every statement of the store is prepared on first use; plan each once, generically, along its indexes.

    A custom plan of the commit CTE costs more than executing it. A generic plan is kept for the
    connection's life, planned again only when an ANALYZE of a table it reads invalidates it (at most
    once a minute per database from autovacuum); made while a table held a few rows, it would scan the
    whole table (cheapest then) and go on doing so as the table grows, every turn costing more than the
    last until the next ANALYZE. Every statement of the store finds its rows by an index (the session's
    key, or the sweeper's partial indexes), so sequential scans are off for them. Tool statements run
    through the handle are never prepared and run with the planner's defaults (see :class:`ToolHandle`).
    """
    conn.execute("set plan_cache_mode = force_generic_plan")
    conn.execute("set enable_seqscan = off")


def check_connection(conn: Conn) -> None:
    """The pool's check on every checkout: one ``select()`` syscall; a round trip only if the socket stirred.

    A backend killed while the connection sat idle (``pg_terminate_backend``, a restart) has
    already written its goodbye, so this catches it before a commit is sent on it.
    """
    if conn.closed or _readable(conn):
        ConnectionPool.check_connection(conn)
