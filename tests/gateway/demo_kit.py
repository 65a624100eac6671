"""Workers on the default agents (``JUNE_AGENTS`` unset: the demo agent ``ops``), as the README's examples assume.

A module that takes ``demo_stack`` gets workers of its own on a database of its own (a turn worker, and a
control worker for resumes, as docker-compose runs them); its sessions and streams are nobody else's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.integration.conftest import Stack, _admin_url

__all__ = ["demo_stack"]


@pytest.fixture(scope="module")
def demo_stack(database_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    name = f"june_demo_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'create database "{name}"')
    stack = Stack(_admin_url(database_url, name), redis_url, tmp_path_factory.mktemp("demo-stack"))
    del stack.env["JUNE_AGENTS"]  # the default: the demo agent
    try:
        stack.worker("demo", concurrency=2)
        yield stack
    finally:
        stack.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'drop database if exists "{name}" with (force)')
