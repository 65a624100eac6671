"""The Redis Streams side of the events, against a real Redis: exactly-once per stream, order,
relay after a crash, deltas, follow (catch-up then live), the firehose and its consumer groups,
trimming, and a sink that survives Redis being gone.

Every test writes under its own key prefix and deletes it afterwards: the Redis is shared.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from june_wire.redis_url import aconnect, connect, is_cluster
from june_worker import Agent, Runtime, tool
from june_worker.engine.crash import CrashAt
from june_worker.engine.events import (
    MessageCompleted,
    MessageDelta,
    ReasoningDelta,
    TurnCompleted,
    TurnEvent,
    TurnStarted,
    is_structural,
)
from june_worker.engine.signals import CrashInjected
from june_worker.engine.store import Commit, SessionRef
from june_worker.engine.types import ProactiveTrigger
from june_worker.events import (
    EventKeys,
    RedisStreamSink,
    StreamEvent,
    Trim,
    ack,
    afollow,
    claim_stale,
    ensure_group,
    follow,
    read_firehose,
    read_group,
)
from june_worker.events.reader import decode_entry
from june_worker.events.redis_stream import encode_event
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import MemoryStore
from tests._services import closed_port

pytestmark = pytest.mark.integration

WAIT_S = 10.0


# --- fixtures and helpers ---------------------------------------------------------------------------


@pytest.fixture
def client(events_url: str) -> Iterator[Any]:
    c = connect(events_url)
    yield c
    c.close()


def node_clients(client: Any) -> list[Any]:
    """A client of each node: the client itself on one Redis, each primary's on a cluster."""
    return [n.redis_connection for n in client.get_primaries()] if is_cluster(client) else [client]


def kill_sink_connection(client: Any, sink: RedisStreamSink, key: str) -> None:
    """Make Redis drop the pipelined sink's connection to the node of ``key`` (CLIENT KILL on that node)."""
    conn = sink._wire.connection_of(key)
    assert conn is not None, f"the sink has no connection to the node of {key}"
    host, port = conn._sock.getsockname()[:2]
    node = client.get_node_from_key(key).redis_connection if is_cluster(client) else client
    assert node.client_kill(f"{host}:{port}")


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


def turn_events(turn_id: str, first_seq: int, texts: list[str]) -> list[TurnEvent]:
    """turn.started, one message.completed per text, turn.completed: seqs from ``first_seq`` on."""
    events: list[TurnEvent] = [TurnStarted(turn_id=turn_id, trigger=ProactiveTrigger(by="test"))]
    events += [MessageCompleted(turn_id=turn_id, step=f"model:{i + 1}", text=t) for i, t in enumerate(texts)]
    events.append(TurnCompleted(turn_id=turn_id, text=texts[-1] if texts else ""))
    return [e.model_copy(update={"seq": first_seq + i}) for i, e in enumerate(events)]


def entries(client: redis.Redis, stream: str) -> list[StreamEvent]:
    out = []
    rows: Any = client.xrange(stream)
    for entry_id, fields in rows:
        item = decode_entry(stream, entry_id.decode(), fields)
        assert item is not None, f"entry {entry_id!r} of {stream} does not decode"
        out.append(item)
    return out


def structural(client: redis.Redis, stream: str) -> list[tuple[int | None, str]]:
    return [(e.event.seq, e.event.type) for e in entries(client, stream) if is_structural(e.event)]


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        pause.wait(0.002)


def blocked(client: Any, name: str) -> Callable[[], bool]:
    """True once the connection named ``name`` is blocked in a command (XREAD BLOCK), on any node."""
    return lambda: any(
        c.get("name") == name and "b" in c.get("flags", "") for node in node_clients(client) for c in node.client_list()
    )


def lookup_agent() -> Agent:
    @tool
    def lookup(q: str) -> dict[str, str]:
        """Look something up."""
        return {"q": q, "found": "yes"}

    script = [Reply("Looking it up.", calls=[{"id": "c1", "name": "lookup", "input": {"q": "x"}}]), Reply("Found it.")]
    return Agent(name="ops", model=ScriptedModel(script), tools=[lookup])


# --- keys ----------------------------------------------------------------------------------------------


