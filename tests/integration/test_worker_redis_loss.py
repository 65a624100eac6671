"""Redis loses everything mid-run (a restart without persistence); Postgres remembers, the sweeper recovers.

This test runs its own Redis (broker, results and streams), never the shared one, and
restarts it while a session has one turn running and four queued.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._services import RedisServer

from .conftest import Stack, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def lossy(fresh_db: str, private_redis: RedisServer, tmp_path: Path) -> Iterator[tuple[Stack, RedisServer]]:
    s = Stack(fresh_db, private_redis.url, tmp_path)
    s.sql("create table if not exists it_orders (turn_id text not null, call_id text not null, item text, qty integer)")
    try:
        yield s, private_redis
    finally:
        s.stop()


def test_after_a_redis_restart_the_sweeper_recovers_every_queued_turn(lossy: tuple[Stack, RedisServer]) -> None:
    stack, server = lossy
    session, key = f"lossy-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    holder = stack.worker("holder", pool="solo")
    stack.worker("intake", pool="solo")
    stack.beat()
    first = stack.turn("ops", session, f"slow {key}")
    wait_for(lambda: stack.redis.llen(f"it:hold:{key}:log") == 1, what="the first turn to hold its worker")
    queued = [stack.turn("ops", session, f"order {n} part") for n in range(1, 5)]

    def recorded() -> bool:
        rows = stack.sql("select count(*) from june_turns where agent = 'ops' and session = %s", session)
        return rows == [(5,)]

    wait_for(recorded, what="the other worker to record the four queued turns")
    # The holder dies and Redis comes back empty: no message, no result, no stream survives. The
    # sentinel says so; counting keys would race the intake worker and beat, which reconnect at once
    # and declare their queues again.
    stack.redis.set("it:sentinel", 1)
    holder.kill()
    server.restart()
    assert stack.redis.exists("it:sentinel") == 0
    stack.redis.set(f"it:hold:{key}", 1)  # the hold tool's counter was lost with Redis: next attempt is not the first
    rescuer = stack.worker("rescuer", pool="solo")

    def all_completed() -> bool:
        rows = stack.sql(
            "select count(*) from june_turns where agent = 'ops' and session = %s and status = 'completed'", session
        )
        return rows == [(5,)]

    wait_for(all_completed, timeout_s=60, every_s=0.1, what="all five turns after the restart")
    wait_for(
        lambda: [e["type"] for e in stack.structural("ops", session)].count("turn.completed") == 5,
        what="the last completion to be published",
    )
    rescuer.stop()
    for n, turn_id in enumerate(queued, start=1):
        assert stack.sql("select qty from it_orders where turn_id = %s", turn_id) == [(n,)]
    # The session's stream was rebuilt from the Postgres outbox: every structural event, once, in order.
    events = stack.structural("ops", session)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    started = [e["turn_id"] for e in events if e["type"] == "turn.started"]
    assert started == [first, *queued]
