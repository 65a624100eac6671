"""Fixtures for the engine tests: every test here runs on fakes (memory / SQLite store, scripted model)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from june_worker.stores import SQLiteStore

from .kit import STORES


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/unit" in str(item.fspath) and item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(params=STORES)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def sqlite_store() -> Iterator[SQLiteStore]:
    store = SQLiteStore(":memory:")
    yield store
    store.close()
