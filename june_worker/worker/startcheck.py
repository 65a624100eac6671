"""What a worker checks before it takes a message: its agents load, Postgres answers and is migrated, the broker answers.

Each missing thing is said in one line, with what the worker does about it: a server that does not answer
(yet) is tried again every ``JUNE_START_RETRY_S`` (2 s; 0: exit instead); what waiting cannot fix (a database
that does not exist, a schema newer than this worker) ends the start, exit code 1. A database without june's
schema, or with an older one, is migrated here, and the line says which migrations were applied.

``june worker --turns-per-process N`` runs these checks once, in its supervisor (``python -m
june_worker.worker.startcheck``), before it starts its worker processes: a refusal is said once, not once per
process; the processes it starts skip them (``JUNE_START_CHECKED=1``).

The rule a reader must not break: **a check never takes longer than a few seconds to say what is wrong**
(connect timeouts of :data:`CONNECT_TIMEOUT_S`), and never prints a traceback for a cause it can name.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..errors import ConfigError
from .settings import WorkerSettings

__all__ = ["CONNECT_TIMEOUT_S", "Problem", "applied_versions", "check_broker", "check_postgres", "main", "migrate",
           "postgres_problem", "say_applied", "wait_until_ready"]  # fmt: skip

CONNECT_TIMEOUT_S = 3
"""Seconds one connection attempt (Postgres, the broker) may take before it counts as "does not answer"."""


@dataclass(frozen=True)
class Problem:
    """Something a worker needs and does not have: what to say, and whether waiting could fix it."""

    text: str
    retry: bool


def _where(url: str) -> str:
    try:
        info = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "JUNE_DATABASE_URL"
    return f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}"


def postgres_problem(url: str, exc: BaseException) -> Problem:
    """One line for a failed connection to Postgres at ``url``: the cause, named."""
    text = str(exc)
    where = _where(url)
    missing = re.search(r'database "([^"]+)" does not exist', text)
    if missing:
        return Problem(f'postgres at {where}: database "{missing.group(1)}" does not exist (create it first)', False)
    for needle, cause in (
        ("Connection refused", "connection refused"),
        ("timeout expired", f"no answer within {CONNECT_TIMEOUT_S} s"),
        ("could not translate host name", "unknown host"),
        ("No route to host", "no route to host"),
        ("the database system is starting up", "it is starting up"),
        ("the database system is shutting down", "it is shutting down"),
    ):
        if needle in text:
            return Problem(f"postgres at {where} does not answer ({cause})", True)
    if "password authentication failed" in text or "role" in text and "does not exist" in text:
        line = next((ln for ln in text.splitlines() if "FATAL" in ln), text.splitlines()[0] if text else "")
        return Problem(f"postgres at {where} refuses the connection: {line.split('FATAL:', 1)[-1].strip()}", False)
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return Problem(f"postgres at {where} does not answer ({first})", True)


def _connect(url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True)


def applied_versions(url: str) -> set[int]:
    """The schema versions applied in the database at ``url`` (empty without june's schema)."""
    with _connect(url) as conn:
        exists = conn.execute("select to_regclass('june_schema') is not null").fetchone()
        if not exists or not exists[0]:
            return set()
        return {int(str(v)) for (v,) in conn.execute("select version from june_schema").fetchall()}


def _known() -> int:
    from ..stores._pg_schema import MIGRATIONS

    return len(MIGRATIONS)


def say_applied(applied: list[int]) -> str:
    """``applied migrations 1-15`` (or ``3, 5``); ``schema is up to date`` when there were none."""
    if not applied:
        return "schema is up to date"
    runs: list[str] = []
    start = prev = applied[0]
    for v in [*applied[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return f"applied migration{'s' if len(applied) > 1 else ''} {', '.join(runs)}"


def check_postgres(url: str) -> Problem | None:
    """None when Postgres at ``url`` answers and its schema is not newer than this code's."""
    try:
        versions = applied_versions(url)
    except psycopg.Error as exc:
        return postgres_problem(url, exc)
    newer = [v for v in versions if v > _known()]
    if newer:
        return Problem(f"the schema at JUNE_DATABASE_URL is at version {max(newer)}, newer than this june-worker's "
                       f"({_known()}): upgrade it", False)  # fmt: skip
    return None


def migrate(url: str) -> list[int]:
    """Apply the migrations the database at ``url`` lacks; the versions applied (ascending)."""
    from ..stores.postgres import PostgresStore

    before = applied_versions(url)
    if len(before) >= _known():
        return []
    PostgresStore(url, min_size=1, max_size=1, timeout_s=CONNECT_TIMEOUT_S * 3).close()  # (migrates)
    return sorted(applied_versions(url) - before)


def check_broker(url: str) -> Problem | None:
    """None when the broker at ``url`` answers."""
    from kombu.connection import Connection

    conn: Any = Connection(url, connect_timeout=CONNECT_TIMEOUT_S, transport_options={"max_retries": 0})  # type: ignore[no-untyped-call]
    try:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=CONNECT_TIMEOUT_S)
    except Exception as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        cause = "connection refused" if "refused" in text.lower() or "111" in text else text
        return Problem(f"the broker at {conn.as_uri()} does not answer ({cause})", True)
    finally:
        conn.release()
    return None


def wait_until_ready(
    settings: WorkerSettings, say: Callable[[str], None], *, sleep: Callable[[float], None] = time.sleep
) -> int:
    """Check Postgres and the broker until both answer, migrate the schema if it is behind; 0, or the exit code
    when the start is hopeless (or a server does not answer and ``JUNE_START_RETRY_S`` is 0)."""
    try:
        return _wait(settings, say, sleep)
    except KeyboardInterrupt:
        say("interrupted before it started")
        return 130


def _wait(settings: WorkerSettings, say: Callable[[str], None], sleep: Callable[[float], None]) -> int:
    said: str | None = None
    while True:
        problem = check_postgres(settings.database_url) or check_broker(settings.broker_url)
        if problem is None:
            break
        if not problem.retry:
            say(problem.text)
            return 1
        if settings.start_retry_s <= 0:
            say(f"{problem.text}; not starting (JUNE_START_RETRY_S=0)")
            return 1
        if problem.text != said:  # once per cause, not once per try
            say(f"{problem.text}; retrying every {settings.start_retry_s:g} s")
            said = problem.text
        sleep(settings.start_retry_s)
    if said is not None:
        say("postgres and the broker answer; starting")
    try:
        applied = migrate(settings.database_url)
    except psycopg.Error as exc:
        say(postgres_problem(settings.database_url, exc).text)
        return 1
    if applied:
        say(say_applied(applied))
    return 0


def main() -> int:
    """``python -m june_worker.worker.startcheck``: the checks of a worker's start, for june's supervisor."""

    from .logformat import say as write

    json_mode = False

    def say(line: str) -> None:
        write(f"june worker: {line}", json_mode=json_mode)

    try:
        settings = WorkerSettings.from_env()
        json_mode = settings.log_format == "json"
        from .host import load_agents

        load_agents(settings.agents)
    except ConfigError as exc:
        say(str(exc))
        return 2
    return wait_until_ready(settings, say)


if __name__ == "__main__":
    raise SystemExit(main())
