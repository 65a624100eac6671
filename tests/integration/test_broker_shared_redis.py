"""A Redis broker database shared with another Celery app: june's workers put back only june's own messages.

kombu keeps a worker's delivered, unacknowledged messages in a set per database and puts each
back in its queue once the visibility timeout passed. june's timeout is a few leases (6 s here),
another app's an hour: with one set for both, a june worker would hand another app's long task
out a second time. The broker here is a Redis of this test's own.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from tests import _services

from .conftest import Stack, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def broker() -> Iterator[_services.RedisServer]:
    try:
        with _services.private_redis() as server:
            yield server
    except _services.ServiceUnavailable as exc:
        pytest.exit(str(exc), returncode=pytest.ExitCode.USAGE_ERROR)


@contextlib.contextmanager
def _other_app_holding_a_message(url: str, queue: str) -> Iterator[Any]:
    """Another app's worker that took a message from its queue (kombu's default settings) and has not acknowledged
    it, two hours ago: past any visibility timeout. Its connection stays open (a close would put the message back)."""
    with Connection(url) as conn:
        q = Queue(queue, Exchange(queue, type="direct"), routing_key=queue)
        with conn.Producer() as producer:
            producer.publish({"task": "reports.monthly"}, exchange=q.exchange, routing_key=queue, declare=[q])
        message = q(conn.default_channel).get(no_ack=False)
        assert message is not None
        client = redis.Redis.from_url(url)
        tag = message.delivery_tag
        assert client.zscore("unacked_index", tag) is not None  # kombu's database-wide default set
        client.zadd("unacked_index", {tag: time.time() - 7200})
        try:
            yield tag
        finally:
            client.close()


def test_a_june_worker_puts_back_its_own_unacknowledged_message_and_leaves_another_apps_alone(
    broker: _services.RedisServer, fresh_db: str, redis_url: str, tmp_path: Path
) -> None:
    other = f"other-app-{uuid.uuid4().hex[:6]}"
    stack = Stack(fresh_db, redis_url, tmp_path, broker.url)
    client = redis.Redis.from_url(broker.url)
    try:
        with _other_app_holding_a_message(broker.url, other) as tag:
            # Given a june worker whose main process died after it took a turn's message, before recording it
            session = f"shared-{uuid.uuid4().hex[:6]}"
            doomed = stack.worker(f"doomed-{session[-6:]}", env={"JUNE_CRASH_AT": "before-intake"})
            turn_id = stack.turn("ops", session, "order 2 bolt")
            wait_for(lambda: doomed.popen.poll() is not None, what="the worker's main process to be killed")
            doomed.kill()
            # When another june worker puts the message back after june's visibility timeout, and runs the turn
            stack.worker(f"rescuer-{session[-6:]}")
            wait_for(
                lambda: (stack.turn_row("ops", session, turn_id) or {}).get("status") == "completed",
                timeout_s=60,
                what="the june turn, put back by the rescuer",
            )
            # Then the other app's message, taken two hours ago, is still its worker's, unacknowledged
            assert client.llen(other) == 0
            assert client.zscore("unacked_index", tag) is not None
            assert client.hexists("unacked", tag)
    finally:
        client.close()
        stack.close()
