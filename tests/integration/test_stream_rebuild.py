"""The sweeper refills the streams Redis lost with its data, and only those (june_worker/events/losses.py).

Worker hosts in this process (no Celery; the followers' side, with real workers, is in
test_worker_redis_loss.py), each on a database of its test's own and a Redis of its own, restarted
without persistence where a test loses its data. The sessions' turns are committed and relayed, as a
worker that ran them leaves them: their relay marks in Postgres reach their outboxes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from june_wire.redis_url import connect
from june_worker.engine.events import TurnCompleted, TurnStarted
from june_worker.engine.store import Commit, SessionRef, TurnPayload
from june_worker.engine.types import ProactiveTrigger
from june_worker.events import EventKeys, losses
from june_worker.worker.sweeper import sweep
from tests import _services
from tests._services import RedisServer

from .conftest import _database

pytestmark = pytest.mark.integration


@pytest.fixture
def own_db(database_url: str) -> Iterator[str]:
    """A database of this test's own: a rebuild pass reads every session of its database."""
    yield from _database(database_url)


def _host(database_url: str, redis_url: str) -> Iterator[Any]:
    from june_worker.worker.host import WorkerHost
    from june_worker.worker.settings import WorkerSettings

    from .agents import ALL

    prefix = f"june-it-{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings(database_url=database_url, redis_url=redis_url, key_prefix=prefix, lease_s=60)
    h = WorkerHost(settings, {a.name: a for a in ALL()})
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def host(own_db: str, private_redis: RedisServer) -> Iterator[Any]:
    """A worker host in this process, on the test's own database and Redis (no persistence)."""
    yield from _host(own_db, private_redis.url)


@pytest.fixture
def persistent_redis() -> Iterator[RedisServer]:
    """A Redis of the test's own with an append-only file, as docker-compose.yml runs it."""
    with _services.private_redis(persistent=True) as server:
        yield server


@pytest.fixture
def persistent_host(own_db: str, persistent_redis: RedisServer) -> Iterator[Any]:
    yield from _host(own_db, persistent_redis.url)


def _finished(host: Any, count: int) -> list[SessionRef]:
    """``count`` sessions with one finished turn each (two events), relayed and marked so."""
    refs = [SessionRef("ops", f"done-{i:02d}") for i in range(count)]
    for ref in refs:
        host.store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
        opened = TurnStarted(turn_id="t1", trigger=ProactiveTrigger())
        host.store.commit(ref, Commit(events=[opened, TurnCompleted(turn_id="t1", text="done")]))
        host.sink.relay(host.store, ref)
    host.queue.mark_relayed([(ref, 2) for ref in refs])
    return refs


def _seqs(host: Any, ref: SessionRef) -> list[int]:
    return [json.loads(f[b"data"])["seq"] for _, f in host.redis.xrange(host.keys.session_stream(ref))]


def _drop_keys(host: Any, ref: SessionRef) -> None:
    """The session's stream and marker go, and nothing else: as when they expire (JUNE_STREAM_TTL_S)."""
    host.redis.delete(host.keys.session_stream(ref), host.keys.session_marker(ref))


def test_one_sweep_after_redis_lost_its_data_refills_every_finished_sessions_stream_however_many_pages(
    host: Any, private_redis: RedisServer
) -> None:
    page = 3
    refs = _finished(host, 3 * page + 1)  # past three full pages
    assert sweep(host, lambda rec: None, limit=page)["rebuilt"] == 0  # every stream complete: nothing to put back
    # Given Redis restarted without persistence after the sessions' turns finished
    private_redis.restart()
    assert all(_seqs(host, ref) == [] for ref in refs)
    # When the sweeper runs once
    summary = sweep(host, lambda rec: None, limit=page)
    # Then every session's stream holds its events again, each once, in order
    assert summary["rebuilt"] == 2 * len(refs)
    assert [_seqs(host, ref) for ref in refs] == [[1, 2]] * len(refs)
    assert host.redis.exists(host.keys.rebuild_pass()) == 0  # the pass is over


