"""The Slack end-to-end tests' stack and helpers: requests as Slack sends them, and reading the fake's calls.

:func:`slack_stack` serves the gateway in the test process (its Slack routes on, the test resolver
:func:`~tests.integration.slack_agents.resolve`) with real Celery workers whose ``slack_sdk`` talks
to a :class:`~tests._fake_slack.FakeSlack`; the workers live for the module that uses it.
"""

from __future__ import annotations

import json
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from june_worker.gateway import GatewaySettings, Principal, TokenTable, create_app
from june_worker.gateway.slack_settings import SlackGatewaySettings
from june_worker.stores.postgres import PostgresStore
from tests._fake_slack import FakeSlack, signed
from tests.gateway.kit import ServedApp

from .conftest import Proc, Stack
from .slack_agents import resolve

SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
TOKEN = "xoxb-e2e-bot-token-never-logged"


@dataclass
class Slack:
    stack: Stack
    fake: FakeSlack
    url: str
    turn_worker: Proc
    settings: GatewaySettings

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=10)

    # --- requests as Slack sends them --------------------------------------------------------------

    def event(self, payload: dict[str, Any], *, secret: str = SECRET, timestamp: int | None = None,
              retry: int | None = None) -> httpx.Response:  # fmt: skip
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", **signed(secret, body, timestamp=timestamp)}
        if retry is not None:
            headers |= {"X-Slack-Retry-Num": str(retry), "X-Slack-Retry-Reason": "http_timeout"}
        return self.http.post("/slack/events", content=body, headers=headers)

    def click(self, payload: dict[str, Any], *, secret: str = SECRET) -> httpx.Response:
        body = urllib.parse.urlencode({"payload": json.dumps(payload)}).encode()
        headers = {"Content-Type": "application/x-www-form-urlencoded", **signed(secret, body)}
        return self.http.post("/slack/interactivity", content=body, headers=headers)

    # --- reading ---------------------------------------------------------------------------------------

    def in_thread(self, channel: str, thread: str) -> list[tuple[str, dict[str, Any]]]:
        """The calls about one thread: posts into it, and calls on the messages posted there."""
        with self.fake.lock:
            ours = {m.ts for m in self.fake.messages.values() if m.channel == channel and m.thread_ts == thread}
            return [
                (c.method, c.body) for c in self.fake.calls
                if c.body.get("thread_ts") == thread or c.body.get("ts") in ours
            ]  # fmt: skip

    def delivered(self, session: str, turn_id: str) -> bool:
        rows = self.stack.sql(
            "select status, deliver_due from june_turns where agent = 'desk' and session = %s and turn_id = %s",
            session, turn_id,
        )  # fmt: skip
        return bool(rows) and rows[0][0] not in ("queued", "running") and rows[0][1] is False


def message(channel: str, ts: str, text: str, *, user: str = "U1", thread_ts: str | None = None) -> dict[str, Any]:
    event = {"type": "message", "channel": channel, "user": user, "text": text, "ts": ts, "channel_type": "channel"}
    if thread_ts:
        event["thread_ts"] = thread_ts
    return {"type": "event_callback", "team_id": "T1", "event_id": f"Ev{uuid.uuid4().hex[:8]}", "event": event}


def click_on(prompt: dict[str, Any], channel: str, thread: str, ts: str, user: str, answer: str) -> dict[str, Any]:
    button = next(e for e in prompt["blocks"][1]["elements"] if e["action_id"] == f"june_input:{answer}")
    return {
        "type": "block_actions",
        "team": {"id": "T1"},
        "user": {"id": user},
        "container": {"type": "message", "channel_id": channel, "message_ts": ts, "thread_ts": thread},
        "response_url": "https://hooks.slack.invalid/actions/T1/1/x",
        "actions": [{"action_id": button["action_id"], "value": button["value"], "block_id": "b"}],
    }


def channel_id() -> str:
    return f"C{uuid.uuid4().hex[:8].upper()}"


def turn_id(channel: str, ts: str) -> str:
    return f"slack:T1:{channel}:{ts}"


def slack_stack(fresh_db: str, redis_url: str, tmp: Path) -> Iterator[Slack]:
    """A module's Slack stack: the fake Web API, a control and a turn worker, beat, and the gateway served in this
    process (its resolver is :func:`~tests.integration.slack_agents.resolve`). For a module's fixture to yield from."""
    fake = FakeSlack()
    stack = Stack(fresh_db, redis_url, tmp)
    stack.env.update(
        {
            "JUNE_AGENTS": "tests.integration.slack_agents:ALL",
            "SLACK_BOT_TOKEN": TOKEN,
            "JUNE_SLACK_API_URL": fake.url,
            "JUNE_SLACK_STATUS": "is thinking…",
            "JUNE_SLACK_INTERVAL_S": "0.1",
            "JUNE_DELIVERY_ATTEMPTS": "50",
            "JUNE_IT_SLACK_GATES": str(stack.tmp / "gates"),
        }
    )
    (stack.tmp / "gates").mkdir()
    settings = GatewaySettings(
        agents=("desk",),
        tokens=TokenTable.of({f"t-{uuid.uuid4().hex}": Principal("ops", frozenset({"desk"}))}),
        database_url=stack.db_url, redis_url=stack.redis_url, broker_url=stack.redis_url,
        result_backend=stack.redis_url, queue=stack.queue, control_queue=stack.control_queue,
        key_prefix=stack.prefix,
        slack=SlackGatewaySettings(signing_secret=SECRET, agent="desk", replace_in_flight=True,
                                   resolve_identity=resolve),
    )  # fmt: skip
    PostgresStore(stack.db_url).close()  # the schema, before any test reads it
    served = None
    try:
        stack.worker("slack-control", queues=stack.control_queue)
        turns = stack.worker("slack-turns", concurrency=2, queues=stack.queue)
        stack.beat()
        served = ServedApp(create_app(settings), access_log=False)
        s = Slack(stack=stack, fake=fake, url=served.url, turn_worker=turns, settings=settings)
        yield s
        s.http.close()
    finally:
        if served is not None:
            served.stop()
        stack.close()
        fake.close()
