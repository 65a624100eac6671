"""Fixtures for the engine tests: every test here runs on fakes (memory / SQLite store, scripted model)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anthropic
import pytest

from june_worker.models.anthropic import AnthropicModel
from june_worker.stores import SQLiteStore

from .._anthropic_api import KEY, AnthropicAPI
from .kit import STORES


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/unit" in str(item.fspath) and item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(params=STORES)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["sqlite"])
def sql_kind(request: pytest.FixtureRequest) -> str:
    """Stores with a transaction a sync tool writes in (Postgres runs these in tests/integration)."""
    return str(request.param)


@pytest.fixture
def sqlite_store() -> Iterator[SQLiteStore]:
    store = SQLiteStore(":memory:")
    yield store
    store.close()


_LOOPBACK = ("127.", "::1", "localhost")


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests run on fakes: any connection beyond loopback (a real model call) fails the test."""
    import socket

    real_connect = socket.socket.connect

    def guarded(sock: socket.socket, address: object) -> object:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = str(address[0]) if isinstance(address, tuple) else str(address)
            if not host.startswith(_LOOPBACK):
                raise PermissionError(f"unit test tried to reach {host}: no network calls in the unit tier")
        return real_connect(sock, address)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "connect", guarded)


@pytest.fixture
def api() -> Iterator[AnthropicAPI]:
    """A local stand-in of the Messages API on 127.0.0.1 (recorded responses, recorded requests)."""
    with AnthropicAPI() as server:
        yield server


@pytest.fixture
async def make_model(api: AnthropicAPI) -> AsyncIterator[Callable[..., Any]]:
    """Builds an ``AnthropicModel`` on a real SDK client pointed at :func:`api` (the SDK is in ``[dev]``)."""

    clients: list[Any] = []

    def make(**kwargs: Any) -> AnthropicModel:
        client = anthropic.AsyncAnthropic(api_key=KEY, base_url=api.url)
        clients.append(client)
        kwargs.setdefault("retry_delay_s", 0.0)
        return AnthropicModel("claude-sonnet-4-6", client=client, **kwargs)

    yield make
    for client in clients:
        await client.close()
