"""Shared fixtures: the services integration tests talk to, and unique session names.

Postgres, Redis and RabbitMQ come from :mod:`tests._services`: the URLs in ``JUNE_DATABASE_URL``
/ ``JUNE_REDIS_URL`` / ``JUNE_TEST_AMQP_URL`` when they answer, else throwaway servers from local
binaries, else the run stops with one line saying what to install. Servers start in the
background as soon as collection shows a test needs them, and stop when the run ends. A server that
does not start (twice, see :mod:`tests._services`) fails the tests that need it, with one line; the
run goes on.

Budgets that fit a busy machine (:mod:`tests._budgets`): a test that needs a shared server waits for it
before its pytest-timeout timer starts, and a test that sets up or tears down a fixture wider than
itself (a module's workers, a package's) gets ``SHARED_SETUP_S`` more than its own timeout.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from . import _services
from ._budgets import SHARED_SETUP_S

T = TypeVar("T")

_PG_FIXTURES = {"database_url"}
_REDIS_FIXTURES = {"redis_url"}
_AMQP_FIXTURES = {"amqp_url"}


def _or_exit(get: Callable[[], T]) -> T:
    """``get()``; a server that did not start fails the test (one line), a service nothing can provide ends the run."""
    try:
        return get()
    except _services.ServiceStartFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    except _services.ServiceUnavailable as exc:
        pytest.exit(str(exc), returncode=pytest.ExitCode.USAGE_ERROR)


def _needs(item: pytest.Item) -> set[str]:
    needs = set(getattr(item, "fixturenames", ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("stack") == "amqp":
        needs.add("amqp_url")  # a test parametrized over the brokers (tests/integration/conftest.py)
    return needs


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    needs: set[str] = set()
    for item in session.items:
        needs |= _needs(item)
    if needs & (_PG_FIXTURES | _REDIS_FIXTURES | _AMQP_FIXTURES | {"private_postgres"}):
        _services.start_in_background(
            postgres=bool(needs & _PG_FIXTURES),
            redis=bool(needs & _REDIS_FIXTURES),
            amqp=bool(needs & _AMQP_FIXTURES),
            private_postgres="private_postgres" in needs,
        )


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside pytest-timeout's wrapper: before its timer starts
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    needs = _needs(item)
    _services.wait_for_services(
        postgres=bool(needs & _PG_FIXTURES), redis=bool(needs & _REDIS_FIXTURES), amqp=bool(needs & _AMQP_FIXTURES)
    )
    if _handles_shared_fixtures(item, nextitem):
        _allow_more_time(item, SHARED_SETUP_S)
    return (yield)


def _handles_shared_fixtures(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    """Whether ``item`` sets up a fixture of a scope wider than one test (not cached yet, or cached for another
    parameter), or may tear one down (the last test of the run, or of a module that has fixtures of its own or of
    its package)."""
    info = getattr(item, "_fixtureinfo", None)
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    shared = [defs[-1] for defs in (info.name2fixturedefs.values() if info is not None else ()) if defs]
    shared = [d for d in shared if d.scope != "function"]
    if not shared:
        return False
    if any(d.cached_result is None or d.cached_result[1] != params.get(d.argname) for d in shared):
        return True
    if nextitem is None:
        return True
    return any(d.scope in ("module", "package") for d in shared) and getattr(nextitem, "module", None) is not getattr(
        item, "module", None
    )


def _allow_more_time(item: pytest.Item, extra_s: float) -> None:
    """Raise the item's pytest-timeout budget by ``extra_s`` (a marker that keeps its method and func_only)."""
    try:
        from pytest_timeout import _get_item_settings  # the plugin's own reading of markers, ini and options
    except ImportError:
        return
    settings = _get_item_settings(item)
    if not settings.timeout:
        return  # no timeout at all
    item.add_marker(
        pytest.mark.timeout(settings.timeout + extra_s, method=settings.method, func_only=settings.func_only),
        append=False,
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    _services.shutdown()


_WORKERS_SERVICES: dict[str, list[str]] = {}
"""Under pytest-xdist, in the controller: the services each worker process used, as it reported them at its end."""


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)  # set in an xdist worker process only
    if workeroutput is not None:
        workeroutput["june_services"] = _services.describe()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    worker = (getattr(node, "workerinput", None) or {}).get("workerid", "?")
    _WORKERS_SERVICES[str(worker)] = list((getattr(node, "workeroutput", None) or {}).get("june_services", ()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = _services.describe() + [
        f"[{worker}] {line}" for worker, said in sorted(_WORKERS_SERVICES.items()) for line in said
    ]
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
