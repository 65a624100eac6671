"""Redis loses everything (a restart without persistence); Postgres remembers, the sweeper recovers.

These tests run their own Redis (broker, results and streams), never the shared one, and restart it
while a session has one turn running and four queued, or after a session's turns finished: then no turn
will publish to that session again, and its stream is rebuilt by the sweeper alone.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from june_wire.redis_url import connect
from june_worker.errors import StreamGapError
from june_worker.events import EventKeys
from june_worker.events.reader import follow
from producers.errors import StreamGapError as ProducerGapError
from tests import _services
from tests._services import RedisClusterServer, RedisServer

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


# --- a finished session's stream after Redis lost its data (issue 24, item 3) ----------------------------

WAIT_S = 30.0  # how long a follower waits for the stream before it gives up (the sweep period is 0.5 s)


def _finished(stack: Stack, session: str) -> tuple[str, list[str]]:
    """A turn of ``session`` that finished, with its relay mark up to its outbox (no relay is owed): the turn's id
    and the types of its structural events as they were on the stream."""
    turn_id = stack.turn("ops", session, "order 2 bolt")
    assert stack.wait_terminal("ops", session, turn_id)["type"] == "turn.completed"
    expected = [e["type"] for e in stack.structural("ops", session) if e["turn_id"] == turn_id]

    def marked() -> bool:  # the holder's heartbeat (or the sweeper) moved the mark
        rows = stack.sql("select relayed_seq, event_seq from june_sessions where session = %s", session)
        return bool(rows) and rows[0][0] == rows[0][1] == len(expected)

    wait_for(marked, what="the relay mark to reach the outbox")
    return turn_id, expected


def _lose_everything(stack: Stack, server: RedisServer, session: str) -> None:
    """Redis restarts without persistence (the sentinel says it came back empty)."""
    stack.redis.set("it:sentinel", 1)
    server.restart()
    assert stack.redis.exists("it:sentinel") == 0
    assert stack.redis.exists(stack.stream_key("ops", session)) == 0


def _producer_follow(stack: Stack, session: str, turn_id: str) -> list[str]:
    producer = stack.producer()
    try:
        return [
            e.type for e in producer.follow("ops", session, turn_id=turn_id, include_deltas=False, timeout_s=WAIT_S)
        ]
    finally:
        producer.close()


def _reader_follow(stack: Stack, session: str, turn_id: str) -> list[str]:
    client = connect(stack.events_url)
    try:
        events = follow(
            client, "ops", session, turn_id=turn_id, include_deltas=False, timeout_s=WAIT_S,
            keys=EventKeys(prefix=stack.prefix),
        )  # fmt: skip
        return [e.event.type for e in events]
    finally:
        client.close()


def _sse_follow(stack: Stack, session: str, turn_id: str) -> list[str]:
    """The SSE event names (deltas left out) of the gateway's follow of the turn, from the start."""
    from june_worker.gateway import Principal, TokenTable, create_app
    from tests.gateway.conftest import settings_for
    from tests.gateway.kit import ServedApp, read_events

    token = f"op-token-{uuid.uuid4().hex}"
    table = TokenTable.of({token: Principal("op-dana", None, operator=True)})
    served = ServedApp(
        create_app(settings_for(stack, table, agents=("ops",), max_stream_s=WAIT_S, redis_url=stack.events_url))
    )
    headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
    try:
        with httpx.Client(base_url=served.url, timeout=httpx.Timeout(WAIT_S + 30, connect=5)) as http:
            path = f"/v1/agents/ops/sessions/{session}/turns/{turn_id}/events"
            with http.stream("GET", path, headers=headers) as r:
                assert r.status_code == 200, r.read()
                return [m.event for m in read_events(r, until_terminal=turn_id) if not m.event.endswith(".delta")]
    finally:
        served.stop()


def _told(read: Any, stack: Stack, session: str, turn_id: str) -> tuple[int | None, int | None]:
    """(first missing seq, next seq) of the gap a follow raises."""
    try:
        read(stack, session, turn_id)
    except (StreamGapError, ProducerGapError) as gap:
        return gap.first_missing_seq, gap.next_seq
    raise AssertionError("the follow ended without telling a gap")


