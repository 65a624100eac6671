"""Workers whose events live on a Redis Cluster: three nodes started by the test run, never the machine's Redis.

The broker and the result backend stay on one Redis (a cluster cannot be either); the session
streams, their markers, the firehose partitions and the control channels are on the cluster
(``JUNE_REDIS_URL=redis+cluster://...``). The rules are the single-Redis ones: a turn's structural
events land once each, in order, on its session stream and on its firehose partition, whatever was
delivered twice or killed; a follower that comes back with its last id misses nothing and repeats
nothing; a cancel reaches the running worker through the cluster's pub/sub.
"""

from __future__ import annotations

import collections
import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from june_wire.redis_url import connect
from june_worker.engine.store import SessionRef
from june_worker.events import EventKeys, read_firehose

from .conftest import Stack, wait_for

pytestmark = pytest.mark.integration

RECOVERY_BOUND_S = 20.0
PARTITIONS = 16  # the default on a cluster (JUNE_FIREHOSE_PARTITIONS unset)


@pytest.fixture(scope="module")
def stack(
    fresh_db: str, redis_url: str, redis_cluster_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """This module's stack: broker and results on one Redis, events on the three-node cluster. The lease is long
    (its heartbeat re-reads a stored cancel every 20 s), so a cancel that lands at once came over pub/sub."""
    s = Stack(fresh_db, redis_url, tmp_path_factory.mktemp("cluster"), events_url=redis_cluster_url)
    s.env["JUNE_LEASE_S"] = "60"
    s.sql("create table if not exists it_orders (turn_id text not null, call_id text not null, item text, qty integer)")
    try:
        s.worker("w1", concurrency=2, queues=s.queue)
        s.worker("control", pool="solo", queues=s.control_queue)
        s.beat()
        yield s
    finally:
        s.close()


def _assert_once_in_order(stack: Stack, agent: str, session: str) -> list[dict[str, Any]]:
    events = stack.structural(agent, session)
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(1, len(seqs) + 1)), f"structural events not exactly once, in order: {seqs}"
    return events


def _firehose(stack: Stack, agent: str, session: str) -> list[int]:
    """The seqs of the session's events on its firehose partition, in stream order."""
    keys = EventKeys(prefix=stack.prefix, firehose_partitions=PARTITIONS)
    client = connect(stack.events_url)
    try:
        items = read_firehose(client, keys.partition(SessionRef(agent, session)), count=10_000, keys=keys)
    finally:
        client.close()
    return [e.event.seq or 0 for e in items if (e.agent, e.session) == (agent, session)]


def _turn_on(stack: Stack, queue: str, agent: str, session: str, text: str) -> str:
    """Send a turn to ``queue`` (a worker of the test's own consumes it)."""
    turn_id = f"t_{uuid.uuid4().hex}"
    stack.send("june.turn", {"turn_id": turn_id, "agent": agent, "session": session, "text": text}, queue=queue)
    return turn_id


def _completed(stack: Stack, agent: str, session: str, turn_id: str) -> bool:
    if (stack.turn_row(agent, session, turn_id) or {}).get("status") != "completed":
        return False
    return any(e["type"] == "turn.completed" and e["turn_id"] == turn_id for e in stack.structural(agent, session))


TURN = [
    "turn.started",
    "message.completed",
    "action.requested",
    "action.completed",
    "message.completed",
    "turn.completed",
]


def test_a_turn_runs_with_its_events_on_the_cluster_and_its_firehose_partition(stack: Stack, session_id: str) -> None:
    # Given workers whose JUNE_REDIS_URL is a three-node cluster
    # When a turn is sent
    turn_id = stack.turn("ops", session_id, "order 3 widget")
    # Then it completes, each structural event once on its session stream and once on its firehose partition
    assert stack.wait_terminal("ops", session_id, turn_id)["type"] == "turn.completed"
    assert [e["type"] for e in _assert_once_in_order(stack, "ops", session_id)] == TURN
    assert _firehose(stack, "ops", session_id) == list(range(1, len(TURN) + 1))
    assert stack.sql("select item, qty from it_orders where turn_id = %s", turn_id) == [("widget", 3)]


def test_the_firehose_partitions_spread_over_every_node_of_the_cluster(stack: Stack) -> None:
    # The partition streams have no hash tag: each name picks its own slot, so the 16 default names
    # (june:events:all:0..15, a fixed hash) land on all three nodes (redis-cli gives each a third of the slots)
    keys = EventKeys(firehose_partitions=PARTITIONS)
    client = connect(stack.events_url)
    try:
        nodes = collections.Counter(client.get_node_from_key(s).name for s in keys.firehose_streams())
        slots = {client.keyslot(s) for s in keys.firehose_streams()}
        # and each partition's markers share its stream's slot (the append script touches them together)
        for p in range(PARTITIONS):
            stream_slot = client.keyslot(keys.firehose_stream(p))
            assert client.keyslot(keys.firehose_marker(p)) == stream_slot == client.keyslot(keys.firehose_seen(p))
    finally:
        client.close()
    assert len(slots) == PARTITIONS
    assert len(nodes) == 3, nodes