def test_a_stream_that_expired_while_redis_kept_its_data_is_left_to_its_next_publish(host: Any) -> None:
    # Given a finished session, a sweep since, and then its stream and marker gone while Redis kept its data
    [ref] = _finished(host, 1)
    sweep(host, lambda rec: None)
    _drop_keys(host, ref)
    # When the sweeper runs again
    summary = sweep(host, lambda rec: None)
    # Then it leaves the stream gone: an expiry frees Redis of a quiet session, it is no loss to repair
    assert summary["rebuilt"] == 0
    assert _seqs(host, ref) == []


def test_a_redis_that_came_back_short_of_its_last_events_has_them_put_back_by_the_next_sweep(
    persistent_host: Any, persistent_redis: RedisServer
) -> None:
    host = persistent_host
    [ref, other] = _finished(host, 2)
    sweep(host, lambda rec: None)
    # Given Redis restarted from an append-only file that lacks the session's last event (a crash within the
    # last second): its epoch key came back with it
    [(last_id, _)] = host.redis.xrevrange(host.keys.session_stream(ref), count=1)
    host.redis.xdel(host.keys.session_stream(ref), last_id)
    host.redis.set(host.keys.session_marker(ref), 1)
    persistent_redis.restart()
    assert _seqs(host, ref) == [1] and host.redis.exists(host.keys.epoch(0)) == 1
    # When the sweeper runs
    summary = sweep(host, lambda rec: None)
    # Then the stream has its last event back, and the one that lost nothing is as it was
    assert [_seqs(host, ref), _seqs(host, other)] == [[1, 2], [1, 2]]
    assert summary["rebuilt"] == 1


def test_a_rebuild_pass_left_unfinished_goes_on_after_the_last_session_it_recorded(host: Any) -> None:
    refs = _finished(host, 6)
    sweep(host, lambda rec: None)
    # Given every stream gone, and a pass recorded as having checked the sessions up to the third (the sweep
    # that ran it failed there)
    for ref in refs:
        _drop_keys(host, ref)
    recorded = losses.RebuildPass("an-earlier-pass", None)
    host.redis.set(host.keys.rebuild_pass(), recorded.encode(refs[2]))
    # When the sweeper runs
    summary = sweep(host, lambda rec: None, limit=2)
    # Then it refills the streams of the sessions after the third, leaves those it had checked, and ends the pass
    assert [_seqs(host, ref) for ref in refs] == [[], [], [], [1, 2], [1, 2], [1, 2]]
    assert summary["rebuilt"] == 6
    assert host.redis.exists(host.keys.rebuild_pass()) == 0


def test_a_pass_is_moved_on_or_ended_only_by_a_sweep_that_runs_that_same_pass(redis_url: str) -> None:
    keys = EventKeys(prefix=f"june-it-{uuid.uuid4().hex[:8]}")
    client = connect(redis_url)
    try:
        # Given a pass a loss began, and a second loss (the epoch key gone again) that began another
        first = losses.pending_pass(client, keys)
        assert first is not None and first.began
        client.delete(keys.epoch(0))
        second = losses.pending_pass(client, keys)
        assert second is not None and second.began and second.pass_id != first.pass_id
        # When a sweep still running the first pass moves it on, then ends it
        moved = losses.move_pass(client, keys, first, SessionRef("ops", "s9"))
        ended = losses.finish_pass(client, keys, first)
        # Then neither touches the second pass: it goes on from the start
        assert (moved, ended) == (False, False)
        assert losses.pending_pass(client, keys) == losses.RebuildPass(second.pass_id, None)
    finally:
        client.delete(keys.epoch(0), keys.rebuild_pass())
        client.close()


def test_on_a_cluster_each_primary_keeps_an_epoch_key_of_its_own(redis_cluster_url: str) -> None:
    # Given a three-node cluster
    client: Any = connect(redis_cluster_url)
    try:
        # When the epoch keys are named
        epochs = losses.epoch_keys(client, EventKeys(prefix=f"june-it-{uuid.uuid4().hex[:8]}"))
        # Then there is one on each primary: whichever node loses its data, one of them goes with it
        owners = sorted(client.get_node_from_key(key).name for key in epochs)
        assert owners == sorted(node.name for node in client.get_primaries())
    finally:
        client.close()
