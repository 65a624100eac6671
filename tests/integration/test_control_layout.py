"""On RabbitMQ, a cancel reaches a running turn while the turn workers are busy, in the layout docker-compose.yml runs.

Quorum queues have no global prefetch: Celery gives each queue's consumer its own, so a worker
consuming both the turn queue and the control queue takes a control message while its one
process runs a turn, and holds it until that turn ends. A cancel of that very turn would wait
for it. docker-compose.yml (and the README) therefore run the control queue on workers of its
own; this test starts the workers as the compose file does, with one process each, and holds
the turn worker's process in a tool that only returns when the test releases it.
"""

from __future__ import annotations

import shlex
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from celery.exceptions import TimeoutError as CeleryTimeoutError

from .conftest import ROOT, Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.brokers("amqp")]

CANCELS = 3
"""Sent one after another: RabbitMQ hands a queue's messages to its consumers in turn, so with a busy worker among
the control queue's consumers one of three would land in its prefetch."""


def compose_workers(stack: Stack) -> dict[str, str]:
    """docker-compose.yml's june worker services and the queues each consumes, named as this stack names them."""
    services = yaml.safe_load(Path(ROOT, "docker-compose.yml").read_text())["services"]
    out = {}
    for name, svc in services.items():
        argv = svc.get("command") or []
        argv = argv if isinstance(argv, list) else shlex.split(argv)
        if argv[:4] != ["celery", "-A", "june_worker", "worker"]:
            continue
        env = svc["environment"]
        ours = {env["JUNE_QUEUE"]: stack.queue, env["JUNE_CONTROL_QUEUE"]: stack.control_queue}
        out[name] = ",".join(ours[q] for q in argv[argv.index("-Q") + 1].split(","))
    return out


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> dict[str, str]:
    layout = compose_workers(stack)
    assert {q for queues in layout.values() for q in queues.split(",")} == {stack.queue, stack.control_queue}
    for name, queues in layout.items():
        stack.worker(f"compose-{name}", concurrency=1, queues=queues)
    return layout


def test_a_cancel_reaches_a_running_turn_while_every_turn_process_is_busy(
    stack: Stack, workers: dict[str, str], session_id: str
) -> None:
    # Given the turn workers' only process held by a turn waiting in a tool
    key = uuid.uuid4().hex
    turn_id = stack.turn("ops", session_id, f"slow {key}")
    wait_for(lambda: stack.redis.llen(f"it:hold:{key}:log") == 1, what="the turn's tool to start")
    try:
        # When cancels of it are sent, one after another
        answers: list[Any] = []
        for n in range(1, CANCELS + 1):
            payload = {"agent": "ops", "session": session_id, "turn_id": turn_id}
            try:
                answers.append(stack.send("june.cancel", payload).get(timeout=30))
            except CeleryTimeoutError:
                raise AssertionError(
                    f"cancel {n} of {CANCELS} got no answer in 30 s while the turn ran: a busy worker holds it "
                    f"(layout {workers})"
                ) from None
        # Then each was taken and applied while the tool still holds the turn's process
        assert stack.redis.llen(f"it:hold:{key}:log") == 1 and not stack.redis.exists(f"it:hold:{key}:release")
        assert [a["status"] for a in answers] == ["cancel-requested"] * CANCELS
        assert answers[0]["turn_ids"] == [turn_id]
    finally:
        stack.redis.set(f"it:hold:{key}:release", 1)
    # and the turn stops at its next checkpoint once the tool returns
    assert stack.wait_terminal("ops", session_id, turn_id)["type"] == "turn.cancelled"