def test_the_same_message_delivered_twice_gives_one_turn_and_each_event_once(stack: Stack, session_id: str) -> None:
    payload = {"turn_id": f"t_dup_{session_id}", "agent": "ops", "session": session_id, "text": "order 1 gadget"}
    first, second = stack.send("june.turn", payload), stack.send("june.turn", payload)
    stack.outcome(first)
    stack.outcome(second)
    wait_for(lambda: _completed(stack, "ops", session_id, payload["turn_id"]), what="the turn to complete")
    assert stack.sql("select count(*) from it_orders where turn_id = %s", payload["turn_id"]) == [(1,)]
    assert [e["type"] for e in _assert_once_in_order(stack, "ops", session_id)] == TURN
    assert _firehose(stack, "ops", session_id) == list(range(1, len(TURN) + 1))


def test_sigkill_mid_tool_step_another_worker_finishes_and_each_event_is_on_the_cluster_once(stack: Stack) -> None:
    session, key = f"cl-kill-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    # Given a turn whose async tool blocks on a worker that then dies (its whole process group); the turn is sent
    # to a queue only that worker consumes (the sweeper re-sends it to the turn queue, where w1 takes it)
    doomed_queue = f"{stack.queue}.doomed-{key[:4]}"
    doomed = stack.worker(f"doomed-{key[:4]}", queues=doomed_queue)
    turn_id = _turn_on(stack, doomed_queue, "ops", session, f"slow {key}")
    wait_for(lambda: stack.redis.llen(f"it:hold:{key}:log") == 1, what="the tool to start on the doomed worker")
    doomed.kill()
    # When the sweeper re-sends it to the other worker
    wait_for(lambda: _completed(stack, "ops", session, turn_id), timeout_s=RECOVERY_BOUND_S, what="recovery")
    # Then the turn completed once, and its events are on the cluster once each, in order
    events = _assert_once_in_order(stack, "ops", session)
    assert [e["type"] for e in events].count("turn.completed") == 1
    assert _firehose(stack, "ops", session) == [e["seq"] for e in events]


@pytest.mark.parametrize("crash_at", ["before-publish@tool:1:c1", "after-tool-commit@tool:1:c1"])
def test_a_worker_killed_between_commit_and_publish_leaves_the_relay_to_fill_the_cluster_stream(
    stack: Stack, crash_at: str
) -> None:
    session = f"cl-crash-{crash_at.split('@')[0]}-{uuid.uuid4().hex[:6]}"
    # a solo worker on a queue of its own: the crash hook's SIGKILL takes the whole worker down
    doomed_queue = f"{stack.queue}.{session}"
    doomed = stack.worker(f"doomed-{session[-6:]}", pool="solo", queues=doomed_queue, env={"JUNE_CRASH_AT": crash_at})
    turn_id = _turn_on(stack, doomed_queue, "ops", session, "order 2 bolt")
    wait_for(lambda: doomed.popen.poll() is not None, what="the worker to kill itself at the crash point")
    doomed.kill()
    wait_for(lambda: _completed(stack, "ops", session, turn_id), timeout_s=RECOVERY_BOUND_S, what="recovery")
    assert stack.sql("select count(*) from it_orders where turn_id = %s", turn_id) == [(1,)]
    assert [e["type"] for e in _assert_once_in_order(stack, "ops", session)] == TURN
    assert _firehose(stack, "ops", session) == list(range(1, len(TURN) + 1))


def test_a_follower_that_reconnects_with_its_last_id_misses_nothing_and_repeats_nothing(stack: Stack) -> None:
    session = f"cl-follow-{uuid.uuid4().hex[:6]}"
    producer = stack.producer()
    try:
        # Given a follower on the cluster that reads the first events of a streaming turn, then goes away
        turn_id = stack.turn("dribble", session, "talk")
        first: list[Any] = []
        with contextlib.closing(producer.follow("dribble", session, turn_id=turn_id, timeout_s=30)) as events:
            for event in events:
                first.append(event)
                if len(first) == 40:
                    break
        # When it follows again from the last stream id it handled
        rest = list(producer.follow("dribble", session, turn_id=turn_id, last_id=first[-1].stream_id, timeout_s=30))
    finally:
        producer.close()
    # Then the two reads together are the stream: every entry once, in order, ending on the turn's end
    seen = [e.stream_id for e in first + rest]
    assert seen == [e["id"] for e in stack.events("dribble", session)]
    assert rest[-1].type == "turn.completed"
    assert len(first) == 40 and rest[0].stream_id > first[-1].stream_id


