"""The session queue's lease rules on Postgres, including the races that strand a turn if they go wrong."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from june_worker.engine.store import SessionRef, TurnPayload
from june_worker.stores.postgres import PostgresStore
from june_worker.worker.queue import SessionQueue

from .conftest import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def queue(fresh_db: str) -> Iterator[tuple[PostgresStore, SessionQueue]]:
    store = PostgresStore(fresh_db, max_size=4)
    try:
        yield store, SessionQueue(store.pool, lease_s=30)
    finally:
        store.close()


def _ref() -> SessionRef:
    return SessionRef("ops", f"q-{uuid.uuid4().hex[:8]}")


def test_a_turn_recorded_while_the_holder_releases_is_never_stranded(
    queue: tuple[PostgresStore, SessionQueue], fresh_db: str
) -> None:
    # Given a holder with an empty queue, and an intake that recorded a turn but has not committed
    store, q = queue
    ref = _ref()
    q.beat("holder", 60)
    lease = q.take(ref, "holder")
    assert lease is not None and lease.turn is None
    intake = psycopg.connect(fresh_db)
    intake.execute(  # what PostgresStore.enqueue_turn writes, held open
        "update june_sessions set next_position = next_position + 1 where agent = %s and session = %s",
        (ref.agent, ref.session),
    )
    intake.execute(
        "insert into june_turns (agent, session, turn_id, position, status, payload) "
        "values (%s, %s, 't_late', 1, 'queued', %s)",
        (ref.agent, ref.session, TurnPayload(text="late").model_dump_json()),
    )
    # When the holder releases (its statement's snapshot cannot see the turn) and the intake commits
    outcome: list[object] = []
    releasing = threading.Thread(target=lambda: outcome.append(q.release_or_next(ref, lease.fence)))
    releasing.start()

    def release_waits_on_the_row() -> bool:
        with psycopg.connect(fresh_db, autocommit=True) as admin:
            rows = admin.execute(
                "select 1 from pg_stat_activity where wait_event_type = 'Lock' and query like '%%released as%%'"
            ).fetchall()
        return bool(rows)

    wait_for(release_waits_on_the_row, what="the release to wait on the session row")
    intake.commit()
    intake.close()
    releasing.join(10)
    # Then the holder keeps the lease (it must run the new turn), so nothing waits for a sweeper
    assert outcome and outcome[0][0] == "next"  # type: ignore[index]
    again = q.release_or_next(ref, lease.fence)
    assert again[0] == "next" and again[1] is not None and again[1].turn_id == "t_late"


def test_release_gives_the_lease_up_when_nothing_is_queued(queue: tuple[PostgresStore, SessionQueue]) -> None:
    _, q = queue
    ref = _ref()
    q.beat("holder", 60)
    lease = q.take(ref, "holder")
    assert lease is not None
    assert q.release_or_next(ref, lease.fence)[0] == "released"
    q.beat("other", 60)
    assert q.take(ref, "other") is not None


def test_a_dead_workers_lease_is_taken_over_before_it_expires(queue: tuple[PostgresStore, SessionQueue]) -> None:
    store, q = queue
    ref = _ref()
    store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    q.beat("dead", 0.2)
    q.beat("rescuer", 60)
    held = q.take(ref, "dead")
    assert held is not None  # a 30 s lease
    assert q.take(ref, "rescuer") is None  # its holder is alive: hands off
    # the dead worker's liveness lapses after 0.2 s, long before its 30 s lease would expire
    taken = wait_for(lambda: q.take(ref, "rescuer"), timeout_s=5, what="the takeover")
    assert taken.fence == held.fence + 1
    assert taken.turn is not None and taken.turn.turn_id == "t1"
    assert q.renew(ref, held.fence) is False  # the zombie is fenced off


def test_the_sweeper_finds_a_session_whose_holder_died(queue: tuple[PostgresStore, SessionQueue]) -> None:
    store, q = queue
    ref = _ref()
    store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    q.beat("dead", 0.2)
    assert q.take(ref, "dead") is not None
    assert [s.ref for s in q.stranded(grace_s=0, limit=100)] == []  # held by a live worker
    wait_for(lambda: ref in [s.ref for s in q.stranded(grace_s=0, limit=100)], timeout_s=5, what="the sweeper")
