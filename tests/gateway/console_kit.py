"""A gateway and workers over a database of the test module's own, for the operator console's tests.

The console lists every session of the database, so its tests get a database nobody else
writes: what they count and page through is theirs. Tokens: ``admin`` (op-dave, an operator
whom the ``ops`` agent's ``authorize_answer`` lets approve: ``op-`` ids), ``mallory`` (an
operator it does not), ``viewer`` (a user, not an operator).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from june_worker.gateway import Principal, TokenTable, create_app
from tests.integration.conftest import Stack, _database

from .conftest import AGENTS, settings_for
from .kit import Gateway, LogCapture, ServedApp

__all__ = ["console_gateway", "console_stack"]


@pytest.fixture(scope="module")
def console_stack(database_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    databases = _database(database_url)
    db = next(databases)
    stack = Stack(db, redis_url, tmp_path_factory.mktemp("console-stack"))
    stack.env["JUNE_AGENTS"] = "tests.integration.agents:ALL,tests.gateway.agents:ALL"
    stack.sql("create table it_orders (turn_id text not null, call_id text not null, item text, qty integer)")
    try:
        stack.worker("console", concurrency=3)
        yield stack
    finally:
        stack.close()
        databases.close()


@pytest.fixture(scope="module")
def console_gateway(console_stack: Stack) -> Iterator[Gateway]:
    tag = uuid.uuid4().hex
    tokens = {"admin": f"admin-token-{tag}", "mallory": f"mallory-token-{tag}", "viewer": f"viewer-token-{tag}"}
    table = TokenTable.of(
        {
            tokens["admin"]: Principal("op-dave", None, operator=True),
            tokens["mallory"]: Principal("mallory", frozenset(AGENTS), operator=True),
            tokens["viewer"]: Principal("viewer-bob", frozenset({"ops"})),
        }
    )
    app = create_app(settings_for(console_stack, table, heartbeat_s=0.3))
    served = ServedApp(app)
    gw = Gateway(url=served.url, app=app, stack=console_stack, tokens=tokens, logs=LogCapture())
    try:
        yield gw
    finally:
        for client in gw.clients:
            client.close()
        served.stop()
