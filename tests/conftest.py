"""Shared fixtures: the services integration tests talk to, and unique session names.

Postgres, Redis and RabbitMQ come from :mod:`tests._services`: the URLs in ``JUNE_DATABASE_URL``
/ ``JUNE_REDIS_URL`` / ``JUNE_TEST_AMQP_URL`` when they answer, else throwaway servers from local
binaries, else the run stops with one line saying what to install. Servers start in the
background as soon as collection shows a test needs them, and stop when the run ends.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from . import _services

T = TypeVar("T")

_PG_FIXTURES = {"database_url"}
_REDIS_FIXTURES = {"redis_url"}
_AMQP_FIXTURES = {"amqp_url"}


def _or_exit(get: Callable[[], T]) -> T:
    try:
        return get()
    except _services.ServiceUnavailable as exc:
        pytest.exit(str(exc), returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    needs: set[str] = set()
    for item in session.items:
        needs.update(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("stack") == "amqp":
            needs.add("amqp_url")  # a test parametrized over the brokers (tests/integration/conftest.py)
    if needs & (_PG_FIXTURES | _REDIS_FIXTURES | _AMQP_FIXTURES | {"private_postgres"}):
        _services.start_in_background(
            postgres=bool(needs & _PG_FIXTURES),
            redis=bool(needs & _REDIS_FIXTURES),
            amqp=bool(needs & _AMQP_FIXTURES),
            private_postgres="private_postgres" in needs,
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    _services.shutdown()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = _services.describe()
    if lines:
        terminalreporter.write_sep("-", "services")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def database_url() -> str:
    """A Postgres URL that answers (the run fails, never skips, when there is none)."""
    return _or_exit(_services.postgres_url)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A Redis URL that answers (the run fails, never skips, when there is none)."""
    return _or_exit(_services.redis_url)


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """A RabbitMQ URL that answers (the run fails, never skips, when there is none)."""
    return _or_exit(_services.amqp_url)


@pytest.fixture
def private_postgres() -> Iterator[_services.PostgresServer]:
    """A Postgres of this test's own (kill it, restart it); never the shared one."""
    with contextlib.ExitStack() as stack:
        yield _or_exit(lambda: stack.enter_context(_services.private_postgres()))


@pytest.fixture
def private_redis() -> Iterator[_services.RedisServer]:
    """A Redis of this test's own (kill it, restart it); never the shared one."""
    with contextlib.ExitStack() as stack:
        yield _or_exit(lambda: stack.enter_context(_services.private_redis()))


@pytest.fixture
def session_id() -> str:
    """A session id no other test uses, so tests can share one database and one Redis."""
    return f"s-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """A three-node Redis Cluster of this run's own (``redis+cluster://...``), started on first use; never the
    machine's Redis. Tests share it: each writes under keys of its own."""
    with contextlib.ExitStack() as stack:
        yield _or_exit(lambda: stack.enter_context(_services.private_redis_cluster())).url
