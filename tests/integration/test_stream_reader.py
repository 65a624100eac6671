"""The reader API (``june_worker.events.reader``) against a real Redis: deltas of a dead attempt are
dropped, and a follower whose position was trimmed away (or who meets a jump in ``seq``) is told.

Every test writes under its own key prefix and deletes it afterwards: the Redis is shared.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from june_wire.redis_url import aconnect, connect
from june_worker.engine.events import MessageDelta, TurnEvent
from june_worker.engine.store import Commit, SessionRef
from june_worker.errors import StreamGapError
from june_worker.events import EventKeys, RedisStreamSink, Trim, afollow, follow
from june_worker.events.redis_stream import encode_event
from june_worker.stores import MemoryStore

from .conftest import wait_for
from .test_redis_events import turn_events

pytestmark = pytest.mark.integration


@pytest.fixture
def client(events_url: str) -> Iterator[Any]:
    c = connect(events_url)
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
    client: redis.Redis, events_url: str, keys: EventKeys, ref: SessionRef
) -> None:
    publish_retried_step(client, keys, ref)
    reader = aconnect(events_url)
    try:
        got = [e async for e in afollow(reader, ref.agent, ref.session, turn_id="t1", keys=keys, timeout_s=0)]
    finally:
        await reader.aclose()

    assert [e.event.text for e in got if isinstance(e.event, MessageDelta)] == ["stale ", "fresh", "next"]


# --- gaps are told -------------------------------------------------------------------------------------


def six_events_trimmed_to_the_last_three(client: redis.Redis, keys: EventKeys, ref: SessionRef) -> list[str]:
    """seq 1-6 published; the stream then holds seq 4-6 only. Returns the stream ids seq 1 and 2 had."""
    events = turn_events("t1", 1, ["a", "b", "c", "d"])
    RedisStreamSink(client, keys=keys, firehose=False).publish(ref, events[:2])
    ids = [i.decode() for i, _ in client.xrange(keys.session_stream(ref))]
    trimming = RedisStreamSink(client, keys=keys, firehose=False, session_trim=Trim(maxlen=3, exact=True))
    trimming.publish(ref, events[2:])
    assert len(ids) == 2 and client.xlen(keys.session_stream(ref)) == 3
    return ids


def test_a_follower_whose_position_was_trimmed_away_is_told_the_first_missing_seq_and_can_reload(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    # Given a follower that got seq 1 and then was away while the stream was trimmed to seq 4-6
    seen_id = six_events_trimmed_to_the_last_three(client, keys, ref)[0]
    store = MemoryStore()
    store.commit(ref, Commit(events=turn_events("t1", 1, ["a", "b", "c", "d"])))
    # When it follows again from the last id it got, saying it holds seq 1
    with pytest.raises(StreamGapError) as raised:
        list(follow(client, ref.agent, ref.session, keys=keys, last_id=seen_id, last_seq=1, timeout_s=0))
    # Then it is told: seq 2-3 are missing, the stream goes on at seq 4, and how to reload
    gap = raised.value
    assert (gap.first_missing_seq, gap.next_seq, gap.after_id) == (2, 4, seen_id)
    assert "events seq 2-3 are missing" in str(gap) and "after_seq=1" in str(gap) and gap.resume_id in str(gap)
    # And reloading from the store, then following from resume_id, gives every event once, in order
    reloaded = [e.seq for e in store.events(ref, after_seq=1) if (e.seq or 0) < (gap.next_seq or 0)]
    rest = follow(client, ref.agent, ref.session, keys=keys, last_id=gap.resume_id, last_seq=3, timeout_s=0)
    assert [1, *reloaded, *(e.event.seq for e in rest)] == [1, 2, 3, 4, 5, 6]


def test_a_trimmed_position_without_last_seq_is_told_with_where_the_stream_goes_on(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    seen_id = six_events_trimmed_to_the_last_three(client, keys, ref)[0]

    with pytest.raises(StreamGapError, match=r"no longer holds .* before seq 4") as raised:
        next(follow(client, ref.agent, ref.session, keys=keys, last_id=seen_id, timeout_s=0))

    assert (raised.value.first_missing_seq, raised.value.next_seq) == (None, 4)


def test_following_from_the_start_of_a_trimmed_stream_is_told_that_seq_1_is_missing(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    six_events_trimmed_to_the_last_three(client, keys, ref)

    with pytest.raises(StreamGapError) as raised:
        next(follow(client, ref.agent, ref.session, keys=keys, timeout_s=0))

    assert (raised.value.first_missing_seq, raised.value.next_seq) == (1, 4)


def test_a_seq_jump_between_two_entries_is_told_after_the_events_before_it(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    # Given a stream holding seq 1, 2 and then 5 (rebuilt from a store that lost 3 and 4)
    events = turn_events("t1", 1, ["a", "b", "c"])
    stream = keys.session_stream(ref)
    for e in (events[0], events[1], events[4]):
        client.xadd(stream, {"type": e.type, "data": encode_event(ref, e)})
    got: list[int | None] = []
    # When a follower reads it from the start, Then it gets seq 1 and 2, then the gap: 3-4 missing
    with pytest.raises(StreamGapError) as raised:
        for item in follow(client, ref.agent, ref.session, keys=keys, timeout_s=0):
            got.append(item.event.seq)
    assert got == [1, 2]
    assert (raised.value.first_missing_seq, raised.value.next_seq) == (3, 5)
    assert "seq 5 follows seq 2" in str(raised.value)
    # And following on from resume_id, having reloaded 3 and 4, continues with seq 5
    rest = follow(client, ref.agent, ref.session, keys=keys, last_id=raised.value.resume_id, last_seq=4, timeout_s=0)
    assert [e.event.seq for e in rest] == [5]


def test_a_trim_that_took_only_deltas_after_the_position_is_not_a_gap(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    # Given seq 1, then deltas the stream later trimmed, then seq 2 (the follower had seq 1)
    sink = RedisStreamSink(client, keys=keys, firehose=False, session_trim=Trim(maxlen=2, exact=True))
    start, done, end = turn_events("t1", 1, ["ab"])
    sink.publish(ref, [start])
    seen_id = client.xrange(keys.session_stream(ref))[0][0].decode()
    sink.publish_delta(ref, delta("a", 1))
    sink.publish_delta(ref, delta("b", 1))
    sink.publish(ref, [done, end])

    got = follow(client, ref.agent, ref.session, keys=keys, last_id=seen_id, last_seq=1, timeout_s=0)

    assert [e.event.seq for e in got] == [2, 3]


def test_following_from_an_id_the_stream_still_holds_is_not_a_gap_though_older_entries_were_trimmed(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    six_events_trimmed_to_the_last_three(client, keys, ref)
    held = client.xrange(keys.session_stream(ref))[0][0].decode()  # seq 4

    got = follow(client, ref.agent, ref.session, keys=keys, last_id=held, timeout_s=0)

    assert [e.event.seq for e in got] == [5, 6]


async def test_afollow_tells_a_trimmed_position_too(
    client: redis.Redis, events_url: str, keys: EventKeys, ref: SessionRef
) -> None:
    seen_id = six_events_trimmed_to_the_last_three(client, keys, ref)[0]
    reader = aconnect(events_url, decode_responses=True)
    try:
        with pytest.raises(StreamGapError) as raised:
            async for _ in afollow(reader, ref.agent, ref.session, keys=keys, last_id=seen_id, last_seq=1, timeout_s=0):
                pass
    finally:
        await reader.aclose()

    assert (raised.value.first_missing_seq, raised.value.next_seq) == (2, 4)


# --- a position from an earlier copy of the stream -------------------------------------------------------


class PrunedOutbox:
    """A store's event log that pruned its oldest events: what a stream is rebuilt from after its keys expired."""

    def __init__(self, events: list[TurnEvent]) -> None:
        self._events = events

    def events(self, ref: SessionRef, *, turn_id: str | None = None, after_seq: int = 0) -> list[TurnEvent]:
        return [e for e in self._events if (e.seq or 0) > after_seq]