def test_a_cancel_reaches_the_running_worker_over_the_clusters_pub_sub(stack: Stack, session_id: str) -> None:
    # Given a turn streaming thousands of deltas (2 ms apart) on the turn worker
    turn_id = stack.turn("dribble", session_id, "talk")
    wait_for(lambda: any(e["type"] == "message.delta" for e in stack.events("dribble", session_id)), what="deltas")
    # When a cancel is sent (the control worker records it and publishes it on the session's control channel)
    out = stack.send("june.cancel", {"agent": "dribble", "session": session_id, "turn_id": turn_id}).get(timeout=30)
    assert out["status"] == "cancel-requested"
    # Then the turn stops mid-stream: the signal arrived (the heartbeat's look at the store comes every 20 s,
    # after the stream would have ended; without a signal the turn would stream all 2000 deltas first)
    end = stack.wait_terminal("dribble", session_id, turn_id)
    assert (end["type"], end["reason"]) == ("turn.cancelled", "requested")
    deltas = [e for e in stack.events("dribble", session_id) if e["type"] == "message.delta"]
    assert len(deltas) < 2000


def test_the_gateways_sse_on_the_cluster_resumed_with_last_event_id_misses_nothing_and_repeats_nothing(
    stack: Stack, session_id: str
) -> None:
    from june_worker.gateway import Principal, TokenTable, create_app
    from tests.gateway.conftest import settings_for
    from tests.gateway.kit import ServedApp, read_events

    # Given the gateway reading events from the cluster (JUNE_REDIS_URL), the broker and results on one Redis
    token = f"op-token-{uuid.uuid4().hex}"
    table = TokenTable.of({token: Principal("op-alice", frozenset({"ops", "dribble"}))})
    served = ServedApp(create_app(settings_for(stack, table, agents=("ops", "dribble"), redis_url=stack.events_url)))
    headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
    path = f"/v1/agents/dribble/sessions/{session_id}"
    got: list[tuple[str, str]] = []
    try:
        with httpx.Client(base_url=served.url, timeout=httpx.Timeout(60, connect=5)) as http:
            # When a streamed turn is cut mid-stream and followed again with Last-Event-ID
            with http.stream("POST", f"{path}/turns", json={"text": "go"}, headers=headers) as r:
                assert r.status_code == 200, r.read()
                turn_id = r.headers["x-turn-id"]
                for message in read_events(r):
                    got.append((str(message.id), message.event))
                    if len(got) == 40:
                        break
            resume = {**headers, "Last-Event-ID": got[-1][0]}
            with http.stream("GET", f"{path}/turns/{turn_id}/events", headers=resume) as r:
                got.extend((str(m.id), m.event) for m in read_events(r, until_terminal=turn_id))
    finally:
        served.stop()
    # Then the two responses together are the turn's entries on the cluster: every one once, in order
    assert got[-1][1] == "turn.completed"
    assert got == [(e["id"], e["type"]) for e in stack.events("dribble", session_id) if e["turn_id"] == turn_id]


def test_the_consoles_live_feed_on_the_cluster_shows_sessions_whose_partitions_are_on_different_nodes(
    stack: Stack,
) -> None:
    from june_worker.gateway import Principal, TokenTable, create_app
    from june_worker.gateway.client import parse_sse
    from tests.gateway.conftest import settings_for
    from tests.gateway.kit import ServedApp

    # Given sessions whose firehose partitions live on each of the cluster's three nodes
    keys = EventKeys(prefix=stack.prefix, firehose_partitions=PARTITIONS)
    client = connect(stack.events_url)
    by_node: dict[str, str] = {}
    try:
        while len(by_node) < 3:
            session = f"cl-feed-{uuid.uuid4().hex[:8]}"
            stream = keys.firehose_stream(keys.partition(SessionRef("ops", session)))
            by_node.setdefault(client.get_node_from_key(stream).name, session)
    finally:
        client.close()
    # and an operator's console feed on a gateway whose JUNE_REDIS_URL is the cluster (partitions left to the default)
    token = f"op-token-{uuid.uuid4().hex}"
    table = TokenTable.of({token: Principal("op-carol", None, operator=True)})
    served = ServedApp(create_app(settings_for(stack, table, agents=("ops",), redis_url=stack.events_url)))
    headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
    ended: dict[str, str] = {}
    try:
        with httpx.Client(base_url=served.url, timeout=httpx.Timeout(60, connect=5)) as http:
            with http.stream("GET", "/v1/console/events", headers=headers) as feed:
                assert feed.status_code == 200
                lines = feed.iter_lines()
                for line in lines:  # read up to the feed's start: what happens after it is sent
                    if line == ": connected":
                        break
                # When each of them runs a turn
                turns = {stack.turn("ops", session, "order 1 nut"): session for session in by_node.values()}
                # Then the feed tells each turn's end, whichever node its partition is on
                for message in parse_sse(lines):
                    change = message.json()
                    if change["type"] == "turn.completed" and change["turn_id"] in turns:
                        ended[change["turn_id"]] = change["session"]
                        if len(ended) == len(turns):
                            break
    finally:
        served.stop()
    assert ended == turns
