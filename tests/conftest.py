"""Shared fixtures: the services integration tests talk to, and unique session names."""

from __future__ import annotations

import uuid

import pytest

from . import _services


@pytest.fixture(scope="session")
def database_url() -> str:
    """A Postgres URL that answers (the run fails, never skips, when there is none)."""
    return _services.postgres_url()


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A Redis URL that answers (the run fails, never skips, when there is none)."""
    return _services.redis_url()


@pytest.fixture
def session_id() -> str:
    """A session id no other test uses, so tests can share one database and one Redis."""
    return f"s-{uuid.uuid4().hex[:12]}"
