"""Slack end to end: a served gateway, real Celery workers, Postgres, Redis, and a fake Slack Web API.

Requests are signed as Slack signs them; the workers' ``slack_sdk`` talks to the fake
(``JUNE_SLACK_API_URL``), which records every call. The gateway only verifies, enqueues and
answers; every Slack call is a worker's. A picture of the thread is not possible without Slack, so
each scenario asserts the exact sequence of Slack calls (live pushes are paced, so text deltas may
coalesce; the scenarios below say each reply in one model chunk, which makes the sequence exact).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from june_wire.keys import EventKeys
from june_worker.engine.store import SessionRef
from june_worker.gateway import create_app
from tests._fake_slack import signed
from tests.gateway.kit import ServedApp

from .conftest import Proc, wait_for
from .slack_agents import SLOW_DIRECTORY
from .slack_kit import SECRET, TOKEN, Slack, channel_id, click_on, message, slack_stack, turn_id

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def slack(fresh_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slack]:
    yield from slack_stack(fresh_db, redis_url, tmp_path_factory.mktemp("slack"))


# --- the whole flow ------------------------------------------------------------------------------------------


def test_s186_s183_a_live_reply_and_prompt_a_refused_click_keeps_the_park_the_right_click_resumes_into_it(
    slack: Slack,
) -> None:
    c = channel_id()
    session, tid = f"slack:{c}:100.1", turn_id(c, "100.1")
    # A message: 200 at once, a turn, a live reply in the thread, then the approval prompt.
    answer = slack.event(message(c, "100.1", "refund order 42"))
    assert answer.status_code == 200
    wait_for(lambda: slack.delivered(session, tid), timeout_s=30, what="the turn to park and be delivered")
    first = slack.in_thread(c, "100.1")
    assert [m for m, _ in first] == [
        "assistant.threads.setStatus", "chat.startStream", "chat.appendStream", "chat.stopStream",
        "chat.postMessage", "assistant.threads.setStatus",
    ]  # fmt: skip
    status_on, start, timeline, _stop, prompt, status_off = (b for _, b in first)
    assert status_on["status"] == "is thinking…" and status_off["status"] == ""
    assert start["markdown_text"] == "Let me check." and start["thread_ts"] == "100.1"
    assert (start["recipient_user_id"], start["recipient_team_id"]) == ("U1", "T1")
    assert timeline["chunks"] == [
        {"type": "task_update", "id": "c1", "title": "approve_refund", "status": "in_progress"}
    ]
    assert prompt["text"] == "Approve the refund?" and prompt["thread_ts"] == "100.1"
    prompt_ts = next(m.ts for m in slack.fake.thread(c, "100.1") if m.blocks)

    # S186: U2 clicks Approve: not the answerer (the speaker U1 is). Refused, told to U2 only (an ephemeral note,
    # not a post to the click's response_url: docs/slack.md, "Limits"); the buttons stay, no chat.update.
    assert slack.click(click_on(prompt, c, "100.1", prompt_ts, "U2", "yes")).status_code == 200
    ephemeral = wait_for(lambda: slack.fake.of("chat.postEphemeral"), what="U2 to be told")
    assert ephemeral[0]["user"] == "U2" and ephemeral[0]["channel"] == c and "not applied" in ephemeral[0]["text"]
    assert [m for m, _ in slack.in_thread(c, "100.1")][len(first) :] == ["chat.postEphemeral"], "no chat.update"
    parked = slack.stack.sql("select suspended is not null from june_sessions where session = %s", session)
    assert parked == [(True,)]

    # S183: U1 clicks Approve: resumed by U1, the continuation rendered into the prompt message.
    before = len(slack.in_thread(c, "100.1"))
    assert slack.click(click_on(prompt, c, "100.1", prompt_ts, "U1", "yes")).status_code == 200
    wait_for(lambda: (slack.stack.turn_row("desk", session, tid) or {}).get("status") == "completed", timeout_s=30,
             what="the turn to complete")  # fmt: skip
    wait_for(lambda: slack.delivered(session, tid), what="the continuation to be delivered")
    rest = slack.in_thread(c, "100.1")[before:]
    assert [m for m, _ in rest] == [
        "assistant.threads.setStatus", "chat.update", "chat.update", "assistant.threads.setStatus",
    ]  # fmt: skip
    answered, final = rest[1][1], rest[2][1]
    assert answered["ts"] == final["ts"] == prompt_ts
    assert final["text"] == "Refund approved."
    assert all(b["type"] != "actions" for b in final["blocks"])
    assert [m.text for m in slack.fake.thread(c, "100.1")] == ["Let me check.", "Refund approved."]
    answer_step = slack.stack.sql(
        "select data::text from june_steps where session = %s and step_id like 'input:%%'", session
    )
    assert json.loads(answer_step[0][0])["by"] == "U1"


def test_s163_a_signed_message_is_answered_200_before_its_turn_ends_and_replied_to_in_its_thread(
    slack: Slack,
) -> None:
    # Given a turn that will be held before its model call until the test lets it go
    c = channel_id()
    session, tid = f"slack:{c}:111.1", turn_id(c, "111.1")
    hold = slack.stack.tmp / "gates" / f"hold-{tid}"
    hold.touch()
    try:
        # When a signed message arrives
        answer = slack.event(message(c, "111.1", "order 3 widgets"))
        # Then the gateway answered 200 while the turn had not ended (it could not: it is held)
        assert answer.status_code == 200 and answer.json() == {"ok": True}
        row = slack.stack.turn_row("desk", session, tid)
        assert row is None or row["status"] in ("queued", "running")
    finally:
        hold.unlink()
    # and once it runs, exactly one reply in the thread, the exact sequence of Slack calls
    wait_for(lambda: slack.delivered(session, tid), what="the turn to be delivered")
    calls = slack.in_thread(c, "111.1")
    assert [m for m, _ in calls] == [
        "assistant.threads.setStatus", "chat.startStream", "chat.stopStream", "assistant.threads.setStatus",
    ]  # fmt: skip
    start = calls[1][1]
    assert (start["channel"], start["thread_ts"], start["markdown_text"]) == (c, "111.1", "did: order 3 widgets")
    assert [m.text for m in slack.fake.thread(c, "111.1")] == ["did: order 3 widgets"]


def test_the_same_event_delivered_three_times_starts_one_turn(slack: Slack) -> None:
    c = channel_id()
    payload = message(c, "200.1", "hello there")
    answers = [slack.event(payload, retry=n or None) for n in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 200]
    session, tid = f"slack:{c}:200.1", turn_id(c, "200.1")
    wait_for(lambda: slack.delivered(session, tid), what="the turn to be delivered")
    assert slack.stack.sql("select turn_id from june_turns where session = %s", session) == [(tid,)]
    assert [m for m, _ in slack.in_thread(c, "200.1")] == [
        "assistant.threads.setStatus", "chat.startStream", "chat.stopStream", "assistant.threads.setStatus",
    ]  # fmt: skip
    assert [m.text for m in slack.fake.thread(c, "200.1")] == ["did: hello there"]
    # S167: what the gateway sent, for the worker to run and render (the gateway holds no token: no Slack call)
    (payload,) = slack.stack.sql("select payload::text from june_turns where turn_id = %s", tid)
    sent = json.loads(payload[0])
    assert sent["text"] == "hello there"
    assert sent["target"] == {"channel": "slack", "channel_id": c, "thread_ts": "200.1", "team_id": "T1", "user": "U1"}
    event = sent["event"]
    assert (event["source"], event["kind"], event["channel_id"], event["thread_ts"]) == ("slack", "message", c, "200.1")
    assert event["user"] == {"id": "U1", "attested": True, "team": "T1"}
    assert slack.fake.tokens == {f"Bearer {TOKEN}"}


def test_a_copy_arriving_while_its_event_is_still_being_sent_is_not_acknowledged_so_a_failed_send_loses_nothing(
    slack: Slack,
) -> None:
    # Given an event whose first copy a gateway has claimed and is still sending (its broker slow or down)
    c = channel_id()
    payload = message(c, "250.1", "are you there")
    session, tid = f"slack:{c}:250.1", turn_id(c, "250.1")
    seen = EventKeys(prefix=slack.stack.prefix).gateway_slack_seen(SessionRef("desk", session), tid)
    slack.stack.redis.set(seen, "sending", ex=30)
    # When Slack's retry of it arrives meanwhile
    retried = slack.event(payload, retry=1)
    # Then it is not acknowledged (a 200 would end Slack's retries while the send may still fail), and not sent
    assert retried.status_code == 503
    assert slack.stack.sql("select turn_id from june_turns where session = %s", session) == []
    # And when that first send failed (its claim released), Slack's next retry sends the turn, once
    slack.stack.redis.delete(seen)
    assert slack.event(payload, retry=2).status_code == 200
    assert slack.event(payload, retry=3).status_code == 200
    wait_for(lambda: slack.delivered(session, tid), what="the turn to be delivered")
    assert slack.stack.sql("select turn_id from june_turns where session = %s", session) == [(tid,)]
    assert [m.text for m in slack.fake.thread(c, "250.1")] == ["did: are you there"]


def test_a_bad_or_old_signature_does_nothing_and_a_malformed_payload_is_a_400(slack: Slack) -> None:
    c = channel_id()
    calls_before = len(slack.fake.calls)
    bad = slack.event(message(c, "300.1", "hello"), secret="not-the-secret")
    old = slack.event(message(c, "300.1", "hello"), timestamp=int(time.time()) - 600)
    clicked = slack.click({"type": "block_actions"}, secret="not-the-secret")
    assert [r.status_code for r in (bad, old, clicked)] == [401, 401, 401]
    body = b"{not json"
    malformed = slack.http.post("/slack/events", content=body, headers=signed(SECRET, body))
    assert malformed.status_code == 400 and "not a Slack payload" in malformed.json()["detail"]
    wrong_shape = slack.event({"type": "event_callback", "team_id": "T1", "event": {"type": "message", "ts": []}})
    assert wrong_shape.status_code == 400 and "event.user" in wrong_shape.json()["detail"]
    challenge = slack.event({"type": "url_verification", "challenge": "3eZbrw1aBm"})
    assert challenge.json() == {"challenge": "3eZbrw1aBm"}
    assert slack.stack.sql("select 1 from june_turns where session like %s", f"slack:{c}:%") == []
    assert slack.stack.sql("select 1 from june_gateway_sessions where session like %s", f"slack:{c}:%") == []
    assert len(slack.fake.calls) == calls_before


def test_a_worker_sigkilled_mid_render_still_ends_with_one_complete_reply(slack: Slack) -> None:
    c = channel_id()
    session, tid = f"slack:{c}:400.1", turn_id(c, "400.1")
    doomed = slack.turn_worker
    doomed_env = {"JUNE_IT_SLACK_WORD_S": "0.05"}
    doomed.stop()
    doomed = slack.turn_worker = slack.stack.worker(f"doomed-{c}", concurrency=1, queues=slack.stack.queue,
                                                    env=doomed_env)  # fmt: skip
    slack.event(message(c, "400.1", "stream 80"))
    wait_for(lambda: len([m for m, _ in slack.in_thread(c, "400.1") if m == "chat.appendStream"]) >= 3,
             timeout_s=30, what="the reply to stream")  # fmt: skip
    doomed.kill()  # mid-render: the stream is open, its ts recorded
    slack.turn_worker = slack.stack.worker(f"rescuer-{c}", concurrency=2, queues=slack.stack.queue)
    wait_for(lambda: slack.delivered(session, tid), timeout_s=60, what="the turn to be finished and delivered")
    words = " ".join(f"w{i}" for i in range(80))
    shown = slack.fake.thread(c, "400.1")
    assert [(m.text, m.streaming) for m in shown] == [(words, False)], "one complete reply, the same message"
    methods = [m for m, _ in slack.in_thread(c, "400.1")]
    assert methods.count("chat.startStream") == 1 and "chat.postMessage" not in methods
    assert methods[-1] == "assistant.threads.setStatus"


def test_a_new_message_replaces_the_running_turn_and_never_a_parked_approval(slack: Slack) -> None:
    c = channel_id()
    slack.turn_worker.stop()
    slack.turn_worker = slack.stack.worker(f"slow-{c}", concurrency=2, queues=slack.stack.queue,
                                           env={"JUNE_IT_SLACK_WORD_S": "0.05"})  # fmt: skip
    try:
        slack.event(message(c, "500.1", "stream 400"))
        wait_for(lambda: [m for m, _ in slack.in_thread(c, "500.1") if m == "chat.appendStream"], what="streaming")
        slack.event(message(c, "500.2", "and another thing", thread_ts="500.1"))
        session = f"slack:{c}:500.1"
        wait_for(lambda: slack.delivered(session, turn_id(c, "500.2")), timeout_s=30, what="the newer turn")
        wait_for(lambda: slack.delivered(session, turn_id(c, "500.1")), timeout_s=30, what="the replaced turn")
        stale, fresh = slack.fake.thread(c, "500.1")
        assert stale.text.endswith("_superseded by a newer message_") and not stale.streaming
        assert fresh.text == "did: and another thing"
        assert slack.stack.turn_row("desk", session, turn_id(c, "500.1"))["status"] == "cancelled"  # type: ignore[index]

        # A parked approval is never replaced: the new message is refused, its sender told why.
        slack.event(message(c, "600.1", "refund it"))
        parked_session = f"slack:{c}:600.1"
        wait_for(lambda: slack.delivered(parked_session, turn_id(c, "600.1")), timeout_s=30, what="the park")
        slack.event(message(c, "600.2", "hurry up", user="U7", thread_ts="600.1"))
        wait_for(lambda: [b for b in slack.fake.of("chat.postEphemeral") if b["user"] == "U7"], what="U7 to be told")
        assert slack.stack.turn_row("desk", parked_session, turn_id(c, "600.1"))["status"] == "suspended"  # type: ignore[index]
        assert slack.stack.turn_row("desk", parked_session, turn_id(c, "600.2"))["status"] == "rejected"  # type: ignore[index]
    finally:
        slack.turn_worker.stop()
        slack.turn_worker = slack.stack.worker(f"turns-{c}", concurrency=2, queues=slack.stack.queue)


def test_an_identity_resolver_failure_leaves_the_turn_anonymous_but_running(slack: Slack) -> None:
    c = channel_id()
    slack.event(message(c, "700.1", "who am I", user="U_BROKEN"))
    slack.event(message(c, "700.2", "who am I", user="U1"))
    for ts in ("700.1", "700.2"):
        wait_for(lambda ts=ts: slack.delivered(f"slack:{c}:{ts}", turn_id(c, ts)), what="both turns")  # type: ignore[misc]
    principals = {
        ts: json.loads(slack.stack.sql("select payload::text from june_turns where turn_id = %s", turn_id(c, ts))[0][0])
        ["event"].get("principal")
        for ts in ("700.1", "700.2")
    }  # fmt: skip
    assert principals == {"700.1": None, "700.2": {"id": "acct-U1", "team": "T1"}}
    assert [m.text for m in slack.fake.thread(c, "700.1")] == ["did: who am I"]


def test_a_failed_tool_shows_as_an_error_and_a_failed_turn_gets_a_note(slack: Slack) -> None:
    c = channel_id()
    slack.event(message(c, "800.1", "fail now"))
    slack.event(message(c, "800.2", "boom"))
    for ts in ("800.1", "800.2"):
        wait_for(lambda ts=ts: slack.delivered(f"slack:{c}:{ts}", turn_id(c, ts)), what="both turns")  # type: ignore[misc]
    chunks = [ch for m, b in slack.in_thread(c, "800.1") if m == "chat.appendStream" for ch in b.get("chunks", [])]
    assert [(ch["title"], ch["status"]) for ch in chunks] == [("broken", "in_progress"), ("broken", "error")]
    assert "read-only" in chunks[-1]["output"]
    (failed,) = slack.fake.thread(c, "800.2")
    assert "the turn failed" in failed.text and "model is down" not in failed.text


def test_slack_api_errors_are_retried_and_never_lose_the_turn(slack: Slack) -> None:
    c = channel_id()
    session, tid = f"slack:{c}:900.1", turn_id(c, "900.1")
    slack.fake.fail_all = "internal_error"
    try:
        slack.event(message(c, "900.1", "are you there"))
        wait_for(lambda: (slack.stack.turn_row("desk", session, tid) or {}).get("status") == "completed",
                 what="the turn to complete while Slack fails")  # fmt: skip
        wait_for(lambda: any(not call.ok and call.body.get("thread_ts") == "900.1" for call in slack.fake.calls),
                 what="a failed Slack call")  # fmt: skip
    finally:
        slack.fake.fail_all = None
    wait_for(lambda: slack.delivered(session, tid), timeout_s=30, what="the sweeper to deliver it again")
    assert [m.text for m in slack.fake.thread(c, "900.1")] == ["did: are you there"]
    logs = "\n".join(p.log.read_text(errors="replace") for p in slack.stack.procs)
    assert "failed: internal_error" in logs
    assert TOKEN not in logs and SECRET not in logs
    assert slack.fake.tokens == {f"Bearer {TOKEN}"}


def test_a_proactive_turn_from_beat_is_delivered_to_a_slack_channel(slack: Slack) -> None:
    c = channel_id()
    env = {
        **slack.stack.env,
        "JUNE_EXAMPLE_SCHEDULE": "1",
        "JUNE_EXAMPLE_SCHEDULE_EVERY_S": "1",
        "JUNE_EXAMPLE_AGENT": "desk",
        "JUNE_EXAMPLE_SESSION": f"slack:{c}:daily",
        "JUNE_EXAMPLE_TARGET": json.dumps({"channel": "slack", "channel_id": c}),
    }
    args = [sys.executable, "-m", "celery", "-A", "june_worker", "beat", "-l", "INFO",
            "-s", str(slack.stack.tmp / f"beat-{c}"), "--pidfile="]  # fmt: skip
    beat = Proc(f"beat-{c}", args, env, slack.stack.tmp / f"beat-{c}.log")
    try:
        posts = wait_for(lambda: [b for b in slack.fake.of("chat.postMessage") if b["channel"] == c], timeout_s=30,
                         what="the digest in the channel")  # fmt: skip
    finally:
        beat.stop()
    assert posts[0]["text"] == "Three threads are open." and "thread_ts" not in posts[0]


def test_s169_when_the_turn_cannot_be_enqueued_slack_gets_an_error_and_its_retry_is_sent(slack: Slack) -> None:
    # Given a gateway whose broker is down: the event is not acknowledged (503), so Slack retries it
    settings = dataclasses.replace(
        slack.settings, broker_url="redis://127.0.0.1:1/0", publish_timeout_s=0.5, publish_retries=0
    )
    down = ServedApp(create_app(settings), access_log=False)
    c = channel_id()
    payload = message(c, "950.1", "still there?")
    try:
        with httpx.Client(base_url=down.url, timeout=30) as http:
            body = json.dumps(payload).encode()
            answer = http.post("/slack/events", content=body, headers={"Content-Type": "application/json",
                                                                         **signed(SECRET, body)})  # fmt: skip
    finally:
        down.stop()
    assert answer.status_code == 503
    # When Slack retries to a gateway that can send: the turn runs once
    assert slack.event(payload, retry=1).status_code == 200
    session, tid = f"slack:{c}:950.1", turn_id(c, "950.1")
    wait_for(lambda: slack.delivered(session, tid), what="the retried event's turn")
    assert [m.text for m in slack.fake.thread(c, "950.1")] == ["did: still there?"]


def _at_once(slack: Slack, payloads: list[dict[str, Any]]) -> list[int]:
    """Send the events at the same moment, each on its own connection (Slack delivers them independently)."""
    ready = threading.Barrier(len(payloads))

    def send(payload: dict[str, Any]) -> int:
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", **signed(SECRET, body)}
        with httpx.Client(base_url=slack.url, timeout=10) as http:
            ready.wait(5)
            return http.post("/slack/events", content=body, headers=headers).status_code

    with ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(send, payloads))


def test_a_message_and_its_app_mention_copy_at_once_with_replace_on_are_one_turn_that_completes(slack: Slack) -> None:
    # Given the manifest's subscriptions (message.channels and app_mention) and replace_in_flight on: a message that
    # mentions the bot arrives twice at once, as a message and as an app_mention: one turn id. The race is between
    # the copies, so it is run ten times (unfixed, a copy cancelled its own turn in about one pair out of seven).
    assert slack.settings.slack is not None and slack.settings.slack.replace_in_flight
    for _ in range(10):
        c = channel_id()
        plain = message(c, "130.1", "<@UBOT> hello both")
        mention = {**plain, "event_id": f"Ev{uuid.uuid4().hex[:8]}", "event": {**plain["event"], "type": "app_mention"}}
        # When both copies are sent at the same moment
        assert _at_once(slack, [plain, mention]) == [200, 200]
        # Then one turn, which completes (no copy cancelled it as "replaced"), and one reply in the thread
        session, tid = f"slack:{c}:130.1", turn_id(c, "130.1")
        wait_for(lambda: slack.delivered(session, tid), what="the turn to be delivered")  # noqa: B023
        turns = slack.stack.sql("select turn_id, status from june_turns where session = %s", session)
        assert turns == [(tid, "completed")]
        assert [m.text for m in slack.fake.thread(c, "130.1")] == ["did: hello both"]


def test_two_copies_of_a_replacing_turn_reaching_the_workers_at_once_never_cancel_that_turn(slack: Slack) -> None:
    # Given one Slack message's june.turn with replace on, sent twice at once straight to the workers (past the
    # gateway's claim: a producer's resend, a broker's redelivery). Ten tries: unfixed, the second copy marked the
    # turn itself replaced in a third of them.
    for _ in range(10):
        c = channel_id()
        session, tid = f"slack:{c}:140.1", turn_id(c, "140.1")
        turn = {"turn_id": tid, "agent": "desk", "session": session, "text": "hello twice", "replace": True,
                "event": {"source": "slack", "kind": "message", "channel_id": c, "thread_ts": "140.1", "ts": "140.1",
                          "user": {"id": "U1", "attested": True, "team": "T1"}},
                "target": {"channel": "slack", "channel_id": c, "thread_ts": "140.1", "team_id": "T1", "user": "U1"}}  # fmt: skip
        # When two worker processes take them
        for _ in range(2):
            slack.stack.send("june.turn", turn)
        # Then the turn completes: the replace spared the turn it came with
        wait_for(lambda: slack.delivered(session, tid), what="the turn to be delivered")  # noqa: B023
        turns = slack.stack.sql("select turn_id, status from june_turns where session = %s", session)
        assert turns == [(tid, "completed")]
        assert [m.text for m in slack.fake.thread(c, "140.1")] == ["did: hello twice"]


def test_a_copy_of_an_ended_turn_arriving_while_its_worker_still_renders_it_adds_no_second_reply(slack: Slack) -> None:
    # Given a turn whose live render is held up: Slack rate-limits its first chat.startStream (Retry-After 2 s), so
    # the turn has ended while its worker, still holding the session, waits to start the reply
    c = channel_id()
    session, tid = f"slack:{c}:150.1", turn_id(c, "150.1")
    slack.fake.retry_after_s, slack.fake.rate_limit["chat.startStream"] = 2, 1
    try:
        slack.event(message(c, "150.1", "slow start"))
        wait_for(lambda: (slack.stack.turn_row("desk", session, tid) or {}).get("status") == "completed",
                 what="the turn to end")  # fmt: skip
        assert not slack.delivered(session, tid)
        # When a copy of its june.turn reaches another worker process meanwhile (a resend, a redelivery)
        (payload,) = slack.stack.sql("select payload::text from june_turns where turn_id = %s", tid)
        sent = json.loads(payload[0])
        copy = {"turn_id": tid, "agent": "desk", "session": session, "text": sent["text"], "event": sent["event"],
                "target": sent["target"]}  # fmt: skip
        slack.stack.send("june.turn", copy)
        wait_for(lambda: slack.delivered(session, tid), what="the turn to be delivered")
        # and the held-up worker got past its Slack call, whatever the copy did
        wait_for(lambda: any(call.ok for call in slack.fake.calls if call.method == "chat.startStream"
                             and call.body["channel"] == c), what="the held-up chat.startStream to be answered")  # fmt: skip
        wait_for(lambda: not any(m.streaming for m in slack.fake.thread(c, "150.1")), what="the stream to stop")
    finally:
        slack.fake.retry_after_s = 1
        slack.fake.rate_limit.clear()
    # Then the copy left the delivery to the worker rendering it: one reply
    assert [m.text for m in slack.fake.thread(c, "150.1")] == ["did: slow start"]


def test_a_signed_but_malformed_interactivity_request_is_a_400_and_nothing_is_done(slack: Slack) -> None:
    c = channel_id()
    calls_before = len(slack.fake.calls)
    ours = {"type": "block_actions", "team": {"id": "T1"}, "user": {"id": "U1"},
            "container": {"type": "message", "channel_id": c, "message_ts": "1.2", "thread_ts": "1.1"}}  # fmt: skip
    bodies = [
        b"payload=%7Bnot+json",  # the payload field is not JSON
        b"nothing=here",  # no payload field
        urllib.parse.urlencode({"payload": json.dumps(["a", "list"])}).encode(),
        urllib.parse.urlencode({"payload": json.dumps({**ours, "actions": [
            {"action_id": "june_input:yes", "value": "not json"}]})}).encode(),
        urllib.parse.urlencode({"payload": json.dumps({**ours, "actions": [
            {"action_id": "june_input:yes", "value": json.dumps({"turn_id": "t1"})}]})}).encode(),
    ]  # fmt: skip
    for body in bodies:
        headers = {"Content-Type": "application/x-www-form-urlencoded", **signed(SECRET, body)}
        answer = slack.http.post("/slack/interactivity", content=body, headers=headers)
        assert answer.status_code == 400 and "not a Slack payload" in answer.json()["detail"], body
    # nothing sent on: no resume reached a worker (no note, no update), no session was opened
    assert len(slack.fake.calls) == calls_before
    assert slack.stack.sql("select 1 from june_gateway_sessions where session like %s", f"slack:{c}:%") == []


def test_an_identity_resolver_that_times_out_leaves_the_turn_anonymous_but_running(slack: Slack) -> None:
    # Given a directory that stopped answering for U_SLOW (past JUNE_SLACK_RESOLVE_TIMEOUT_S, 1 s here)
    c = channel_id()
    assert slack.settings.slack is not None and slack.settings.slack.resolve_timeout_s == 1.0
    try:
        # When U_SLOW's message arrives
        assert slack.event(message(c, "710.1", "who am I", user="U_SLOW")).status_code == 200
        # Then the turn runs without a principal, its speaker still attested, and is answered
        session, tid = f"slack:{c}:710.1", turn_id(c, "710.1")
        wait_for(lambda: slack.delivered(session, tid), what="the turn to be delivered")
    finally:
        SLOW_DIRECTORY.set()
    (payload,) = slack.stack.sql("select payload::text from june_turns where turn_id = %s", tid)
    event = json.loads(payload[0])["event"]
    assert event.get("principal") is None and event["user"] == {"id": "U_SLOW", "attested": True, "team": "T1"}
    assert slack.stack.turn_row("desk", session, tid)["status"] == "completed"  # type: ignore[index]
    assert [m.text for m in slack.fake.thread(c, "710.1")] == ["did: who am I"]


def test_a_slack_turn_runs_with_instructions_slack_md_and_without_the_tools_slack_is_denied(slack: Slack) -> None:
    # Given the desk agent's slack_desk/ directory: instructions.slack.md, and [surfaces.slack] deny_tools wire_money
    c = channel_id()
    # When a Slack message asks it what it sees, and another asks for the denied tool
    slack.event(message(c, "720.1", "policy"))
    slack.event(message(c, "730.1", "wire it"))
    for ts in ("720.1", "730.1"):
        wait_for(lambda ts=ts: slack.delivered(f"slack:{c}:{ts}", turn_id(c, ts)), what="both turns")  # type: ignore[misc]
    # Then its system prompt had the Slack instructions and its tools lacked wire_money (source slack)
    assert [m.text for m in slack.fake.thread(c, "720.1")] == ["slack-instructions: yes tools: approve_refund,broken"]
    # and the call to wire_money was refused as unknown, which the model read; the tool never ran
    (wired,) = slack.fake.thread(c, "730.1")
    assert wired.text.endswith("That did not work.")
    steps = slack.stack.sql(
        "select data::text from june_steps where session = %s and step_id like 'tool:%%'", f"slack:{c}:730.1"
    )
    assert len(steps) == 1 and "unknown tool wire_money" in steps[0][0] and '"wired"' not in steps[0][0]
