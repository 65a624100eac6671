"""Durable enqueue: record a turn in june's Postgres before its message goes to the broker.

A turn recorded here is in the workers' queue even if the broker loses its message: the
sweeper finds it (a queued turn nobody holds, older than a sweep period) and sends it again.
The record is made by ``june_enqueue_turn``, the SQL function the workers' own store uses (a
migration of ``june_worker/stores/postgres.py`` creates it; run ``june migrate`` or start a
worker first), so the producer holds no copy of the statement. Recording is idempotent by turn
id, like a worker's intake: a turn recorded here and then delivered twice runs once.

What is recorded must be readable by the workers: the stored payload is the worker's
``TurnPayload`` (``text``, ``event``, ``trigger_by``, ``replace``, ``target``, ``trace``, ``queue``),
:func:`check_event` refuses an inbound event whose known fields have the wrong type, and
:func:`check_storable` a string no store can hold (a NUL, a lone surrogate) anywhere in the
message, by the workers' own rule (:mod:`june_wire.storable`). A worker would reject such a
message; a record it cannot use would sit in its queue.

The rule a reader must not break: **nothing here imports june_worker** (see ``__init__.py``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

from june_wire.storable import unstorable_reason

from .errors import DatabaseUnavailable, ProducerConfigError, ProducerError

__all__ = ["DurableRecorder", "check_event", "check_storable", "turn_payload"]

_RECORD = "select recorded from june_enqueue_turn(%s, %s, %s, %s::json, true)"
_OPTIONAL_STRINGS = ("kind", "thread", "text")


def check_event(event: Mapping[str, Any] | None) -> None:
    """Refuse an inbound event a worker could not read: ``source`` a string, the known fields of the right type."""
    if event is None:
        return
    if not isinstance(event.get("source"), str):
        raise ValueError('invalid event: expected a "source" string, e.g. {"source": "slack", ...}')
    for name in _OPTIONAL_STRINGS:
        if event.get(name) is not None and not isinstance(event[name], str):
            raise ValueError(f"invalid event: {name!r} must be a string or null")
    user = event.get("user")
    if user is not None and not (
        isinstance(user, Mapping) and isinstance(user.get("id"), str) and isinstance(user.get("attested", False), bool)
    ):
        raise ValueError('invalid event: "user" must be {"id": "<string>", "attested": true|false}')
    principal = event.get("principal")
    if principal is not None and not (isinstance(principal, Mapping) and isinstance(principal.get("id"), str)):
        raise ValueError('invalid event: "principal" must be {"id": "<string>", ...}')


def check_storable(message: Mapping[str, Any]) -> None:
    """Refuse a message holding a string no store can hold (a NUL, a lone surrogate), naming the field."""
    reason = unstorable_reason(dict(message))
    if reason is not None:
        raise ValueError(
            f"invalid turn: {reason}; a durable turn is recorded as it is, and neither Postgres nor the workers "
            "take NUL characters or lone surrogates: remove them or replace them (e.g. with U+FFFD)"
        )


def turn_payload(
    text: str,
    *,
    event: Mapping[str, Any] | None = None,
    trigger_by: str | None = None,
    target: Mapping[str, Any] | None = None,
    trace: Mapping[str, str] | None = None,
    queue: str | None = None,
) -> str:
    """The turn's stored payload as the workers write it (their ``TurnPayload``), as JSON.

    ``queue``: the queue its message is sent on; the workers send the turn there again when they re-send it (the
    sweeper, after a lost message), to the workers that serve its agent. A worker older than it ignores it."""
    payload = {
        "text": text,
        "event": event,
        "trigger_by": trigger_by,
        "replace": False,
        "target": target,
        "trace": dict(trace) if trace else None,
        "queue": queue,
    }
    return json.dumps(payload, separators=(",", ":"), allow_nan=False)


def _cause(exc: BaseException) -> str:
    """An error's class and the first line of its message (Postgres adds context lines, e.g. a statement's text)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


class DurableRecorder:
    """One Postgres connection (opened on first use, thread-safe) that records turns with ``june_enqueue_turn``."""

    def __init__(self, database_url: str, *, timeout_s: float) -> None:
        self.database_url = database_url
        self.timeout_s = timeout_s
        self._conn: Any = None
        self._lock = threading.Lock()

    def record(self, agent: str, session: str, turn_id: str, payload: str) -> bool | None:
        """True: recorded now; False: recorded before (a resend); None: not recorded (the session is parked on
        another turn's input, and no reset is pending that would end the park).

        Raises :class:`DatabaseUnavailable` when Postgres cannot be reached in time, :class:`ProducerConfigError`
        when its user may not record turns (or the schema is missing), :class:`ProducerError` when it refuses the
        record for another reason; nothing is recorded then.
        """
        try:
            import psycopg
        except ImportError:
            raise ProducerConfigError(
                "durable=True records turns in Postgres and needs psycopg: install the producers-durable extra from a "
                "june-worker checkout or its wheel (pip install './june-worker[producers-durable]')"
            ) from None
        with self._lock:
            for attempt in range(2):  # a connection that died while idle gets one fresh try: the call is idempotent
                try:
                    rows = self._connection(psycopg).execute(_RECORD, (agent, session, turn_id, payload)).fetchall()
                except psycopg.errors.UndefinedFunction:
                    raise ProducerConfigError(
                        "the database has no june_enqueue_turn(): migrate it first (june migrate, or start a worker)"
                    ) from None
                except psycopg.OperationalError as exc:
                    self._drop()
                    if attempt == 1:
                        raise DatabaseUnavailable(
                            f"could not record turn {turn_id} of {agent}:{session}: Postgres did not answer "
                            f"({_cause(exc)}); nothing was recorded or sent; is JUNE_DATABASE_URL right?"
                        ) from exc
                    continue
                except psycopg.errors.InsufficientPrivilege as exc:
                    raise ProducerConfigError(
                        f"could not record turn {turn_id} of {agent}:{session}: the database user may not record "
                        f"turns ({_cause(exc)}); grant it EXECUTE on june_enqueue_turn and INSERT/UPDATE on "
                        "june_sessions and june_turns, or use june's own user; nothing was recorded or sent"
                    ) from None
                except psycopg.Error as exc:  # refused for a reason a retry does not change
                    raise ProducerError(
                        f"could not record turn {turn_id} of {agent}:{session}: Postgres refused it "
                        f"({_cause(exc)}); nothing was recorded or sent"
                    ) from None
                if rows:
                    return bool(rows[0][0])
                # no row: parked, or a concurrent record of the same turn id won (then its row is there now)
                if attempt == 1:
                    return None
        return None

    def _connection(self, psycopg: Any) -> Any:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.database_url,
                autocommit=True,
                connect_timeout=max(int(self.timeout_s + 0.999), 1),
                options=f"-c statement_timeout={int(self.timeout_s * 1000)}",
                application_name="june-producer",
            )
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # closing a broken connection: nothing left to save
                pass
        self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()
