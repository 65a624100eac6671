"""The gateway tests' stack: one database, real Celery workers and one served gateway for the package.

Workers (a turn worker with 4 processes, a control worker with 2) serve the integration test
agents plus ``tests.gateway.agents``; the gateway runs in uvicorn on a free loopback port in a
thread of the test process, so tests can read its counters and its log records.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from june_worker.gateway import GatewaySettings, Principal, TokenTable, create_app
from tests.integration.conftest import Stack, _admin_url

from .kit import Gateway, LogCapture, ServedApp

AGENTS = ("ops", "dribble", "boom", "fragile", "form", "bulk", "pair")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gateway/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="package")
def gateway_db(database_url: str) -> Iterator[str]:
    name = f"june_gw_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'create database "{name}"')
    try:
        yield _admin_url(database_url, name)
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'drop database if exists "{name}" with (force)')


@pytest.fixture(scope="package")
def gw_stack(gateway_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(gateway_db, redis_url, tmp_path_factory.mktemp("gateway-stack"))
    stack.env["JUNE_AGENTS"] = "tests.integration.agents:ALL,tests.gateway.agents:ALL"
    stack.sql("create table it_orders (turn_id text not null, call_id text not null, item text, qty integer)")
    try:
        stack.worker("gw-turns", concurrency=4, queues=stack.queue)
        stack.worker("gw-control", concurrency=2, queues=stack.control_queue)
        yield stack
    finally:
        stack.stop()


def settings_for(stack: Stack, tokens: TokenTable, **overrides: object) -> GatewaySettings:
    values: dict[str, object] = {
        "agents": AGENTS,
        "tokens": tokens,
        "database_url": stack.db_url,
        "redis_url": stack.redis_url,
        "broker_url": stack.redis_url,
        "result_backend": stack.redis_url,
        "queue": stack.queue,
        "control_queue": stack.control_queue,
        "key_prefix": stack.prefix,
        "heartbeat_s": 0.5,
        "max_stream_s": 120.0,
        "wait_s": 60.0,
        "control_timeout_s": 30.0,
        **overrides,
    }
    return GatewaySettings(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="package")
def gateway(gw_stack: Stack) -> Iterator[Gateway]:
    tag = uuid.uuid4().hex
    tokens = {
        "op": f"op-token-{tag}",
        "viewer": f"viewer-token-{tag}",
        "narrow": f"narrow-token-{tag}",
        "admin": f"admin-token-{tag}",
        "tenant": f"tenant-token-{tag}",
    }
    table = TokenTable.of(
        {
            tokens["op"]: Principal("op-alice", frozenset(AGENTS), {"team": "payments"}),
            tokens["viewer"]: Principal("viewer-bob", frozenset({"ops"})),
            tokens["narrow"]: Principal("op-carol", frozenset({"dribble", "form"})),
            tokens["admin"]: Principal("op-dave", None, operator=True),
            tokens["tenant"]: Principal("erin", frozenset({"ops"}), session_prefixes=("erin-",)),
        }
    )
    app = create_app(settings_for(gw_stack, table))
    logs = LogCapture()
    root = logging.getLogger()
    watched = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.access", "uvicorn.error", "june_worker")]
    levels = [lg.level for lg in watched]
    for lg in watched:
        lg.setLevel(logging.INFO)
    root.addHandler(logs)
    served = ServedApp(app)
    gw = Gateway(url=served.url, app=app, stack=gw_stack, tokens=tokens, logs=logs)
    try:
        yield gw
    finally:
        for client in gw.clients:
            client.close()
        served.stop()
        root.removeHandler(logs)
        for lg, level in zip(watched, levels, strict=True):
            lg.setLevel(level)
