"""A gateway whose Postgres restarted: the connections it pooled before died, and no request may get one.

The gateway runs on a Postgres of the test's own (``private_postgres``), restarted in the test; Redis is the
shared one. No workers: the routes used here only read Postgres (who owns a session, whether it exists).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from june_worker.gateway import GatewaySettings, Principal, TokenTable, create_app
from tests._services import PostgresServer

from .kit import ServedApp

TOKEN = f"restart-token-{uuid.uuid4().hex}"


@pytest.fixture
def served(private_postgres: PostgresServer, redis_url: str) -> Iterator[ServedApp]:
    settings = GatewaySettings(
        agents=("ops",),
        tokens=TokenTable.of({TOKEN: Principal("op-restart", None, operator=True)}),
        database_url=private_postgres.url,
        redis_url=redis_url,
        key_prefix=f"june-restart-{uuid.uuid4().hex[:8]}",
    )
    app = ServedApp(create_app(settings))
    try:
        yield app
    finally:
        app.stop()


def test_requests_right_after_a_postgres_restart_are_answered_not_503(
    served: ServedApp, private_postgres: PostgresServer
) -> None:
    # Given a gateway whose pool holds connections that worked (several requests at once make it grow)
    path = "/v1/agents/ops/sessions/never-opened/pending"
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
        with ThreadPoolExecutor(8) as pool:
            before = list(pool.map(lambda _: client.get(path).status_code, range(16)))
        assert before == [404] * 16  # Postgres answered: the session does not exist
        # When Postgres restarts (every pooled connection is closed by the server)
        private_postgres.restart()
        # Then the very next requests are answered as before, none with "the database is unavailable"
        after = [client.get(path) for _ in range(10)]
        assert [r.status_code for r in after] == [404] * 10, [r.text for r in after]
        # and /healthz says both services answer
        health = client.get("/healthz")
    assert health.status_code == 200 and health.json() == {"status": "ok", "redis": "ok", "postgres": "ok"}
