"""The reader API (``june_worker.events.reader``) against a real Redis: deltas of a dead attempt are
dropped, and a follower whose position was trimmed away (or who meets a jump in ``seq``) is told.

Every test writes under its own key prefix and deletes it afterwards: the Redis is shared.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from june_worker.engine.events import MessageDelta, TurnEvent
from june_worker.engine.store import SessionRef
from june_worker.events import EventKeys, RedisStreamSink, afollow, follow

from .test_redis_events import turn_events

pytestmark = pytest.mark.integration


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def keys(client: redis.Redis) -> Iterator[EventKeys]:
    k = EventKeys(prefix=f"june-test-{uuid.uuid4().hex[:10]}")
    yield k
    stale = list(client.scan_iter(match=f"{k.prefix}:*", count=1000))
    if stale:
        client.delete(*stale)


@pytest.fixture
def ref(session_id: str) -> SessionRef:
    return SessionRef("ops", session_id)


def delta(text: str, attempt: int, step: str = "model:1") -> TurnEvent:
    return MessageDelta(turn_id="t1", step=step, text=text, attempt=attempt)


# --- deltas carry their attempt ------------------------------------------------------------------------


def publish_retried_step(client: redis.Redis, keys: EventKeys, ref: SessionRef) -> None:
    """turn.started; model:1 typed by attempt 1, then by attempt 2, then a late delta of attempt 1; the end."""
    sink = RedisStreamSink(client, keys=keys, firehose=False)
    start, done, end = turn_events("t1", 1, ["fresh"])
    sink.publish(ref, [start])
    for d in (delta("stale ", 1), delta("fresh", 2), delta("zombie", 1), delta("next", 1, step="model:2")):
        sink.publish_delta(ref, d)
    sink.publish(ref, [done, end])


def test_follow_drops_deltas_of_an_older_attempt_of_the_same_step(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    publish_retried_step(client, keys, ref)

    got = list(follow(client, ref.agent, ref.session, turn_id="t1", keys=keys, timeout_s=0))

    texts = [(e.event.text, e.event.attempt) for e in got if isinstance(e.event, MessageDelta)]
    assert texts == [("stale ", 1), ("fresh", 2), ("next", 1)]  # another step's attempts are its own


async def test_afollow_drops_deltas_of_an_older_attempt_of_the_same_step(
    client: redis.Redis, redis_url: str, keys: EventKeys, ref: SessionRef
) -> None:
    publish_retried_step(client, keys, ref)
    reader = aioredis.Redis.from_url(redis_url)
    try:
        got = [e async for e in afollow(reader, ref.agent, ref.session, turn_id="t1", keys=keys, timeout_s=0)]
    finally:
        await reader.aclose()

    assert [e.event.text for e in got if isinstance(e.event, MessageDelta)] == ["stale ", "fresh", "next"]
