"""Authentication: token configuration, constant-time lookup, insecure development mode, and tokens in no log or event."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from june_worker.errors import ConfigError
from june_worker.gateway import GatewaySettings, TokenTable, create_app
from june_worker.gateway.auth import Principal, load_tokens

from .conftest import settings_for
from .kit import Gateway, LogCapture, ServedApp

PLAIN = "a-plain-token-0123456789"
HASHED = "a-hashed-token-9876543210"


def digest(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def test_tokens_from_json_plain_or_hashed_map_to_principals_and_agents() -> None:
    table = load_tokens(
        json.dumps(
            {
                PLAIN: {"principal": "op-alice", "agents": ["ops"], "claims": {"team": "payments"}},
                digest(HASHED): {"principal": "ci-bot", "agents": "*"},
            }
        ),  # fmt: skip
        None,
    )
    alice, bot = table.lookup(PLAIN), table.lookup(HASHED)
    assert alice == Principal("op-alice", frozenset({"ops"})) and alice.to_json() == {
        "team": "payments",
        "id": "op-alice",
    }
    assert bot is not None and bot.id == "ci-bot" and bot.sees("anything")
    assert alice.sees("ops") and not alice.sees("dribble")
    assert table.lookup("a-plain-token-012345678") is None and table.lookup(digest(HASHED)) is None


def test_a_token_may_make_its_principal_an_operator_or_confine_it_to_session_prefixes() -> None:
    table = load_tokens(
        json.dumps(
            {
                PLAIN: {"principal": "ops-lead", "agents": "*", "role": "operator"},
                HASHED: {"principal": "acme", "agents": ["ops"], "role": "user", "sessions": ["acme-", "shared-acme"]},
            }
        ),
        None,
    )
    lead, acme = table.lookup(PLAIN), table.lookup(HASHED)
    assert lead is not None and lead.operator and lead.may_address("anything")
    assert acme is not None and not acme.operator and acme.session_prefixes == ("acme-", "shared-acme")
    assert acme.may_address("acme-1") and acme.may_address("shared-acme") and not acme.may_address("s1")


def test_the_authorize_session_hook_and_body_limit_come_from_the_environment() -> None:
    env = {"JUNE_GATEWAY_AGENTS": "ops", "JUNE_GATEWAY_INSECURE_DEV": "1"}
    s = GatewaySettings.from_env(
        {**env, "JUNE_GATEWAY_AUTHORIZE_SESSION": "tests.gateway.agents:ALL", "JUNE_GATEWAY_MAX_BODY_BYTES": "4096"}
    )
    assert s.authorize_session is not None and s.authorize_session.__name__ == "ALL" and s.max_body_bytes == 4096
    with pytest.raises(ConfigError, match="JUNE_GATEWAY_AUTHORIZE_SESSION: cannot load 'tests.gateway.agents:nope'"):
        GatewaySettings.from_env({**env, "JUNE_GATEWAY_AUTHORIZE_SESSION": "tests.gateway.agents:nope"})
    with pytest.raises(ConfigError, match="must look like 'package.module:function'"):
        GatewaySettings.from_env({**env, "JUNE_GATEWAY_AUTHORIZE_SESSION": "nocolon"})
    with pytest.raises(ConfigError, match="JUNE_GATEWAY_MAX_BODY_BYTES must be at least 1024"):
        GatewaySettings.from_env({**env, "JUNE_GATEWAY_MAX_BODY_BYTES": "10"})


def test_tokens_from_a_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tokens."{digest(HASHED)}"]\nprincipal = "op-bob"\nagents = ["ops", "form"]\n')
    table = load_tokens(None, str(path))
    assert table.lookup(HASHED) == Principal("op-bob", frozenset({"ops", "form"}))


def test_env_and_file_tokens_merge(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": {digest(HASHED): {"principal": "b", "agents": "*"}}}))
    table = load_tokens(json.dumps({PLAIN: {"principal": "a", "agents": "*"}}), str(path))
    assert len(table) == 2 and "a-plain" not in repr(table)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"short-token": {"principal": "p", "agents": "*"}}, "at least 16"),
        ({"sha256:abc" + "0" * 20: {"principal": "p", "agents": "*"}}, "sha256:<64 hex>"),
        ({PLAIN: {"principal": "", "agents": "*"}}, "'principal' must be"),
        ({PLAIN: {"principal": "p", "agents": ["bad name"]}}, "'agents' must be"),
        ({PLAIN: {"principal": "p", "agents": "*", "by": "x"}}, "unknown fields"),
        ({PLAIN: {"principal": "p", "agents": "*", "claims": {"id": "x"}}}, "without an 'id'"),
        ([PLAIN], "expected an object"),
        ({PLAIN: {"principal": "p", "agents": "*", "role": "admin"}}, "'role' must be"),
        ({PLAIN: {"principal": "p", "agents": "*", "sessions": []}}, "'sessions' must be"),
        ({PLAIN: {"principal": "p", "agents": "*", "sessions": ["a b"]}}, "'sessions' must be"),
    ],
)
def test_a_bad_token_configuration_is_a_config_error_that_never_shows_the_token(config: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        load_tokens(json.dumps(config), None)
    assert PLAIN not in str(caught.value) and "short-token" not in str(caught.value)


def test_invalid_json_and_duplicates_are_config_errors_without_the_token(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid JSON") as caught:
        load_tokens('{"' + PLAIN + '": ', None)
    assert PLAIN not in str(caught.value)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({digest(PLAIN): {"principal": "b", "agents": "*"}}))
    with pytest.raises(ConfigError, match="configured twice") as caught:
        load_tokens(json.dumps({PLAIN: {"principal": "a", "agents": "*"}}), str(path))
    assert PLAIN not in str(caught.value)


def test_lookup_compares_every_token_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = {f"token-number-{i:04d}-padding": Principal(f"p{i}") for i in range(5)}
    table = TokenTable.of(tokens)
    calls: list[int] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return compare(a, b)

    monkeypatch.setattr("june_worker.gateway.auth.hmac.compare_digest", counting)
    for token, principal in tokens.items():
        calls.clear()
        assert table.lookup(token) == principal
        assert len(calls) == 5  # the first token costs what the last one does
    calls.clear()
    assert table.lookup("no-such-token-at-all-here") is None and len(calls) == 5


def test_settings_refuse_to_start_without_tokens_unless_insecure_dev() -> None:
    env = {"JUNE_GATEWAY_AGENTS": "ops"}
    with pytest.raises(ConfigError, match="no bearer tokens.*JUNE_GATEWAY_INSECURE_DEV=1"):
        GatewaySettings.from_env(env)
    dev = GatewaySettings.from_env({**env, "JUNE_GATEWAY_INSECURE_DEV": "1"})
    assert dev.insecure_dev and dev.dev_principal == "dev" and len(dev.tokens) == 0


def test_settings_read_the_worker_variables_and_load_agent_names() -> None:
    env = {
        "JUNE_AGENTS": "tests.gateway.agents:ALL",
        "JUNE_GATEWAY_TOKENS": json.dumps({PLAIN: {"principal": "a", "agents": "*"}}),
        "JUNE_REDIS_URL": "redis://:s3cret@cache:6379/2",
        "JUNE_QUEUE": "q1",
        "JUNE_CONTROL_QUEUE": "q1.control",
        "JUNE_KEY_PREFIX": "pfx",
        "JUNE_GATEWAY_PORT": "9001",
        "JUNE_GATEWAY_HEARTBEAT_S": "2.5",
    }
    s = GatewaySettings.from_env(env)
    assert s.agents == ("boom", "fragile", "form", "bulk", "pair")
    assert (s.queue, s.control_queue, s.key_prefix, s.port, s.heartbeat_s) == ("q1", "q1.control", "pfx", 9001, 2.5)
    assert s.broker_url == s.result_backend == "redis://:s3cret@cache:6379/2"
    assert PLAIN not in repr(s) and "s3cret" not in repr(s)
    with pytest.raises(ConfigError, match="JUNE_QUEUE is set but empty"):
        GatewaySettings.from_env({**env, "JUNE_QUEUE": " "})
    with pytest.raises(ConfigError, match="JUNE_GATEWAY_HEARTBEAT_S"):
        GatewaySettings.from_env({**env, "JUNE_GATEWAY_HEARTBEAT_S": "soon"})
    assert GatewaySettings.from_env({**env, "JUNE_GATEWAY_AGENTS": "ops, form"}).agents == ("ops", "form")


def test_insecure_dev_mode_lets_requests_without_a_token_in_and_says_so_loudly(gateway: Gateway) -> None:
    logs = LogCapture()
    logging.getLogger().addHandler(logs)
    try:
        served = ServedApp(create_app(settings_for(gateway.stack, TokenTable(), insecure_dev=True)))
    finally:
        logging.getLogger().removeHandler(logs)
    try:
        assert httpx.get(f"{served.url}/v1/agents").json()["principal"] == "dev"
        unknown = httpx.get(f"{served.url}/v1/agents", headers={"Authorization": "Bearer not-a-configured-token-x"})
        assert unknown.status_code == 401
    finally:
        served.stop()
    warnings = [line for line in logs.lines if line.startswith("WARNING") and "INSECURE_DEV" in line]
    assert warnings and "requests WITHOUT a token" in warnings[0]


def test_tokens_never_appear_in_logs_events_or_the_database(gateway: Gateway) -> None:
    session = f"s-{uuid.uuid4().hex[:12]}"
    wrong = f"wrong-token-{uuid.uuid4().hex}"
    client = gateway.client()
    httpx.get(f"{gateway.url}/v1/agents", headers={"Authorization": f"Bearer {wrong}"})
    parked = client.post(gateway.path("ops", session, "/turns"), json={"text": "refund"}, params={"wait": 1}).json()
    gateway.client("viewer").post(gateway.path("ops", session, f"/turns/{parked['turn_id']}/resume"),
                                  json={"input_id": "approve-refund", "value": True})  # fmt: skip
    client.post(gateway.path("ops", session, f"/turns/{parked['turn_id']}/resume"),
                json={"input_id": "approve-refund", "value": True}, params={"wait": 1})  # fmt: skip
    secrets = [*gateway.tokens.values(), wrong]
    logs = gateway.logs.text() + "\n".join(p.log.read_text(errors="replace") for p in gateway.stack.procs)
    assert "POST /v1/agents/ops/sessions" in logs  # the access log is on, and says nothing secret
    events = json.dumps(gateway.stack.events("ops", session))
    rows = json.dumps(gateway.stack.sql("select payload::text, result::text from june_turns where session = %s", session)
                      + gateway.stack.sql("select body::text from june_events where session = %s", session))  # fmt: skip
    for secret in secrets:
        assert secret not in logs and secret not in events and secret not in rows