def test_followers_of_a_turn_that_finished_before_redis_lost_its_data_get_all_its_events(
    lossy: tuple[Stack, RedisServer],
) -> None:
    stack, server = lossy
    stack.worker("w1", pool="solo")
    stack.beat()
    session = f"lost-{uuid.uuid4().hex[:6]}"
    # Given a turn that finished and was relayed, and then Redis restarted without persistence
    turn_id, expected = _finished(stack, session)
    _lose_everything(stack, server, session)
    # When three kinds of follower follow that turn from the start: the producers', the workers' reader, the SSE
    with ThreadPoolExecutor(3) as pool:
        followers = [
            pool.submit(read, stack, session, turn_id) for read in (_producer_follow, _reader_follow, _sse_follow)
        ]
        got = [f.result() for f in followers]
    # Then each gets every structural event of the turn, up to its end: the sweeper rebuilt the stream, each once
    assert got == [expected, expected, expected]
    assert [e["seq"] for e in stack.structural("ops", session)] == list(range(1, len(expected) + 1))


def test_followers_of_a_finished_turn_whose_outbox_was_pruned_are_told_the_gap_after_redis_lost_its_data(
    lossy: tuple[Stack, RedisServer],
) -> None:
    stack, server = lossy
    stack.worker("w1", pool="solo")
    stack.beat()
    session = f"pruned-{uuid.uuid4().hex[:6]}"
    # Given a finished turn whose two first events the outbox no longer holds (retention pruned them)
    turn_id, expected = _finished(stack, session)
    stack.sql("delete from june_events where session = %s and seq <= 2", session)
    # and Redis restarted without persistence
    _lose_everything(stack, server, session)
    # When followers of that turn follow it from the start
    with ThreadPoolExecutor(3) as pool:
        readers = [pool.submit(_told, read, stack, session, turn_id) for read in (_producer_follow, _reader_follow)]
        sse = pool.submit(_sse_follow, stack, session, turn_id)
        told = [f.result() for f in readers]
        sent = sse.result()
    # Then each is told that seq 1-2 are missing (never left waiting, never silently past them), and the SSE
    # goes on with the rest of the turn
    assert told == [(1, 3), (1, 3)]
    assert sent == ["stream.gap", *expected[2:]]


@pytest.fixture
def lossy_cluster(fresh_db: str, redis_url: str, tmp_path: Path) -> Iterator[tuple[Stack, RedisClusterServer]]:
    """Events on a three-node cluster of this test's own (a node is restarted), broker and results on one Redis."""
    with _services.private_redis_cluster() as cluster:
        s = Stack(fresh_db, redis_url, tmp_path, events_url=cluster.url)
        s.sql(
            "create table if not exists it_orders (turn_id text not null, call_id text not null, item text, qty integer)"
        )
        try:
            yield s, cluster
        finally:
            s.close()


def test_followers_of_a_finished_turn_get_all_its_events_after_the_cluster_node_of_its_session_lost_its_data(
    lossy_cluster: tuple[Stack, RedisClusterServer],
) -> None:
    stack, cluster = lossy_cluster
    stack.worker("w1", pool="solo")
    stack.beat()
    node = cluster.nodes[1]
    session = next(
        s
        for s in (f"lost-{uuid.uuid4().hex[:8]}" for _ in range(1000))
        if stack.redis.get_node_from_key(stack.stream_key("ops", s)).port == node.port
    )
    # Given a finished turn whose session's keys live on one node of the cluster
    turn_id, expected = _finished(stack, session)
    # and that node restarted without persistence (the other two kept their data)
    sentinel = f"it:sentinel:{{ops:{session}}}"  # the session's hash tag: on that node
    stack.redis.set(sentinel, 1)
    node.restart()
    wait_for(lambda: _answers(stack, sentinel), what="the restarted node to answer")
    assert stack.redis.exists(sentinel) == 0
    # When followers follow that turn from the start
    with ThreadPoolExecutor(3) as pool:
        followers = [
            pool.submit(read, stack, session, turn_id) for read in (_producer_follow, _reader_follow, _sse_follow)
        ]
        got = [f.result() for f in followers]
    # Then each gets every structural event of the turn, up to its end, each once
    assert got == [expected, expected, expected]
    assert [e["seq"] for e in stack.structural("ops", session)] == list(range(1, len(expected) + 1))


def _answers(stack: Stack, key: str) -> bool:
    try:
        stack.redis.exists(key)
    except Exception:  # the node is still starting, or the client's slot map is being learnt again
        return False
    return True
