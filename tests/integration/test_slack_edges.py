"""Slack at its edges, end to end: requests nobody signed, the status line when replies are posted once, a prompt
whose buttons Slack refuses, the gateway's Slack configuration at start, and what the identity resolver is told.

The same stack as ``test_slack_e2e`` (:mod:`.slack_kit`): a gateway served in this process, real Celery workers
whose ``slack_sdk`` talks to a fake Slack Web API, requests signed as Slack signs them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import socket
import subprocess
import sys
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from june_worker.gateway import Principal, TokenTable, create_app
from tests._fake_slack import signed
from tests.gateway.kit import LogCapture, ServedApp

from .conftest import ROOT, Proc, wait_for
from .slack_kit import SECRET, Slack, channel_id, click_on, message, slack_stack, turn_id

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def slack(fresh_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slack]:
    yield from slack_stack(fresh_db, redis_url, tmp_path_factory.mktemp("slack-edges"))


@pytest.fixture
def gateway_log() -> Iterator[LogCapture]:
    """Every record the in-process gateway (and its uvicorn) logs during the test, tracebacks included."""
    logs = LogCapture()
    root = logging.getLogger()
    root.addHandler(logs)
    try:
        yield logs
    finally:
        root.removeHandler(logs)


def _hmac(secret: str, timestamp: str, body: bytes) -> str:
    return "v0=" + hmac.new(secret.encode(), f"v0:{timestamp}:".encode() + body, hashlib.sha256).hexdigest()


def _event_body(c: str) -> bytes:
    return json.dumps(message(c, "10.1", "hello")).encode()


def _click_body(c: str) -> bytes:
    value = json.dumps({"turn_id": turn_id(c, "10.1"), "input_id": "approve-refund", "input": True})
    click = {"type": "block_actions", "team": {"id": "T1"}, "user": {"id": "U1"},
             "container": {"type": "message", "channel_id": c, "message_ts": "10.2", "thread_ts": "10.1"},
             "actions": [{"action_id": "june_input:yes", "value": value}]}  # fmt: skip
    return urllib.parse.urlencode({"payload": json.dumps(click)}).encode()


# Each makes (body, headers) from a request that would start a turn (or answer one) if it were believed.
UNSIGNED: dict[str, Callable[[bytes], tuple[bytes, dict[str, str]]]] = {
    "no signature headers": lambda body: (body, {}),
    "a signature without a timestamp": lambda body: (
        body,
        {"X-Slack-Signature": signed(SECRET, body)["X-Slack-Signature"]},
    ),  # noqa: E501
    "a timestamp that is not a number": lambda body: (
        body,
        {"X-Slack-Request-Timestamp": "soon", "X-Slack-Signature": _hmac(SECRET, "soon", body)},
    ),
    "a body that is not UTF-8 under a forged signature": lambda body: (
        body.replace(b"hello", b"h\xe9llo").replace(b"U1", b"U\xff1"),
        signed("not-the-secret", body.replace(b"hello", b"h\xe9llo").replace(b"U1", b"U\xff1")),
    ),
}


def _nothing_done(slack: Slack, c: str) -> None:
    assert slack.stack.sql("select 1 from june_turns where session like %s", f"slack:{c}:%") == []
    if slack.stack.sql("select to_regclass('june_gateway_sessions') is not null") == [(True,)]:  # made on first use
        assert slack.stack.sql("select 1 from june_gateway_sessions where session like %s", f"slack:{c}:%") == []
    assert not [call for call in slack.fake.calls if c in json.dumps(call.body)], "no Slack call about the channel"


# --- 1. what nobody signed -----------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["/slack/events", "/slack/interactivity"])
@pytest.mark.parametrize("how", list(UNSIGNED))
def test_a_request_without_a_well_formed_valid_signature_is_a_401_that_does_nothing_and_logs_no_traceback(
    slack: Slack, gateway_log: LogCapture, route: str, how: str
) -> None:
    # Given a request that would start (or answer) a turn, but that Slack did not sign as it signs
    c = channel_id()
    body, headers = UNSIGNED[how](_event_body(c) if route == "/slack/events" else _click_body(c))
    content_type = "application/json" if route == "/slack/events" else "application/x-www-form-urlencoded"
    # When it reaches the gateway
    answer = slack.http.post(route, content=body, headers={"Content-Type": content_type, **headers})
    # Then it is refused as unsigned, nothing is done, and the log says why in one line, with no traceback
    assert answer.status_code == 401, answer.text
    assert answer.json() == {"detail": "invalid or expired Slack request signature"}
    _nothing_done(slack, c)
    logged = gateway_log.text()
    assert "Traceback" not in logged
    assert f"refused {route} from 127.0.0.1:" in logged


@pytest.mark.parametrize("route", ["/slack/events", "/slack/interactivity"])
def test_a_signed_body_that_is_not_utf8_is_a_400_naming_it(slack: Slack, gateway_log: LogCapture, route: str) -> None:
    # Given a body Slack's signing secret signed, over bytes that are not UTF-8
    c = channel_id()
    body = (_event_body(c) if route == "/slack/events" else _click_body(c)).replace(b"U1", b"U\xff1")
    # When it reaches the gateway
    answer = slack.http.post(route, content=body, headers=signed(SECRET, body))
    # Then it is a bad payload that says what is wrong, and nothing is done
    assert answer.status_code == 400
    assert "not a Slack payload: the body is not UTF-8" in answer.json()["detail"]
    _nothing_done(slack, c)
    assert "Traceback" not in gateway_log.text()


# --- 2. the status line when replies are posted once ------------------------------------------------------------


def test_in_post_once_mode_the_status_line_is_set_while_the_turn_runs_and_cleared_after_its_reply(slack: Slack) -> None:
    # Given workers that post each reply once, at the turn's end (JUNE_SLACK_LIVE=0), with a status line
    c = channel_id()
    session, tid = f"slack:{c}:20.1", turn_id(c, "20.1")
    slack.turn_worker.stop()
    slack.turn_worker = slack.stack.worker(f"post-once-{c}", concurrency=2, queues=slack.stack.queue,
                                           env={"JUNE_SLACK_LIVE": "0"})  # fmt: skip
    hold = slack.stack.tmp / "gates" / f"hold-{tid}"
    hold.touch()
    try:
        # When a message's turn is running (held before its model call)
        slack.event(message(c, "20.1", "take your time"))
        on = wait_for(lambda: [b for m, b in slack.in_thread(c, "20.1") if m == "assistant.threads.setStatus"],
                      timeout_s=30, what="the status line while the turn runs")  # fmt: skip
        # Then the thread shows the status line, and nothing else yet
        assert [b["status"] for b in on] == ["is thinking…"]
        assert [m for m, _ in slack.in_thread(c, "20.1")] == ["assistant.threads.setStatus"]
        hold.unlink()
        # and once the turn ended: its reply, posted once, then the status line cleared
        wait_for(lambda: slack.delivered(session, tid), timeout_s=30, what="the turn to be delivered")
        calls = slack.in_thread(c, "20.1")
        assert [(m, b.get("status", b.get("text"))) for m, b in calls] == [
            ("assistant.threads.setStatus", "is thinking…"), ("chat.postMessage", "did: take your time"),
            ("assistant.threads.setStatus", ""),
        ]  # fmt: skip
    finally:
        hold.unlink(missing_ok=True)
        slack.turn_worker.stop()
        slack.turn_worker = slack.stack.worker(f"turns-{c}", concurrency=2, queues=slack.stack.queue)


# --- 3. a prompt Slack refuses -----------------------------------------------------------------------------------


def _park_with_refused_buttons(slack: Slack, c: str) -> tuple[str, str]:
    """A refund turn parked on its approval while Slack refuses every message with blocks (invalid_blocks)."""
    session, tid = f"slack:{c}:30.1", turn_id(c, "30.1")
    slack.fake.refuse_blocks = "invalid_blocks"
    try:
        assert slack.event(message(c, "30.1", "refund order 7")).status_code == 200
        wait_for(lambda: slack.delivered(session, tid), timeout_s=30, what="the park to be delivered")
    finally:
        slack.fake.refuse_blocks = None
    return session, tid


def test_a_prompt_whose_buttons_slack_refuses_is_said_in_plain_text_and_logged_and_the_status_line_cleared(
    slack: Slack,
) -> None:
    # Given a turn parked on an approval whose buttons Slack refuses for good (invalid_blocks)
    c = channel_id()
    session, tid = _park_with_refused_buttons(slack, c)
    # Then the thread says, in plain text, what the turn waits for and where it can be answered
    reply, note = slack.fake.thread(c, "30.1")
    assert reply.text == "Let me check." and note.blocks == []
    assert "Approve the refund?" in note.text and "invalid_blocks" in note.text
    assert "answered from the gateway or the console" in note.text
    # and the status line did not stay on
    statuses = [b["status"] for m, b in slack.in_thread(c, "30.1") if m == "assistant.threads.setStatus"]
    assert statuses == ["is thinking…", ""]
    # and the worker's log says so; the turn still waits for its answer
    logs = "\n".join(p.log.read_text(errors="replace") for p in slack.stack.procs)
    assert f"the approval prompt approve-refund of turn {tid} could not be shown in Slack (invalid_blocks)" in logs
    assert slack.stack.turn_row("desk", session, tid)["status"] == "suspended"  # type: ignore[index]


def test_a_turn_whose_prompt_slack_refused_is_answered_from_the_gateway_and_its_reply_posted_in_the_thread(
    slack: Slack,
) -> None:
    # Given a turn parked on an approval whose buttons Slack refused, and the speaker U1 with a gateway token
    c = channel_id()
    session, tid = _park_with_refused_buttons(slack, c)
    token = f"u1-{uuid.uuid4().hex}"
    table = TokenTable.of({token: Principal("U1", frozenset({"desk"}), operator=True)})
    served = ServedApp(create_app(dataclasses.replace(slack.settings, tokens=table)), access_log=False)
    try:
        # When U1 answers it through the gateway's /v1 resume
        path = f"/v1/agents/desk/sessions/{urllib.parse.quote(session)}/turns/{urllib.parse.quote(tid)}/resume"
        answer = httpx.post(served.url + path, json={"input_id": "approve-refund", "value": True},
                            headers={"Authorization": f"Bearer {token}"}, timeout=30)  # fmt: skip
    finally:
        served.stop()
    assert answer.status_code == 202, answer.text
    # Then the turn goes on, and what it said next is a message of its own in the thread
    wait_for(lambda: (slack.stack.turn_row("desk", session, tid) or {}).get("status") == "completed", timeout_s=30,
             what="the turn to complete")  # fmt: skip
    wait_for(lambda: slack.delivered(session, tid), what="the continuation to be delivered")
    texts = [m.text for m in slack.fake.thread(c, "30.1")]
    assert len(texts) == 3 and texts[0] == "Let me check." and texts[2] == "Refund approved."


# --- 4, 5. the gateway's Slack configuration at start ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gateway_env(slack: Slack, **extra: str) -> dict[str, str]:
    """A gateway's environment: the stack's, no bot token, agents built from JUNE_AGENTS, the signing secret."""
    env = {k: v for k, v in slack.stack.env.items() if k != "SLACK_BOT_TOKEN" and not k.startswith("JUNE_GATEWAY_")}
    return {**env, "JUNE_GATEWAY_INSECURE_DEV": "1", "SLACK_SIGNING_SECRET": SECRET, **extra}


def test_a_gateway_that_builds_its_agents_from_june_agents_needs_no_bot_token(slack: Slack, tmp_path: Path) -> None:
    # Given `june gateway` learning its agents from JUNE_AGENTS (the workers' Slack agent), without SLACK_BOT_TOKEN
    port = _free_port()
    env = _gateway_env(slack, JUNE_SLACK_AGENT="desk")
    gateway = Proc("gateway-no-token", [sys.executable, "-m", "june_worker.cli", "gateway", "--port", str(port)], env,
                   tmp_path / "gateway.log")  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if gateway.popen.poll() is not None:
            raise AssertionError(f"the gateway exited:\n{gateway.tail()}")
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    c = channel_id()
    try:
        # When it starts, and Slack sends it a message
        wait_for(healthy, timeout_s=60, every_s=0.1, what="the gateway to answer /healthz")
        body = json.dumps(message(c, "40.1", "no token here")).encode()
        sent = httpx.post(f"{url}/slack/events", content=body, timeout=10,
                          headers={"Content-Type": "application/json", **signed(SECRET, body)})  # fmt: skip
    finally:
        gateway.stop()
    # Then it took the event, and the workers (which hold the token) answered in the thread
    assert sent.status_code == 200 and sent.json() == {"ok": True}
    wait_for(lambda: slack.delivered(f"slack:{c}:40.1", turn_id(c, "40.1")), what="the turn to be delivered")
    assert [m.text for m in slack.fake.thread(c, "40.1")] == ["did: no token here"]


def test_a_gateway_whose_slack_agent_has_no_deliver_hook_exits_2_with_one_line(slack: Slack) -> None:
    # Given JUNE_SLACK_AGENT naming an agent with no deliver hook: a worker would reject every Slack turn of it
    agents = "tests.integration.slack_agents:ALL,tests.integration.slack_agents:BARE"
    env = _gateway_env(slack, JUNE_AGENTS=agents, JUNE_SLACK_AGENT="bare")
    # When `june gateway` starts
    done = subprocess.run([sys.executable, "-m", "june_worker.cli", "gateway", "--port", str(_free_port())], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    # Then it refuses to, in one line naming the agent and what it lacks
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("june gateway: JUNE_SLACK_AGENT='bare': agent bare has no deliver hook")


# --- 6. what the identity resolver is told --------------------------------------------------------------------


def test_the_identity_resolver_is_told_the_senders_own_team_and_the_channel_for_a_message_and_a_click(
    slack: Slack,
) -> None:
    # Given a resolver that takes the sender's team and the channel, and a Slack Connect channel of workspace T1
    # where U9 of workspace T2 writes
    told: list[tuple[str, str | None, str | None, str | None]] = []

    def resolve(user_id: str, team_id: str | None, *, user_team_id: str | None, channel_id: str | None) -> Any:
        told.append((user_id, team_id, user_team_id, channel_id))
        return {"id": f"acct-{user_team_id}-{user_id}"}

    assert slack.settings.slack is not None
    settings = dataclasses.replace(slack.settings, slack=dataclasses.replace(slack.settings.slack,
                                                                             resolve_identity=resolve))  # fmt: skip
    served = ServedApp(create_app(settings), access_log=False)
    c = channel_id()
    session, tid = f"slack:{c}:60.1", turn_id(c, "60.1")
    try:
        with httpx.Client(base_url=served.url, timeout=10) as http:
            # When U9's message arrives, and U9 approves what its turn asks
            payload = message(c, "60.1", "refund order 9", user="U9")
            payload["event"] |= {"user_team": "T2", "team": "T2"}
            body = json.dumps(payload).encode()
            assert http.post("/slack/events", content=body, headers=signed(SECRET, body)).status_code == 200
            wait_for(lambda: slack.delivered(session, tid), timeout_s=30, what="the park to be delivered")
            prompt = next(b for m, b in slack.in_thread(c, "60.1") if m == "chat.postMessage" and b.get("blocks"))
            prompt_ts = next(m.ts for m in slack.fake.thread(c, "60.1") if m.blocks)
            click = click_on(prompt, c, "60.1", prompt_ts, "U9", "yes")
            click["user"]["team_id"] = "T2"
            form = urllib.parse.urlencode({"payload": json.dumps(click)}).encode()
            headers = {"Content-Type": "application/x-www-form-urlencoded", **signed(SECRET, form)}
            assert http.post("/slack/interactivity", content=form, headers=headers).status_code == 200
    finally:
        served.stop()
    wait_for(lambda: (slack.stack.turn_row("desk", session, tid) or {}).get("status") == "completed", timeout_s=30,
             what="the turn to complete")  # fmt: skip
    # Then the resolver was told, each time, the receiving workspace, U9's own, and the channel
    assert told == [("U9", "T1", "T2", c), ("U9", "T1", "T2", c)]
    (stored,) = slack.stack.sql("select payload::text from june_turns where turn_id = %s", tid)
    assert json.loads(stored[0])["event"]["principal"] == {"id": "acct-T2-U9"}