def test_key_names_match_the_wire_and_each_marker_shares_its_streams_slot() -> None:
    keys = EventKeys(firehose_partitions=8)
    ref = SessionRef("ops", "s1")
    assert keys.session_stream(ref) == "june:events:{ops:s1}"
    assert keys.control_channel(ref) == "june:control:{ops:s1}"
    assert key_slot(keys.session_marker(ref).encode()) == key_slot(keys.session_stream(ref).encode())
    assert key_slot(keys.control_channel(ref).encode()) == key_slot(keys.session_stream(ref).encode())
    for p in range(8):
        assert keys.firehose_stream(p) == f"june:events:all:{p}"
        assert key_slot(keys.firehose_marker(p).encode()) == key_slot(keys.firehose_stream(p).encode())
    # a stable hash: the same partition in every process, whatever PYTHONHASHSEED says
    assert keys.partition(ref) == EventKeys(firehose_partitions=8).partition(SessionRef("ops", "s1"))
    assert {keys.partition(SessionRef("ops", f"s{i}")) for i in range(200)} == set(range(8))


def test_events_package_imports_neither_celery_nor_psycopg() -> None:
    code = (
        "import sys, june_worker.events as e; e.RedisStreamSink; e.follow; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu', 'psycopg', 'psycopg_pool')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# --- structural events: exactly once, in order -----------------------------------------------------------


def test_publishing_the_same_events_twice_appends_each_once(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    sink = RedisStreamSink(client, keys=keys)
    events = turn_events("t1", 1, ["a", "b"])
    sink.publish(ref, events)
    sink.publish(ref, events)  # a replay
    sink.publish(ref, events[1:3])  # a relay of part of them
    assert structural(client, keys.session_stream(ref)) == [(e.seq, e.type) for e in events]
    assert sink.relayed_seq(ref) == 4


def test_structural_events_are_appended_in_seq_order_whatever_the_batch_order(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    sink = RedisStreamSink(client, keys=keys)
    events = turn_events("t1", 1, ["a", "b", "c"])
    sink.publish(ref, list(reversed(events[:3])))
    sink.publish(ref, events[3:])
    assert [s for s, _ in structural(client, keys.session_stream(ref))] == [1, 2, 3, 4, 5]


def test_events_past_a_gap_wait_for_relay_when_the_sink_has_no_store(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    # Given seqs 1-2 committed but never published (lost), and no store on the sink
    store = MemoryStore()
    committed = store.commit(ref, Commit(events=turn_events("t1", 1, ["a", "b"])[:2]))
    later = store.commit(ref, Commit(events=turn_events("t1", 3, ["c"])[1:]))
    sink = RedisStreamSink(client, keys=keys)
    # When seq 3.. is published: it is not appended ahead of 1-2
    sink.publish(ref, later)
    assert structural(client, keys.session_stream(ref)) == []
    # Then relay() fills the stream from the store, in order, once
    assert sink.relay(store, ref) == len(committed) + len(later)
    assert sink.relay(store, ref) == 0
    assert [s for s, _ in structural(client, keys.session_stream(ref))] == [1, 2, 3, 4]


def test_a_sink_with_a_store_fills_a_gap_before_appending_later_events(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    store = MemoryStore()
    store.commit(ref, Commit(events=turn_events("t1", 1, ["a", "b"])[:3]))  # never published
    later = store.commit(ref, Commit(events=[TurnCompleted(turn_id="t1", text="b")]))
    RedisStreamSink(client, keys=keys, store=store).publish(ref, later)
    assert structural(client, keys.session_stream(ref)) == [(e.seq, e.type) for e in store.events(ref)]


async def test_relay_catches_up_after_a_crash_between_commit_and_publish(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    # Given a turn that crashed at before-publish of model:1 (committed, not published)
    store = MemoryStore()
    sink = RedisStreamSink(client, keys=keys)  # no store: nothing fills the gap by itself
    crashed = Runtime([lookup_agent()], store, sink=sink, crash=CrashAt("before-publish", "model:1"))
    with pytest.raises(CrashInjected, match="before-publish"):
        await crashed.session(ref.agent, ref.session).turn("look it up", turn_id="t1")
    committed = [(e.seq, e.type) for e in store.events(ref)]
    stream = keys.session_stream(ref)
    assert structural(client, stream) == committed[:1]
    # When a new worker relays the session, then replays the turn to its end
    assert sink.relay(store, ref) == len(committed) - 1
    assert structural(client, stream) == committed
    restarted = Runtime([lookup_agent()], store, sink=sink)
    assert await restarted.session(ref.agent, ref.session).turn("look it up", turn_id="t1") == "Found it."
    # Then the stream holds every committed event once, in commit order, in the firehose too
    log = [(e.seq, e.type) for e in store.events(ref)]
    assert structural(client, stream) == log
    assert structural(client, keys.firehose_stream(keys.partition(ref))) == log
    assert log[-1][1] == "turn.completed"


async def test_a_replayed_turn_fills_the_gap_its_crash_left_without_a_relay_call(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    store = MemoryStore()
    sink = RedisStreamSink(client, keys=keys, store=store)
    crashed = Runtime([lookup_agent()], store, sink=sink, crash=CrashAt("before-publish", "model:1"))
    with pytest.raises(CrashInjected):
        await crashed.session(ref.agent, ref.session).turn("look it up", turn_id="t1")
    restarted = Runtime([lookup_agent()], store, sink=sink)
    await restarted.session(ref.agent, ref.session).turn("look it up", turn_id="t1")
    assert structural(client, keys.session_stream(ref)) == [(e.seq, e.type) for e in store.events(ref)]


def test_after_redis_loses_a_sessions_keys_the_next_publish_rebuilds_its_stream_from_the_store(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    store = MemoryStore()
    sink = RedisStreamSink(client, keys=keys, store=store)
    sink.publish(ref, store.commit(ref, Commit(events=turn_events("t1", 1, ["a"]))))
    client.delete(keys.session_stream(ref), keys.session_marker(ref), keys.firehose_marker(0))  # a restart
    sink.publish(ref, store.commit(ref, Commit(events=turn_events("t2", 4, ["b"]))))
    log = [(e.seq, e.type) for e in store.events(ref)]
    assert structural(client, keys.session_stream(ref)) == log
    # the firehose still held t1's entries: they are there twice; a firehose consumer dedupes by (session, seq)
    assert [s for s, _ in structural(client, keys.firehose_stream(0))] == [1, 2, 3, 1, 2, 3, 4, 5, 6]


def test_a_lost_marker_is_recovered_from_the_stream_tail_without_duplicates(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    sink = RedisStreamSink(client, keys=keys, firehose=False)
    events = turn_events("t1", 1, ["a", "b"])
    sink.publish(ref, events[:3])
    sink.publish_delta(ref, MessageDelta(turn_id="t1", step="model:3", text="tok"))
    client.delete(keys.session_marker(ref))  # evicted
    sink.publish(ref, events)
    assert [s for s, _ in structural(client, keys.session_stream(ref))] == [1, 2, 3, 4]
    assert int(client.get(keys.session_marker(ref)) or 0) == 4


def test_the_sink_reloads_its_script_when_redis_does_not_know_it(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    sink = RedisStreamSink(client, keys=keys)
    sink._sha = "0" * 40  # as after SCRIPT FLUSH or a failover (never flushed here: the Redis is shared)
    sink.publish(ref, turn_events("t1", 1, ["a"]))
    assert len(structural(client, keys.session_stream(ref))) == 3


# --- deltas ------------------------------------------------------------------------------------------


def test_deltas_carry_their_step_and_are_never_deduplicated(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    sink = RedisStreamSink(client, keys=keys)
    first = MessageDelta(turn_id="t1", step="model:1", text="Hel")
    retried = MessageDelta(turn_id="t1", step="model:1", text="Hel")  # the same step, streamed again
    sink.publish_delta(ref, first)
    sink.publish_delta(ref, retried)
    sink.publish_delta(ref, ReasoningDelta(turn_id="t1", step="model:1", text="hmm"))
    got = entries(client, keys.session_stream(ref))
    assert [(e.event.type, getattr(e.event, "step", None), e.agent, e.session) for e in got] == [
        ("message.delta", "model:1", ref.agent, ref.session),
        ("message.delta", "model:1", ref.agent, ref.session),
        ("reasoning.delta", "model:1", ref.agent, ref.session),
    ]
    rows: Any = client.xrange(keys.session_stream(ref))
    raw = rows[0][1]
    assert raw[b"type"] == b"message.delta" and set(raw) == {b"type", b"data"}
    assert client.exists(keys.firehose_stream(keys.partition(ref))) == 0  # deltas never reach the firehose


# --- pipelined publishing (the worker's sink) ---------------------------------------------------------


def _published(store: MemoryStore, ref: SessionRef, events: list[TurnEvent]) -> list[TurnEvent]:
    """``events`` committed to ``store``, stamped with their seqs, as the engine hands them to the sink."""
    return store.commit(ref, Commit(events=[e.model_copy(update={"seq": None}) for e in events]))


def test_a_pipelined_publish_does_not_wait_for_the_reply_and_keeps_commit_order_with_the_deltas(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    store = MemoryStore()
    sink = RedisStreamSink(client, keys=keys, store=store, pipelined=True)
    events = turn_events("t1", 1, ["a", "b"])
    first = _published(store, ref, events[:2])
    sink.publish(ref, first)
    assert len(sink._wire)  # sent; the reply is read later
    sink.publish_delta(ref, MessageDelta(turn_id="t1", step="model:2", text="b"))
    rest = _published(store, ref, events[2:])
    sink.publish(ref, rest)
    sink.publish(ref, first + rest)  # a replay appends nothing
    sink.flush()
    assert not len(sink._wire)
    got = [(e.event.seq, e.event.type) for e in entries(client, keys.session_stream(ref))]
    assert got == [(1, "turn.started"), (2, "message.completed"), (None, "message.delta"), (3, "message.completed")] + [
        (4, "turn.completed")
    ]
    assert structural(client, keys.firehose_stream(keys.partition(ref))) == [(e.seq, e.type) for e in store.events(ref)]
    sink.close()


def test_a_gap_that_a_late_read_reply_reports_is_filled_from_the_store(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    # Given seqs 1-3 committed and never published (the worker that committed them died)
    store = MemoryStore()
    _published(store, ref, turn_events("t1", 1, ["a", "b"])[:3])
    sink = RedisStreamSink(client, keys=keys, store=store, pipelined=True)
    # When the next commit's events are published without waiting, and the reply is read at flush
    sink.publish(ref, _published(store, ref, [TurnCompleted(turn_id="t1", text="b")]))
    sink.flush()
    # Then the stream holds the whole log, in order, once
    assert structural(client, keys.session_stream(ref)) == [(e.seq, e.type) for e in store.events(ref)]
    sink.close()


def test_a_pipelined_sink_loses_nothing_when_its_connection_dies_with_replies_owed(
    client: redis.Redis, keys: EventKeys, ref: SessionRef, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a pipelined sink that published the start of a turn
    store = MemoryStore()
    sink = RedisStreamSink(client, keys=keys, store=store, pipelined=True, retry_after_s=0.0)
    events = turn_events("t1", 1, ["a", "b"])
    sink.publish(ref, _published(store, ref, events[:2]))
    sink.flush()
    # When Redis drops its connection, and the next publish goes into the dead socket
    kill_sink_connection(client, sink, keys.session_stream(ref))
    with caplog.at_level(logging.WARNING, logger="june_worker.events"):
        sink.publish(ref, _published(store, ref, events[2:3]))
        sink.flush()  # must not raise
        # Then the next publish, on a new connection, finds the gap and fills it from the store
        sink.publish(ref, _published(store, ref, events[3:]))
        sink.flush()
    assert structural(client, keys.session_stream(ref)) == [(e.seq, e.type) for e in store.events(ref)]
    assert any("failed" in r.getMessage() for r in caplog.records)
    sink.close()


def test_a_pipelined_sink_checks_an_idle_connection_before_publishing_on_it(
    events_url: str, keys: EventKeys, ref: SessionRef, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a pipelined sink whose client checks connections idle for more than 50 ms
    client = connect(events_url, health_check_interval=0.05)
    store = MemoryStore()
    sink = RedisStreamSink(client, keys=keys, store=store, pipelined=True)
    events = turn_events("t1", 1, ["a", "b"])
    sink.publish(ref, _published(store, ref, events[:2]))
    sink.flush()
    # When Redis drops the connection while it is idle (a restart, a proxy's idle timeout)
    kill_sink_connection(client, sink, keys.session_stream(ref))
    time.sleep(0.1)  # idle past the health-check interval
    with caplog.at_level(logging.WARNING, logger="june_worker.events"):
        sink.publish(ref, _published(store, ref, events[2:]))
        sink.flush()
    # Then the publish found the connection dead before sending, reconnected, and nothing failed
    assert structural(client, keys.session_stream(ref)) == [(e.seq, e.type) for e in store.events(ref)]
    assert [r.getMessage() for r in caplog.records] == []
    sink.close()
    client.close()


def move_slot(client: Any, key: str) -> tuple[str, str]:
    """Move the hash slot of ``key``, with its keys, to another node of the cluster (what a resharding does);
    return the old and the new owner's ``host:port``."""
    slot = client.keyslot(key)
    source = client.get_node_from_key(key)
    target = next(n for n in client.get_primaries() if n.name != source.name)
    src, dst = source.redis_connection, target.redis_connection
    src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    while names := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
        src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *names)
    for node in client.get_primaries():
        node.redis_connection.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    return source.name, target.name


def test_a_pipelined_sink_on_a_cluster_follows_a_slot_that_moved_and_loses_nothing(
    redis_cluster_url: str, ref: SessionRef
) -> None:
    # Given a pipelined sink on a cluster that published the start of a turn (it knows which node owns the slot)
    client = connect(redis_cluster_url)
    keys = EventKeys(prefix=f"june-test-{uuid.uuid4().hex[:10]}")
    store = MemoryStore()
    sink = RedisStreamSink(client, keys=keys, store=store, pipelined=True, retry_after_s=0.0)
    events = turn_events("t1", 1, ["a", "b", "c", "d"])
    assert len(events) == 6
    sink.publish(ref, _published(store, ref, events[:2]))
    sink.flush()
    # When the session's slot moves to another node (a resharding), and the turn goes on
    stream = keys.session_stream(ref)
    old, new = move_slot(client, stream)
    sink.publish_delta(ref, MessageDelta(turn_id="t1", step="model:2", text="lost"))
    sink.flush()  # the old node answered MOVED: the delta is gone (live only), the sink knows the new node now
    sink.publish_delta(ref, MessageDelta(turn_id="t1", step="model:2", text="kept"))
    sink.publish(ref, _published(store, ref, events[2:4]))
    sink.flush()
    sink.publish(ref, _published(store, ref, events[4:]))
    sink.flush()
    # Then the stream, now on the new node, holds every event once, in order, and the sink writes there
    assert structural(client, stream) == [(e.seq, e.type) for e in store.events(ref)]
    assert [e.event.text for e in entries(client, stream) if e.event.type == "message.delta"] == ["kept"]
    assert f"{sink._wire.connection_of(stream).host}:{sink._wire.connection_of(stream).port}" == new != old
    sink.close()
    client.close()


def test_a_pipelined_sink_whose_client_fails_to_learn_a_moved_slot_does_not_raise_and_loses_nothing(
    redis_cluster_url: str, ref: SessionRef, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a pipelined sink on a cluster that published the start of a turn
    client = connect(redis_cluster_url)
    keys = EventKeys(prefix=f"june-test-{uuid.uuid4().hex[:10]}")
    store = MemoryStore()
    sink = RedisStreamSink(client, keys=keys, store=store, pipelined=True, retry_after_s=0.0)
    events = turn_events("t1", 1, ["a", "b"])
    sink.publish(ref, _published(store, ref, events[:2]))
    sink.flush()
    # and a client whose slot map update fails once (redis-py's own, an internal of a version we did not test)
    nodes = client.nodes_manager
    name = "move_slot" if hasattr(nodes, "move_slot") else "update_moved_exception"
    real, failures = getattr(nodes, name), []

    def update_once_failing(exc: Any) -> Any:
        if not failures:
            failures.append(exc)
            raise RuntimeError("the slot map could not be updated")
        return real(exc)

    monkeypatch.setattr(nodes, name, update_once_failing)
    # When the session's slot moves and the turn goes on
    stream = keys.session_stream(ref)
    move_slot(client, stream)
    sink.publish(ref, _published(store, ref, events[2:4]))
    with caplog.at_level(logging.WARNING, logger="june_worker.events"):
        sink.flush()  # must not raise
        sink.publish(ref, _published(store, ref, events[4:]))
        sink.flush()
    # Then it said so, and the stream holds every event once, in order (the relay followed the MOVED)
    assert failures and any("learning where slot" in r.getMessage() for r in caplog.records)
    assert structural(client, stream) == [(e.seq, e.type) for e in store.events(ref)]
    sink.close()
    client.close()


def test_a_pipelined_sink_writes_to_a_node_its_client_had_no_connection_to_when_a_slot_moved_there(
    redis_cluster_url: str, ref: SessionRef
) -> None:
    # Given a pipelined sink on a cluster that published the start of a turn
    client = connect(redis_cluster_url)
    keys = EventKeys(prefix=f"june-test-{uuid.uuid4().hex[:10]}")
    store = MemoryStore()
    sink = RedisStreamSink(client, keys=keys, store=store, pipelined=True, retry_after_s=0.0)
    events = turn_events("t1", 1, ["a", "b", "c"])
    sink.publish(ref, _published(store, ref, events[:2]))
    sink.flush()
    # When the session's slot moves to a node the client has no connection to (as one that joined the cluster
    # after the client learned the slot map: the MOVED names a node it has not met)
    stream = keys.session_stream(ref)
    old, new = move_slot(client, stream)
    client.nodes_manager.nodes_cache.pop(new).redis_connection.close()
    sink.publish_delta(ref, MessageDelta(turn_id="t1", step="model:2", text="lost"))
    sink.flush()  # MOVED: the slot's node is new to the client; a delta is live only, so no relay went there first
    sink.publish(ref, _published(store, ref, events[2:]))
    sink.flush()
    # Then the sink opened a connection to it and writes there, and the stream holds every event once, in order
    assert structural(client, stream) == [(e.seq, e.type) for e in store.events(ref)]
    conn = sink._wire.connection_of(stream)
    assert conn is not None and f"{conn.host}:{conn.port}" == new != old
    sink.close()
    client.close()


def test_a_pipelined_sink_rebuilds_the_stream_when_redis_does_not_know_its_script(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    store = MemoryStore()
    sink = RedisStreamSink(client, keys=keys, store=store, pipelined=True)
    sink._sha = "0" * 40  # as after SCRIPT FLUSH or a failover (never flushed here: the Redis is shared)
    sink.publish(ref, _published(store, ref, turn_events("t1", 1, ["a"])))
    sink.flush()
    assert structural(client, keys.session_stream(ref)) == [(e.seq, e.type) for e in store.events(ref)]
    sink.close()


def test_a_pipelined_sink_needs_a_store_to_fill_gaps_from(client: redis.Redis, keys: EventKeys) -> None:
    with pytest.raises(ValueError, match="needs a store"):
        RedisStreamSink(client, keys=keys, pipelined=True)


# --- follow ------------------------------------------------------------------------------------------


def test_follow_catches_up_then_follows_live_and_ends_on_the_turns_terminal_event(
    client: redis.Redis, events_url: str, keys: EventKeys, ref: SessionRef
) -> None:
    # Given turn t1 half-published, and a reader of t1 alone on its own named connection
    sink = RedisStreamSink(client, keys=keys)
    t1 = turn_events("t1", 1, ["a"])
    sink.publish(ref, t1[:2])
    name = f"reader-{uuid.uuid4().hex[:8]}"
    reader = connect(events_url, client_name=name)

    def write() -> None:
        # When, while the reader is blocked in XREAD, another turn and then t1's end are published
        wait_until(blocked(client, name), "the reader to block in XREAD")
        t2 = turn_events("t2", 3, ["x"])
        sink.publish(ref, t2[:2])
        sink.publish_delta(ref, MessageDelta(turn_id="t2", step="model:1", text="x"))
        sink.publish_delta(ref, MessageDelta(turn_id="t1", step="model:1", text="tok"))
        sink.publish(ref, [e.model_copy(update={"seq": 5}) for e in t1[2:]])
        sink.publish(ref, [t2[2].model_copy(update={"seq": 6})])

    writer = threading.Thread(target=write)
    writer.start()
    try:
        got = list(follow(reader, ref.agent, ref.session, turn_id="t1", keys=keys, block_ms=1000, timeout_s=WAIT_S))
    finally:
        writer.join(WAIT_S)
        reader.close()
    # Then it saw t1's history, its live delta and its end, nothing of t2, and stopped there
    assert [(e.event.type, e.event.seq) for e in got] == [
        ("turn.started", 1),
        ("message.completed", 2),
        ("message.delta", None),
        ("turn.completed", 5),
    ]
    assert all(e.event.turn_id == "t1" for e in got)
    ids = [e.stream_id for e in got]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))


def test_following_from_a_last_id_misses_nothing_and_repeats_nothing(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    sink = RedisStreamSink(client, keys=keys)
    events = turn_events("t1", 1, [f"m{i}" for i in range(8)])
    sink.publish(ref, events[:6])
    first = follow(client, ref.agent, ref.session, keys=keys, timeout_s=WAIT_S)
    seen = [next(first) for _ in range(4)]
    first.close()  # the reader goes away after 4 events
    sink.publish(ref, events[6:])
    resumed = list(follow(client, ref.agent, ref.session, keys=keys, last_id=seen[-1].stream_id, timeout_s=0))
    assert [e.event.seq for e in seen + resumed] == [e.seq for e in events]
    assert len({e.stream_id for e in seen + resumed}) == len(events)


def test_following_from_dollar_sees_only_what_comes_next(client: redis.Redis, keys: EventKeys, ref: SessionRef) -> None:
    sink = RedisStreamSink(client, keys=keys)
    events = turn_events("t1", 1, ["a"])
    sink.publish(ref, events[:2])
    live = follow(client, ref.agent, ref.session, keys=keys, last_id="$", timeout_s=WAIT_S)
    assert list(follow(client, ref.agent, ref.session, keys=keys, last_id="$", timeout_s=0)) == []
    sink.publish(ref, events[2:])
    assert next(live).event.seq == 3
    live.close()


async def test_afollow_catches_up_then_follows_live_until_the_turn_ends(
    client: redis.Redis, events_url: str, keys: EventKeys, ref: SessionRef
) -> None:
    sink = RedisStreamSink(client, keys=keys)
    events = turn_events("t1", 1, ["a", "b"])
    sink.publish(ref, events[:2])
    name = f"areader-{uuid.uuid4().hex[:8]}"
    reader = aconnect(events_url, client_name=name)

    def write() -> None:
        wait_until(blocked(client, name), "the async reader to block in XREAD")
        sink.publish(ref, events[2:])

    writer = threading.Thread(target=write)
    writer.start()
    try:
        got = [e async for e in afollow(reader, ref.agent, ref.session, turn_id="t1", keys=keys, timeout_s=WAIT_S)]
    finally:
        writer.join(WAIT_S)
        await reader.aclose()
    assert [e.event.seq for e in got] == [1, 2, 3, 4]
    assert got[-1].event.type == "turn.completed"


def test_a_follow_yields_each_structural_event_once_from_a_rebuilt_stream(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    # Given a stream holding seq 1-3 twice (rebuilt from the store after a loss) and one bad entry
    sink = RedisStreamSink(client, keys=keys, firehose=False)
    events = turn_events("t1", 1, ["a"])
    sink.publish(ref, events)
    for e in events:
        client.xadd(keys.session_stream(ref), {"type": e.type, "data": encode_event(ref, e)})
    client.xadd(keys.session_stream(ref), {"type": "turn.started", "data": "not json"})
    # When one follow reads it all, Then it yields each event once and skips the bad entry
    got = list(follow(client, ref.agent, ref.session, keys=keys, timeout_s=0))
    assert [e.event.seq for e in got] == [1, 2, 3]


class _ListLog:
    def __init__(self, events: list[TurnEvent]) -> None:
        self._events = events

    def events(self, ref: SessionRef, *, turn_id: str | None = None, after_seq: int = 0) -> list[TurnEvent]:
        return [e for e in self._events if (e.seq or 0) > after_seq]


# --- the firehose ------------------------------------------------------------------------------------


def test_the_firehose_holds_each_structural_event_of_every_session_once(client: redis.Redis, keys: EventKeys) -> None:
    keys4 = EventKeys(prefix=keys.prefix, firehose_partitions=4)
    sink = RedisStreamSink(client, keys=keys4)
    refs = [SessionRef("ops", f"s{i}") for i in range(12)]
    for r in refs:
        events = turn_events("t1", 1, ["a"])
        sink.publish(r, events)
        sink.publish(r, events)  # replayed
        sink.publish_delta(r, MessageDelta(turn_id="t1", step="model:1", text="tok"))
    seen: dict[str, list[int | None]] = {}
    for p in range(4):
        for e in read_firehose(client, p, keys=keys4, count=1000):
            assert keys4.partition(SessionRef(e.agent, e.session)) == p
            seen.setdefault(e.session, []).append(e.event.seq)
    assert seen == {r.session: [1, 2, 3] for r in refs}


def test_the_firehose_forgets_the_marker_fields_of_quiet_sessions_only(client: redis.Redis, keys: EventKeys) -> None:
    # Given sessions that published to four firehose partitions
    keys4 = EventKeys(prefix=keys.prefix, firehose_partitions=4)
    sink = RedisStreamSink(client, keys=keys4)
    refs = [SessionRef("ops", f"q{i}") for i in range(8)]
    for r in refs:
        sink.publish(r, turn_events("t1", 1, ["a"]))
    fields = sum(int(client.hlen(keys4.firehose_marker(p))) for p in range(4))
    assert fields == len(refs)
    # When the sweeper forgets sessions quiet for an hour: none is; then those quiet for no time: all are
    assert sink.forget_quiet_sessions(quiet_s=3600) == 0
    assert sink.forget_quiet_sessions(quiet_s=-1) == len(refs)
    # Then their fields (and entries of the seen set) are gone, partition by partition, and the streams stay
    assert sum(int(client.hlen(keys4.firehose_marker(p))) for p in range(4)) == 0
    assert sum(int(client.zcard(keys4.firehose_seen(p))) for p in range(4)) == 0
    assert sum(int(client.xlen(keys4.firehose_stream(p))) for p in range(4)) == 3 * len(refs)


def test_a_consumer_group_hands_each_event_to_one_consumer_until_acked(
    events_url: str, keys: EventKeys, ref: SessionRef
) -> None:
    client = connect(events_url, decode_responses=True)  # the reader copes with str replies too
    try:
        sink = RedisStreamSink(client, keys=keys)
        assert ensure_group(client, "audit", keys=keys) is True
        assert ensure_group(client, "audit", keys=keys) is False
        sink.publish(ref, turn_events("t1", 1, ["a", "b"]))
        a = read_group(client, "audit", "a", count=2, keys=keys)
        b = read_group(client, "audit", "b", count=10, keys=keys)
        assert [e.event.seq for e in a] == [1, 2] and [e.event.seq for e in b] == [3, 4]
        assert read_group(client, "audit", "b", keys=keys) == []
        assert ack(client, "audit", b) == 2
        # a dies holding 1-2: after a restart it re-reads them, or another consumer claims them
        assert [e.event.seq for e in read_group(client, "audit", "a", pending=True, keys=keys)] == [1, 2]
        claimed = claim_stale(client, "audit", "b", min_idle_ms=0, keys=keys)
        assert [e.event.seq for e in claimed] == [1, 2]
        assert ack(client, "audit", claimed) == 2
        assert client.xpending(keys.firehose_stream(0), "audit")["pending"] == 0
    finally:
        client.close()


# --- trimming ----------------------------------------------------------------------------------------


def test_the_session_stream_is_trimmed_to_maxlen_on_append(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    exact = RedisStreamSink(client, keys=keys, session_trim=Trim(maxlen=5, exact=True), firehose=False)
    events = turn_events("t1", 1, [f"m{i}" for i in range(20)])
    exact.publish(ref, events)
    for i in range(3):
        exact.publish_delta(ref, MessageDelta(turn_id="t1", step="model:1", text=str(i)))
    assert client.xlen(keys.session_stream(ref)) == 5
    assert exact.relayed_seq(ref) == 22  # trimming never moves the marker back

    other = SessionRef(ref.agent, ref.session + "-approx")
    approx = RedisStreamSink(client, keys=keys, session_trim=Trim(maxlen=10), firehose=False)
    for e in turn_events("t1", 1, [f"m{i}" for i in range(498)]):
        approx.publish(other, [e])
    assert 10 <= client.xlen(keys.session_stream(other)) < 500


def test_the_session_stream_drops_entries_older_than_max_age(
    client: redis.Redis, keys: EventKeys, ref: SessionRef
) -> None:
    sink = RedisStreamSink(client, keys=keys, session_trim=Trim(maxlen=100, max_age_s=3600, exact=True))
    by_delta, by_script = ref, SessionRef(ref.agent, ref.session + "-script")
    for r in (by_delta, by_script):
        client.xadd(keys.session_stream(r), {"type": "message.delta", "data": "{}"}, id="1000-0")  # from 1970
    sink.publish_delta(by_delta, MessageDelta(turn_id="t1", step="model:1", text="now"))
    sink.publish(by_script, turn_events("t1", 1, ["a"]))
    assert [e.event.type for e in entries(client, keys.session_stream(by_delta))] == ["message.delta"]
    assert [s for s, _ in structural(client, keys.session_stream(by_script))] == [1, 2, 3]
    assert client.xlen(keys.session_stream(by_script)) == 3


# --- Redis gone --------------------------------------------------------------------------------------


def test_the_sink_survives_an_unreachable_redis_and_never_logs_its_password(
    keys: EventKeys, ref: SessionRef, caplog: pytest.LogCaptureFixture
) -> None:
    sink = RedisStreamSink.from_url(f"redis://:s3cret-pw@127.0.0.1:{closed_port()}/0", keys=keys, retry_after_s=60)
    events = turn_events("t1", 1, ["a"])
    with caplog.at_level(logging.DEBUG, logger="june_worker.events"):
        sink.publish(ref, events)  # must not raise
        sink.publish_delta(ref, MessageDelta(turn_id="t1", step="model:1", text="x"))  # quiet: returns at once
        sink.publish(ref, events)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ConnectionError" in warnings[0].getMessage()
    assert "s3cret" not in caplog.text
    with pytest.raises(redis.ConnectionError):
        sink.relay(_ListLog(events), ref)  # a relay's caller wants to know, and retries
    sink.client.close()


async def test_the_engine_runs_a_turn_to_its_end_while_redis_is_unreachable(keys: EventKeys, ref: SessionRef) -> None:
    store = MemoryStore()
    sink = RedisStreamSink.from_url(f"redis://127.0.0.1:{closed_port()}/0", keys=keys, store=store)
    runtime = Runtime([lookup_agent()], store, sink=sink)
    text = await runtime.session(ref.agent, ref.session).turn("look it up")
    assert text == "Found it." and store.events(ref)[-1].type == "turn.completed"
    sink.client.close()
