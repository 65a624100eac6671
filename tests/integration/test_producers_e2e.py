"""The producer client and the june-produce CLI against real workers: the README's worked example. On both brokers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT, Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.brokers("redis", "amqp")]


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> None:
    stack.worker("e2e-turns", queues=stack.queue)
    stack.worker("e2e-control", pool="solo", queues=stack.control_queue)


def _cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "JUNE_REDIS_URL": stack.redis_url,
        "CELERY_BROKER_URL": stack.broker_url,
        "CELERY_RESULT_BACKEND": stack.redis_url,
        "JUNE_QUEUE": stack.queue,
        "JUNE_CONTROL_QUEUE": stack.control_queue,
        "JUNE_KEY_PREFIX": stack.prefix,
    }
    cmd = [sys.executable, "-m", "producers.cli", *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=90)


def test_a_producer_starts_a_turn_and_follows_it_to_the_end(stack: Stack, session_id: str) -> None:
    producer = stack.producer()
    turn_id = producer.start_turn("ops", session_id, "order 2 widget")
    events = list(producer.follow("ops", session_id, turn_id=turn_id, timeout_s=30))
    assert events[-1].type == "turn.completed"
    assert [e.type for e in events if not e.delta] == [
        "turn.started",
        "message.completed",
        "action.requested",
        "action.completed",
        "message.completed",
        "turn.completed",
    ]


def test_the_refund_approval_worked_example_from_the_cli(stack: Stack, session_id: str) -> None:
    # 1. a turn that asks for approval parks: exit code 3, the request printed with how to answer
    parked = _cli(stack, "turn", "ops", session_id, "refund order 42", "--turn-id", f"t_{session_id}", "--json")
    assert parked.returncode == 3, parked.stderr
    lines = [json.loads(line) for line in parked.stdout.splitlines()]
    request = [e for e in lines if e["type"] == "input.requested"][0]
    assert request["request"]["id"] == "approve-refund"
    # 2. someone who may not answer is refused; the turn stays parked
    refused = _cli(stack, "resume", "ops", session_id, f"t_{session_id}", "approve-refund", "true", "--by", "mallory")
    assert refused.returncode != 0 and "forbidden" in (refused.stdout + refused.stderr)
    # 3. an operator approves; following the session shows the turn complete
    ok = _cli(stack, "resume", "ops", session_id, f"t_{session_id}", "approve-refund", "true", "--by", "op-ann")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    follow = _cli(
        stack,
        "follow",
        "ops",
        session_id,
        "--turn",
        f"t_{session_id}",
        "--from",
        request["stream_id"],
        "--json",
        "--timeout",
        "30",
    )
    done = [json.loads(line) for line in follow.stdout.splitlines()]
    assert done[-1]["type"] == "turn.completed"
    completed = [e for e in done if e["type"] == "action.completed"][0]
    assert completed["result"] == {"refunded": True}


def test_reset_and_cancel_outcomes_reach_the_producer(stack: Stack, session_id: str) -> None:
    producer = stack.producer()
    turn_id = producer.start_turn("ops", session_id, "hello")
    list(producer.follow("ops", session_id, turn_id=turn_id, timeout_s=30))
    outcome = producer.reset("ops", session_id)
    assert (outcome.status, outcome.previous_session, outcome.generation) == ("reset", f"{session_id}#g0", 0)
    assert producer.cancel("ops", session_id, turn_id)["status"] == "nothing-to-cancel"


def test_a_turn_with_a_target_is_delivered_by_the_agents_hook(stack: Stack, session_id: str) -> None:
    producer = stack.producer()
    turn_id = producer.start_turn("ops", session_id, "status", target={"channel": "C-ops"})
    list(producer.follow("ops", session_id, turn_id=turn_id, timeout_s=30))
    # the hook runs once the turn has ended, right after its last event
    delivered = wait_for(lambda: stack.redis.lrange(f"it:delivered:{session_id}", 0, -1), what="delivery")
    assert delivered == ["C-ops|ok: status"]
