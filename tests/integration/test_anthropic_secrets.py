"""The API key never reaches a stored or published string: Postgres rows, the Redis streams, the log.

The real SDK talks to a local stand-in of the Messages API (:mod:`tests._anthropic_api`) that
answers 401 with a message repeating the key, as a proxy or the API itself may do; the turn runs
through the engine on a real Postgres and a real Redis. A real worker process's log is checked too,
for credentials in the exceptions of failing turns (:mod:`.secret_agents`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from june_worker import Agent, Runtime
from june_worker.engine.events import Failed
from june_worker.engine.secrets import PLACEHOLDER
from june_worker.engine.store import SessionRef
from june_worker.events import EventKeys, RedisStreamSink
from june_worker.models.anthropic import AnthropicModel
from june_worker.stores.postgres import PostgresStore

from .._anthropic_api import AnthropicAPI, api_error
from .conftest import Stack, wait_for
from .secret_agents import MODEL_TOKEN, TOOL_TOKEN

pytestmark = pytest.mark.integration

KEY = "sk-ant-api03-Zq8kVb1yLr0Tn4Xp6Wd2Hc9Jm5Gs3Fa7"
OTHER = "sk-ant-admin01-Pz3Rk8Wn5Tq1Yv7Lm9Hb2Xc4"  # a key shaped like Anthropic's, configured nowhere


@pytest.fixture
def schema_url(database_url: str) -> Iterator[tuple[str, str]]:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'create schema "{schema}"')
    try:
        yield schema, psycopg.conninfo.make_conninfo(database_url, options=f"-c search_path={schema}")
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'drop schema "{schema}" cascade')


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def worker_log(stack: Stack) -> Path:
    """The log of a real worker (prefork) serving :mod:`.secret_agents`, at INFO as in production."""
    return stack.worker("secrets", env={"JUNE_AGENTS": "tests.integration.secret_agents:ALL"}).log


def every_row_as_text(url: str, schema: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "select table_name from information_schema.tables where table_schema = %s", (schema,)
            ).fetchall()
        ]
        assert {"june_turns", "june_events", "june_messages", "june_steps"} <= set(tables)
        return "\n".join(
            str(row[0]) for table in tables for row in conn.execute(f'select t::text from "{table}" t').fetchall()
        )


def every_entry_as_text(client: redis.Redis, keys: EventKeys) -> str:
    out = []
    for key in client.scan_iter(match=f"{keys.prefix}:*"):
        if client.type(key) != b"stream":
            out.append(f"{key!r}={client.dump(key)!r}")
            continue
        for _, fields in client.xrange(key):
            out.extend(f"{k!r}={v!r}" for k, v in fields.items())
    return "\n".join(out)


async def test_a_401_repeating_the_key_leaves_no_trace_of_it_in_postgres_redis_or_the_log(
    schema_url: tuple[str, str], redis_client: redis.Redis, caplog: pytest.LogCaptureFixture, session_id: str
) -> None:
    # Given an API that refuses the key and repeats it (and another key-shaped string) in its message
    schema, url = schema_url
    keys = EventKeys(prefix=f"june-test-{uuid.uuid4().hex[:10]}")
    echo = {"type": "error", "error": {"type": "authentication_error", "message": f"invalid x-api-key {KEY} {OTHER}"}}
    store = PostgresStore(url, max_size=2)
    try:
        with AnthropicAPI() as api:
            api.serve(api_error(401, echo))
            model = AnthropicModel(api_key=KEY, base_url=api.url, max_retries=0)
            runtime = Runtime([Agent(name="ops", model=model)], store, sink=RedisStreamSink(redis_client, keys=keys))
            caplog.set_level(logging.DEBUG)
            # When a turn runs and fails on the 401
            session = runtime.session("ops", session_id)
            result = await session.result(await session.start("hello", turn_id="t1"))
            await model.aclose()
        # Then the turn failed in the model phase, saying why without the key
        assert isinstance(result, Failed) and result.phase == "model"
        assert "authentication_error" in result.error.message
        stored = every_row_as_text(url, schema)
        published = every_entry_as_text(redis_client, keys)
        logged = "\n".join(logging.Formatter().format(r) for r in caplog.records)
        assert "turn.failed" in published and "authentication_error" in stored
        for where, text in (("postgres", stored), ("redis", published), ("log", logged)):
            assert KEY not in text, f"the configured key reached {where}"
            assert OTHER not in text, f"a key-shaped string reached {where}"
        assert store.events(SessionRef("ops", session_id))[-1].type == "turn.failed"
    finally:
        store.close()
        stale = list(redis_client.scan_iter(match=f"{keys.prefix}:*"))
        if stale:
            redis_client.delete(*stale)


@pytest.mark.parametrize("configured", ["api_key", "auth_token"])
async def test_the_configured_credential_itself_is_scrubbed_though_nothing_in_it_looks_like_a_key(
    schema_url: tuple[str, str],
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    session_id: str,
    monkeypatch: pytest.MonkeyPatch,
    configured: str,
) -> None:
    # Given a credential not shaped like an Anthropic key (a gateway's token), passed as api_key or read by the
    # SDK from ANTHROPIC_AUTH_TOKEN, and an API whose long 401 repeats it all along (so every cut of a report
    # falls inside one)
    schema, url = schema_url
    secret = f"gwtoken-{uuid.uuid4().hex}"
    keys = EventKeys(prefix=f"june-test-{uuid.uuid4().hex[:10]}")
    echo = {"type": "error", "error": {"type": "authentication_error", "message": " ".join([secret] * 400)}}
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    if configured == "auth_token":
        monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", secret)
    store = PostgresStore(url, max_size=2)
    try:
        with AnthropicAPI() as api:
            api.serve(api_error(401, echo))
            key = secret if configured == "api_key" else None
            model = AnthropicModel(api_key=key, base_url=api.url, max_retries=0)
            runtime = Runtime([Agent(name="ops", model=model)], store, sink=RedisStreamSink(redis_client, keys=keys))
            caplog.set_level(logging.DEBUG)
            # When a turn runs and fails on the 401
            session = runtime.session("ops", session_id)
            result = await session.result(await session.start("hello", turn_id="t1"))
            await model.aclose()
            sent = api.requests[0].headers
        # Then the credential was the one sent, and no piece of it reached the turn, the events, Redis or the log
        assert any(secret in value for value in sent.values())
        assert isinstance(result, Failed) and result.phase == "model" and PLACEHOLDER in result.error.message
        stored = every_row_as_text(url, schema)
        published = every_entry_as_text(redis_client, keys)
        logged = "\n".join(logging.Formatter().format(r) for r in caplog.records)
        assert "turn.failed" in published and PLACEHOLDER in stored
        for where, text in (("postgres", stored), ("redis", published), ("log", logged)):
            assert secret[:12] not in text and secret[-12:] not in text, f"the credential reached {where}"
    finally:
        store.close()
        stale = list(redis_client.scan_iter(match=f"{keys.prefix}:*"))
        if stale:
            redis_client.delete(*stale)


@pytest.mark.parametrize(("agent", "secret"), [("leaky-tool", TOOL_TOKEN), ("leaky-model", MODEL_TOKEN)])
def test_a_credential_in_a_failing_turns_exception_stays_out_of_the_worker_log(
    stack: Stack, worker_log: Path, agent: str, secret: str
) -> None:
    # Given a worker serving agents whose turn fails on an exception naming a registered credential: a fatal
    # tool error, and an error the Anthropic adapter passes through as it is
    session = f"leak-{uuid.uuid4().hex[:10]}"
    # When a turn runs on a real worker process and fails
    turn_id = stack.turn(agent, session, "hello")
    ended = stack.wait_terminal(agent, session, turn_id)
    assert ended["type"] == "turn.failed"
    # Then the worker logged the failure with its traceback, and neither the log nor what was stored or
    # published holds the credential
    # (the transition line comes after the failure's own record: once it is there, the traceback is written)
    wait_for(lambda: f"turn.failed {turn_id}" in worker_log.read_text(errors="replace"), what="the failure logged")
    logged = worker_log.read_text(errors="replace")
    assert "Traceback (most recent call last)" in logged and PLACEHOLDER in logged
    assert secret not in logged
    stored = "\n".join(str(r) for r in stack.sql("select t::text from june_turns t where session = %s", session))
    stored += "\n".join(str(r) for r in stack.sql("select e::text from june_events e where session = %s", session))
    published = json.dumps(stack.events(agent, session))
    assert PLACEHOLDER in stored and PLACEHOLDER in published
    assert secret not in stored and secret not in published


def test_a_resume_refused_on_an_error_naming_a_credential_does_not_publish_it(stack: Stack, worker_log: Path) -> None:
    # Given a turn parked on an input whose agent's authorize_answer hook fails naming a credential
    session = f"leak-{uuid.uuid4().hex[:10]}"
    turn_id = stack.turn("leaky-approval", session, "hello")
    assert stack.wait_terminal("leaky-approval", session, turn_id)["type"] == "input.requested"
    # When an answer comes, through the worker's june.resume (its reason travels by the result backend)
    payload = {"agent": "leaky-approval", "session": session, "turn_id": turn_id, "input_id": "approve", "value": 1}
    out = stack.send("june.resume", {**payload, "by": "op-1"}).get(timeout=30)
    # Then it is refused with the hook's error, scrubbed, and the worker's log of it holds no credential either
    assert out["status"] == "error"
    assert out["reason"] == f"RuntimeError: operator directory refused credential {PLACEHOLDER}"
    logged = f"refused credential {PLACEHOLDER}"  # the end of the traceback the worker logs, then of its outcome
    wait_for(lambda: logged in worker_log.read_text(errors="replace").split(turn_id, 1)[-1], what="the log")
    assert f"{turn_id} failed before the answer" in worker_log.read_text(errors="replace")
    assert TOOL_TOKEN not in worker_log.read_text(errors="replace")