def after_clock(entry_id: str) -> None:
    """Wait until the clock is past ``entry_id``'s millisecond: a copy made later has newer ids, as it would."""
    ms = int(entry_id.split("-")[0])
    wait_for(lambda: time.time() * 1000 > ms + 1, timeout_s=5, what=f"the clock to pass {entry_id}")


def seen_then_expired(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> tuple[list[TurnEvent], RedisStreamSink, str]:
    """A turn's six events, of which seq 1-2 were published and followed, then the session's keys gone (expired).
    Returns the events, the sink, and the stream id the follower last got (seq 2, of the copy now gone)."""
    events = turn_events("t1", 1, ["a", "b", "c", "d"])
    sink = RedisStreamSink(client, keys=keys, firehose=False)
    sink.publish(ref, events[:2])
    seen = client.xrange(keys.session_stream(ref))[-1][0].decode()
    client.delete(keys.session_stream(ref), keys.session_marker(ref))
    after_clock(seen)
    return events, sink, seen


def seen_then_rebuilt(client: redis.Redis, keys: EventKeys, ref: SessionRef, kept_from: int) -> str:
    """:func:`seen_then_expired`, and the stream rebuilt from an outbox that kept seq ``kept_from``-6 only. Returns
    the stream id the follower last got (seq 2, of the old copy)."""
    events, sink, seen = seen_then_expired(client, keys, ref)
    assert sink.relay(PrunedOutbox(events[kept_from - 1 :]), ref) == 7 - kept_from
    info = client.xinfo_stream(keys.session_stream(ref))
    assert info["entries-added"] == info["length"]  # the rebuilt copy lost nothing by its own count
    return seen


def test_a_position_from_an_earlier_copy_of_the_stream_is_told_with_the_first_seq_the_copy_holds(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    # Given a follower that got seq 1-2, and the stream since rebuilt from an outbox pruned to seq 4-6
    seen = seen_then_rebuilt(client, keys, ref, kept_from=4)
    # When it follows again from the id it got, not saying which seq it holds
    with pytest.raises(StreamGapError, match=r"no longer holds .* before seq 4") as raised:
        next(follow(client, ref.agent, ref.session, keys=keys, last_id=seen, timeout_s=0))
    # Then it is told, before any event: the stream goes on at seq 4
    gap = raised.value
    assert (gap.first_missing_seq, gap.next_seq, gap.after_id) == (None, 4, seen)
    # And following on from resume_id (having reloaded up to seq 3) gives the rest, once
    rest = follow(client, ref.agent, ref.session, keys=keys, last_id=gap.resume_id, last_seq=3, timeout_s=0)
    assert [e.event.seq for e in rest] == [4, 5, 6]


def test_a_position_from_an_earlier_copy_of_a_stream_rebuilt_from_seq_1_is_no_gap(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    seen = seen_then_rebuilt(client, keys, ref, kept_from=1)

    got = follow(client, ref.agent, ref.session, keys=keys, last_id=seen, timeout_s=0)

    assert [e.event.seq for e in got] == [1, 2, 3, 4, 5, 6]  # nothing can be missing: again from the first


async def test_afollow_tells_a_position_from_an_earlier_copy_of_the_stream(
    client: redis.Redis, events_url: str, keys: EventKeys, ref: SessionRef
) -> None:
    seen = seen_then_rebuilt(client, keys, ref, kept_from=4)
    reader = aconnect(events_url, decode_responses=True)
    try:
        with pytest.raises(StreamGapError) as raised:
            async for _ in afollow(reader, ref.agent, ref.session, keys=keys, last_id=seen, timeout_s=0):
                pass
    finally:
        await reader.aclose()

    assert (raised.value.first_missing_seq, raised.value.next_seq) == (None, 4)


def test_a_position_on_a_stream_that_is_gone_is_told_at_the_first_event_of_its_rebuilt_copy(
    redis_url: str, ref: SessionRef
) -> None:
    # Given a follower that got seq 1-2, and the session's keys since gone (expired)
    client, keys = connect(redis_url), EventKeys(prefix=f"june-test-{uuid.uuid4().hex[:10]}")
    name = f"gap-follower-{uuid.uuid4().hex[:8]}"
    reader = connect(redis_url, client_name=name)
    events, sink, seen = seen_then_expired(client, keys, ref)
    told: list[StreamGapError] = []
    got: list[int | None] = []

    def read() -> None:
        try:
            for item in follow(reader, ref.agent, ref.session, keys=keys, last_id=seen, block_ms=200, timeout_s=30):
                got.append(item.event.seq)
        except StreamGapError as exc:
            told.append(exc)

    def blocked() -> bool:
        return any(c.get("name") == name and "b" in c.get("flags", "") for c in client.client_list())

    try:
        # When it follows from that id while there is no stream, and the stream is then rebuilt from an outbox
        # pruned to seq 4-6
        follower = threading.Thread(target=read, daemon=True)
        follower.start()
        wait_for(blocked, timeout_s=10, what="the follower to wait in XREAD on the missing stream")
        sink.relay(PrunedOutbox(events[3:]), ref)
        follower.join(timeout=30)
        # Then it is told of the gap before seq 4, and got nothing after it
        assert not follower.is_alive() and got == []
        assert len(told) == 1
        assert (told[0].first_missing_seq, told[0].next_seq, told[0].after_id) == (None, 4, seen)
    finally:
        client.delete(keys.session_stream(ref), keys.session_marker(ref))
        reader.close()
        client.close()
