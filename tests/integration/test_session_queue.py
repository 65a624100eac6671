"""The session queue's lease rules on Postgres, including the races that strand a turn if they go wrong."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from june_worker.engine.events import Completed, MessageCompleted, TurnCompleted, TurnEvent, TurnStarted
from june_worker.engine.store import Commit, SessionRef, StepRecord, SuspendedCheckpoint, TurnPayload
from june_worker.engine.types import AssistantMessage, InputRequest, ProactiveTrigger, UserMessage
from june_worker.errors import LeaseLostError
from june_worker.stores._pg_commit import commit_statement
from june_worker.stores.postgres import PostgresStore
from june_worker.worker.queue import _INTAKE, _NO_OPENING, Intake, SessionQueue
from june_worker.worker.transcripts import held_params

from .conftest import _database, wait_for

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


def _intake_params(ref: SessionRef, turn_id: str, owner: str) -> dict[str, object]:
    """The parameters of SessionQueue.intake's statement, to run it in a transaction held open."""
    payload = TurnPayload(text=turn_id).model_dump_json()
    return {
        "agent": ref.agent,
        "session": ref.session,
        "turn_id": turn_id,
        "payload": payload,
        "o": owner,
        "l": 30.0,
        "max": 5,
        **held_params(None),
        **_NO_OPENING,  # (no opening: the runner would open the turn)
    }


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


# --- intake: the turn and the lease in one statement ---------------------------------------------------


def test_intake_records_a_new_turn_and_takes_the_free_lease(queue: tuple[PostgresStore, SessionQueue]) -> None:
    store, q = queue
    ref = _ref()
    q.beat("w1", 60)
    got = q.intake(ref, "t1", TurnPayload(text="hi"), "w1")
    assert got.recorded and got.existing is None and got.parked is None
    assert got.lease is not None and got.lease.fence == 1 and got.lease.event_seq == 0
    assert got.lease.turn is not None and got.lease.turn.turn_id == "t1" and got.lease.turn.position == 1
    second = q.intake(ref, "t2", TurnPayload(text="again"), "w1")  # ours already: taken again, fence moves on
    assert second.lease is not None and second.lease.fence == 2
    assert second.lease.turn is not None and second.lease.turn.turn_id == "t1"  # still the oldest unfinished
    assert store.get_turn(ref, "t2") is not None and store.get_turn(ref, "t2").position == 2  # type: ignore[union-attr]


def _rows(store: PostgresStore, ref: SessionRef) -> dict[str, list[tuple[Any, ...]]]:
    """What a session holds, as rows to compare (its own database's ids are the session's)."""
    key = {"a": ref.agent, "s": ref.session}
    queries = {
        "session": "select status, event_seq, relay_due, suspended::text from june_sessions"
        " where agent = %(a)s and session = %(s)s",
        "turns": "select turn_id, status, attempts, result::text from june_turns"
        " where agent = %(a)s and session = %(s)s order by position",
        "messages": "select idx, turn_id, role, body::text from june_messages"
        " where agent = %(a)s and session = %(s)s order by idx",
        "steps": "select step_id, turn_id, data::text from june_steps where agent = %(a)s and session = %(s)s"
        " order by step_id",
        "events": "select seq, turn_id, type, body::text from june_events where agent = %(a)s and session = %(s)s"
        " order by seq",
    }
    with store.pool.connection() as conn:
        return {name: [tuple(r) for r in conn.execute(sql, key).fetchall()] for name, sql in queries.items()}


def test_an_intake_with_the_opening_writes_what_the_runners_opening_commit_writes(
    queue: tuple[PostgresStore, SessionQueue],
) -> None:
    from june_worker.engine.loop import opening_commit
    from june_worker.engine.types import InboundEvent, Principal

    store, q = queue
    q.beat("w1", 60)
    seat = Principal(id="u-7", team="ops")
    payload = TurnPayload(text="refund order 7", event=InboundEvent(source="web", text="refund", principal=seat))
    # one session opened by its intake, the other by the runner's own commit after a plain intake
    by_intake = _ref()
    by_runner = SessionRef("ops", by_intake.session + "-r")
    got = q.intake(by_intake, "t1", payload, "w1", opening=opening_commit("t1", payload, seat))
    plain = q.intake(by_runner, "t1", payload, "w1")
    assert got.lease is not None and plain.lease is not None and plain.lease.opened is None
    runner_opening = opening_commit("t1", payload, seat)
    runner_opening.count_attempt = False  # (the intake counted this start)
    store.commit(by_runner, runner_opening, fence=plain.lease.fence)

    assert _rows(store, by_intake) == _rows(store, by_runner)
    rows = _rows(store, by_intake)
    assert rows["session"][0][:2] == ("running", 1) and rows["turns"] == [("t1", "running", 1, None)]
    assert [m[:3] for m in rows["messages"]] == [(0, "t1", "user")]
    assert [s[:2] for s in rows["steps"]] == [("session:initiator", "t1")]
    opened = got.lease.opened
    assert opened is not None and [i for i, _ in opened.messages] == [0] and [e.seq for e in opened.events] == [1]
    assert [s.step_id for s in opened.steps] == ["session:initiator"]
    assert got.lease.snapshot is not None and got.lease.snapshot.messages == []  # the session before the opening
    assert store.events(by_intake) == opened.events


def test_an_intake_opens_a_later_turn_at_the_transcripts_end_and_leaves_a_taken_seat(
    queue: tuple[PostgresStore, SessionQueue],
) -> None:
    from june_worker.engine.loop import opening_commit
    from june_worker.engine.types import InboundEvent, Principal

    store, q = queue
    ref = _ref()
    q.beat("w1", 60)
    first = Principal(id="u-1")
    p1 = TurnPayload(text="hi", event=InboundEvent(source="web", principal=first))
    lease = q.intake(ref, "t1", p1, "w1", opening=opening_commit("t1", p1, first)).lease
    assert lease is not None and lease.opened is not None
    store.commit(ref, _ending("t1"), fence=lease.fence)
    assert q.release(ref, lease.fence)
    other = Principal(id="u-2")
    p2 = TurnPayload(text="again", event=InboundEvent(source="web", principal=other))
    second = q.intake(ref, "t2", p2, "w1", opening=opening_commit("t2", p2, other)).lease
    assert second is not None and second.opened is not None
    assert [i for i, _ in second.opened.messages] == [1] and second.opened.steps == []  # the seat is u-1's
    assert [e.seq for e in second.opened.events] == [3]  # after t1's started and completed
    rows = _rows(store, ref)
    assert [m[:2] for m in rows["messages"]] == [(0, "t1"), (1, "t2")]
    assert [(s[0], s[1]) for s in rows["steps"]] == [("session:initiator", "t1")]
    assert '"u-1"' in rows["steps"][0][2]


def test_an_intake_does_not_open_a_turn_that_is_not_the_next_to_run(
    queue: tuple[PostgresStore, SessionQueue],
) -> None:
    from june_worker.engine.loop import opening_commit

    store, q = queue
    ref = _ref()
    q.beat("w1", 60)
    p1, p2 = TurnPayload(text="one"), TurnPayload(text="two")
    first = q.intake(ref, "t1", p1, "w1")  # recorded and leased, not opened (the runner would open it)
    assert first.lease is not None and first.lease.opened is None
    # t1 is still unfinished: t2 is recorded behind it, and the lease (ours) comes with t1, not opened here
    second = q.intake(ref, "t2", p2, "w1", opening=opening_commit("t2", p2, None))
    assert second.recorded and second.lease is not None and second.lease.opened is None
    assert second.lease.turn is not None and second.lease.turn.turn_id == "t1"
    rows = _rows(store, ref)
    assert rows["messages"] == [] and rows["events"] == [] and rows["session"][0][:2] == ("new", 0)
    assert [t[:2] for t in rows["turns"]] == [("t1", "queued"), ("t2", "queued")]


def test_an_intake_does_not_open_a_turn_behind_a_pending_reset(queue: tuple[PostgresStore, SessionQueue]) -> None:
    from june_worker.engine.loop import opening_commit

    store, q = queue
    ref = _ref()
    q.beat("w1", 60)
    q.request_reset(ref)  # the holder performs the reset first, then runs (and opens) what queued behind it
    payload = TurnPayload(text="after the reset")
    got = q.intake(ref, "t1", payload, "w1", opening=opening_commit("t1", payload, None))
    assert got.recorded and got.lease is not None and got.lease.reset_pending and got.lease.opened is None
    rows = _rows(store, ref)
    assert rows["messages"] == [] and rows["events"] == [] and [t[:2] for t in rows["turns"]] == [("t1", "queued")]


def test_intake_under_a_live_holder_records_the_turn_and_leaves_it_to_the_holder(
    queue: tuple[PostgresStore, SessionQueue],
) -> None:
    _, q = queue
    ref = _ref()
    q.beat("holder", 60)
    q.beat("other", 60)
    lease = q.take(ref, "holder")
    assert lease is not None and lease.turn is None
    got = q.intake(ref, "t1", TurnPayload(text="hi"), "other")
    assert got.recorded and got.lease is None
    outcome, rec, *_ = q.release_or_next(ref, lease.fence)  # the holder cannot let go: the turn is its to run
    assert outcome == "next" and rec is not None and rec.turn_id == "t1"


def test_intake_does_not_record_a_turn_it_already_has_and_reruns_an_unfinished_one(
    queue: tuple[PostgresStore, SessionQueue],
) -> None:
    store, q = queue
    ref = _ref()
    q.beat("w1", 60)
    first = q.intake(ref, "t1", TurnPayload(text="hi"), "w1")
    assert first.lease is not None
    q.release(ref, first.lease.fence, force=True)  # the worker died, say; the turn is still queued
    again = q.intake(ref, "t1", TurnPayload(text="a different text"), "w1")
    assert not again.recorded and again.existing is not None and again.existing.payload.text == "hi"
    assert again.lease is not None and again.lease.turn is not None and again.lease.turn.turn_id == "t1"
    assert [t.turn_id for t in store.unfinished_turns(ref)] == ["t1"]


def test_intake_of_a_finished_turn_takes_no_lease(queue: tuple[PostgresStore, SessionQueue]) -> None:
    store, q = queue
    ref = _ref()
    q.beat("w1", 60)
    lease = q.intake(ref, "t1", TurnPayload(text="hi"), "w1").lease
    assert lease is not None
    store.commit(ref, _ending("t1"), fence=lease.fence)
    assert q.release(ref, lease.fence)
    again = q.intake(ref, "t1", TurnPayload(text="hi"), "w1")
    assert not again.recorded and again.lease is None
    assert again.existing is not None and again.existing.status == "completed"


def test_intake_records_nothing_while_another_turn_is_parked(queue: tuple[PostgresStore, SessionQueue]) -> None:
    store, q = queue
    ref = _ref()
    q.beat("w1", 60)
    lease = q.intake(ref, "t1", TurnPayload(text="refund"), "w1").lease
    assert lease is not None
    store.commit(
        ref,
        Commit(
            suspended=SuspendedCheckpoint(
                turn_id="t1", request=InputRequest(id="ok", prompt="approve?"), call_id="c1", opening_text="refund"
            ),
            status="suspended",
            turn_id="t1",
            turn_status="suspended",
        ),
        fence=lease.fence,
    )
    assert q.release(ref, lease.fence)
    got = q.intake(ref, "t2", TurnPayload(text="next"), "w1")
    assert not got.recorded and got.lease is None and got.existing is None
    assert got.parked is not None and got.parked.turn_id == "t1"
    assert store.get_turn(ref, "t2") is None


def test_a_turn_recorded_by_an_intake_while_the_holder_releases_is_never_stranded(
    queue: tuple[PostgresStore, SessionQueue], fresh_db: str
) -> None:
    # Given a holder with an empty queue, and an intake statement that ran but has not committed
    _, q = queue
    ref = _ref()
    q.beat("holder", 60)
    q.beat("other", 60)
    lease = q.take(ref, "holder")
    assert lease is not None and lease.turn is None
    intake = psycopg.connect(fresh_db)
    intake.execute(_INTAKE, _intake_params(ref, "t_late", "other"))
    # When the holder releases (its statement's snapshot cannot see the turn) and the intake commits
    outcome: list[object] = []
    releasing = threading.Thread(target=lambda: outcome.append(q.release_or_next(ref, lease.fence)))
    releasing.start()
    wait_for(lambda: _waits_on_a_lock(fresh_db, "released as"), what="the release to wait on the session row")
    intake.commit()
    intake.close()
    releasing.join(10)
    # Then the holder keeps the lease and runs the turn
    assert outcome and outcome[0][0] == "next"  # type: ignore[index]
    again = q.release_or_next(ref, lease.fence)
    assert again[0] == "next" and again[1] is not None and again[1].turn_id == "t_late"


def test_intake_reads_the_session_with_the_lease(queue: tuple[PostgresStore, SessionQueue]) -> None:
    store, q = queue
    ref = _ref()
    q.beat("w1", 60)
    lease = q.intake(ref, "t1", TurnPayload(text="hi"), "w1").lease
    assert lease is not None and lease.snapshot == store.load(ref)  # a new session: empty
    store.commit(ref, _opening("t1"), fence=lease.fence)
    _, released = store.commit_releasing(ref, _ending("t1"), fence=lease.fence)
    assert released
    again = q.intake(ref, "t2", TurnPayload(text="more"), "w1").lease
    assert again is not None and again.snapshot == store.load(ref)
    assert [m.turn_id for m in again.snapshot.messages] == ["t1"] and again.snapshot.event_seq == 2


def test_an_intake_taking_the_lease_as_its_holder_lets_go_reads_what_the_holder_committed(
    queue: tuple[PostgresStore, SessionQueue], fresh_db: str
) -> None:
    # Given a holder whose turn's last commit (it gives the lease up) runs in a transaction held open
    store, q = queue
    ref = _ref()
    q.beat("holder", 60)
    q.beat("next", 60)
    lease = q.intake(ref, "t1", TurnPayload(text="hi"), "holder").lease
    assert lease is not None
    store.commit(ref, _opening("t1"), fence=lease.fence)
    holder = psycopg.connect(fresh_db)
    sql, params = commit_statement(ref, _ending("t1"), lease.fence, release=True)
    assert holder.execute(sql, params).fetchone() == (2, True)
    # When another worker's intake starts (its snapshot misses that commit) and the holder then commits
    got: list[Intake] = []
    intake = threading.Thread(target=lambda: got.append(q.intake(ref, "t2", TurnPayload(text="next"), "next")))
    intake.start()
    wait_for(lambda: _waits_on_a_lock(fresh_db, "june_intake("), what="the intake to wait on the session row")
    holder.commit()
    holder.close()
    intake.join(10)
    # Then it takes the lease with the session as the holder left it: t1 ended, t2 next
    assert got and got[0].recorded and got[0].lease is not None
    taken = got[0].lease
    assert taken.snapshot == store.load(ref) and taken.snapshot.status == "done" and taken.event_seq == 2
    assert taken.turn is not None and taken.turn.turn_id == "t2"


def test_an_intake_that_saw_the_lease_free_leaves_it_to_a_worker_that_took_it_meanwhile(
    queue: tuple[PostgresStore, SessionQueue], fresh_db: str
) -> None:
    # Given a session nobody holds, and another worker taking its lease in a transaction held open
    store, q = queue
    ref = _ref()
    q.beat("other", 60)
    q.beat("late", 60)
    store.commit(ref, _opening("t1"))
    other = psycopg.connect(fresh_db)
    other.execute(
        "update june_sessions set lease_owner = 'other', lease_expires = extract(epoch from now()) + 60,"
        " fence = fence + 1 where agent = %s and session = %s returning fence",
        (ref.agent, ref.session),
    )
    # When an intake starts (its snapshot sees the lease free) and that worker then commits
    got: list[Intake] = []
    intake = threading.Thread(target=lambda: got.append(q.intake(ref, "t2", TurnPayload(text="next"), "late")))
    intake.start()
    wait_for(lambda: _waits_on_a_lock(fresh_db, "june_intake("), what="the intake to wait on the session row")
    other.commit()
    other.close()
    intake.join(10)
    # Then the intake records its turn and leaves the lease where it is: the row changed since its snapshot
    assert got and got[0].recorded and got[0].lease is None
    assert q.release_or_next(ref, 1)[0] == "next"  # still other's lease (fence 1): it runs the new turn


# --- the turn's last commit gives the lease up in the same statement -----------------------------------


def _opening(turn_id: str) -> Commit:
    return Commit(
        messages=[(0, UserMessage(turn_id=turn_id, text="hi"))],
        events=[TurnStarted(turn_id=turn_id, trigger=ProactiveTrigger(by="test"))],
        status="running",
        turn_id=turn_id,
        turn_status="running",
    )


def _ending(turn_id: str) -> Commit:
    result = Completed(turn_id=turn_id, text="done")
    return Commit(
        events=[TurnCompleted(turn_id=turn_id, text="done")],
        status="done",
        turn_id=turn_id,
        turn_status="completed",
        turn_result=result,
    )


def _waits_on_a_lock(url: str, query_part: str) -> bool:
    with psycopg.connect(url, autocommit=True) as admin:
        rows = admin.execute(
            "select 1 from pg_stat_activity where wait_event_type = 'Lock' and query like %s", (f"%{query_part}%",)
        ).fetchall()
    return bool(rows)


def test_the_last_commit_releases_the_lease_when_nothing_else_is_queued(
    queue: tuple[PostgresStore, SessionQueue],
) -> None:
    store, q = queue
    ref = _ref()
    q.beat("w1", 60)
    q.beat("w2", 60)
    lease = q.intake(ref, "t1", TurnPayload(text="hi"), "w1").lease
    assert lease is not None
    events, released = store.commit_releasing(ref, _ending("t1"), fence=lease.fence)
    assert released and [e.type for e in events] == ["turn.completed"] and events[0].seq == 1
    rec = store.get_turn(ref, "t1")
    assert rec is not None and rec.status == "completed" and rec.result is not None
    assert q.take(ref, "w2") is not None  # free for anyone


def test_the_last_commit_keeps_the_lease_while_another_turn_is_queued(
    queue: tuple[PostgresStore, SessionQueue],
) -> None:
    store, q = queue
    ref = _ref()
    q.beat("w1", 60)
    lease = q.intake(ref, "t1", TurnPayload(text="hi"), "w1").lease
    assert lease is not None
    assert q.intake(ref, "t2", TurnPayload(text="next"), "w2").lease is None  # w2 is not alive: no matter, held
    _, released = store.commit_releasing(ref, _ending("t1"), fence=lease.fence)
    assert not released
    outcome, rec, *_ = q.release_or_next(ref, lease.fence)
    assert outcome == "next" and rec is not None and rec.turn_id == "t2"


def test_the_last_commit_of_a_fenced_off_holder_writes_nothing_and_releases_nothing(
    queue: tuple[PostgresStore, SessionQueue],
) -> None:
    store, q = queue
    ref = _ref()
    q.beat("w1", 0.2)
    q.beat("w2", 60)
    old = q.intake(ref, "t1", TurnPayload(text="hi"), "w1").lease
    assert old is not None
    new = wait_for(lambda: q.take(ref, "w2"), timeout_s=5, what="the takeover of a dead holder's lease")
    with pytest.raises(LeaseLostError):
        store.commit_releasing(ref, _ending("t1"), fence=old.fence)
    assert store.events(ref) == [] and q.renew(ref, new.fence)  # the new holder still holds it


def test_a_turn_recorded_while_the_last_commit_releases_is_never_stranded(
    queue: tuple[PostgresStore, SessionQueue], fresh_db: str
) -> None:
    # Given a holder about to commit its turn's end, and an intake that recorded a turn but has not committed
    store, q = queue
    ref = _ref()
    q.beat("holder", 60)
    lease = q.intake(ref, "t1", TurnPayload(text="hi"), "holder").lease
    assert lease is not None
    intake = psycopg.connect(fresh_db)
    intake.execute(_INTAKE, _intake_params(ref, "t_late", "other"))
    # When the last commit runs (its snapshot cannot see the new turn) and the intake then commits
    outcome: list[tuple[list[TurnEvent], bool]] = []
    ending = threading.Thread(
        target=lambda: outcome.append(store.commit_releasing(ref, _ending("t1"), fence=lease.fence))
    )
    ending.start()
    wait_for(lambda: _waits_on_a_lock(fresh_db, "update june_sessions s set event_seq"), what="the commit to wait")
    intake.commit()
    intake.close()
    ending.join(10)
    # Then the commit applied, but the holder kept the lease and runs the new turn
    assert outcome and outcome[0][1] is False and [e.type for e in outcome[0][0]] == ["turn.completed"]
    again = q.release_or_next(ref, lease.fence)
    assert again[0] == "next" and again[1] is not None and again[1].turn_id == "t_late"


class _Recording(psycopg.Connection[Any]):
    """A connection that keeps the statements it runs, to EXPLAIN exactly what a SessionQueue method sent."""

    statements: ClassVar[list[tuple[Any, Any]]] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        self.statements.append((query, params))
        return super().execute(query, params, **kwargs)


def _scans(node: dict[str, Any]) -> list[tuple[str, str | None, str | None]]:
    """(node type, relation, index) of every node of an EXPLAIN (FORMAT JSON) plan."""
    found = [(node["Node Type"], node.get("Relation Name"), node.get("Index Name"))]
    for child in node.get("Plans", []):
        found += _scans(child)
    return found


def test_the_sweeper_finds_pending_resets_along_an_index_not_by_reading_every_session(fresh_db: str) -> None:
    # Given many sessions, one of them with a reset pending and nobody holding it
    PostgresStore(fresh_db).close()  # migrated
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute(
            "insert into june_sessions (agent, session) select 'bulk', 'b-' || i from generate_series(1, 20000) i"
        )
        conn.execute("insert into june_sessions (agent, session, reset_pending) values ('bulk', 'pending', true)")
        conn.execute("analyze june_sessions")
    pool = ConnectionPool(fresh_db, connection_class=_Recording, min_size=1, max_size=1, open=True)
    try:
        # When the sweeper asks for the sessions whose reset is pending
        _Recording.statements.clear()
        found = SessionQueue(pool, lease_s=30).pending_resets(limit=100)
        # Then it finds that one, along the partial index on reset_pending, without a scan of every session
        assert [r for r in found if r.agent == "bulk"] == [SessionRef("bulk", "pending")]
        (query, params), *_ = [s for s in _Recording.statements if "reset_pending" in str(s[0])]
        with pool.connection() as conn:
            row = conn.execute("explain (format json) " + str(query), params).fetchone()
        assert row is not None
        scans = _scans(row[0][0]["Plan"])
        assert ("Seq Scan", "june_sessions", None) not in scans, scans
        assert any(index == "june_sessions_reset_pending" for _kind, _rel, index in scans), scans
    finally:
        pool.close()


def test_each_pick_of_a_turn_counts_a_start_until_max_attempts_and_says_whether_it_did(
    queue: tuple[PostgresStore, SessionQueue],
) -> None:
    store, q = queue
    q.max_attempts = 2
    ref = _ref()
    q.beat("w1", 60)
    store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    picks = []
    for _ in range(3):  # each holder dies before the runner writes anything; the next one takes over
        lease = q.take(ref, "w1")
        assert lease is not None and lease.turn is not None
        picks.append((lease.turn.attempts, lease.counted))
    assert picks == [(0, True), (1, True), (2, False)]  # the count before each pick; the third is the runner's poison
    rec = store.get_turn(ref, "t1")
    assert rec is not None and (rec.status, rec.attempts) == ("queued", 2)
    # release_or_next counts the turn it hands on the same way
    outcome, turn, _, counted = q.release_or_next(ref, q.take(ref, "w1").fence)  # type: ignore[union-attr]
    assert (outcome, turn is not None and turn.turn_id, counted) == ("next", "t1", False)
    other = _ref()
    store.enqueue_turn(other, "t1", TurnPayload(text="hi"))
    store.enqueue_turn(other, "t2", TurnPayload(text="next"))
    lease = q.take(other, "w1")
    assert lease is not None and lease.counted
    done = Completed(turn_id="t1", text="ok")
    store.commit(other, Commit(turn_id="t1", turn_status="completed", turn_result=done), fence=lease.fence)
    outcome, turn, _, counted = q.release_or_next(other, lease.fence)
    assert (outcome, turn is not None and turn.turn_id, counted) == ("next", "t2", True)
    rec = store.get_turn(other, "t2")
    assert rec is not None and rec.attempts == 1


def test_a_heartbeat_never_waits_on_a_session_row_another_transaction_holds(
    queue: tuple[PostgresStore, SessionQueue], fresh_db: str
) -> None:
    store, q = queue
    held, free = _ref(), _ref()
    for ref in (held, free):
        store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    with psycopg.connect(fresh_db) as other:
        # Given a transaction holding one session's row (a reset archiving a long transcript, say)
        other.execute(
            "update june_sessions set event_seq = 3 where agent = %s and session = %s", (held.agent, held.session)
        )
        with psycopg.connect(fresh_db, autocommit=True) as conn:
            conn.execute(
                "update june_sessions set event_seq = 3 where agent = %s and session = %s", (free.agent, free.session)
            )
        # When this worker beats, with relay marks for both sessions
        beat = threading.Thread(target=q.beat, args=("w1", 60), kwargs={"relayed": {held: 3, free: 3}}, daemon=True)
        beat.start()
        beat.join(20)
        # Then the beat went through at once: its liveness is renewed and the free session marked; the held one is
        # left for the sweeper (waiting on it would have let the liveness lapse and other workers take the leases)
        hung = beat.is_alive()
        other.rollback()
        beat.join(20)
        assert not hung, "the heartbeat waited for another transaction's session row"
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        marks = dict(conn.execute("select session, relayed_seq from june_sessions where session in (%s, %s)",
                                  (held.session, free.session)).fetchall())  # fmt: skip
        alive = conn.execute("select count(*) from june_workers where owner = 'w1'").fetchone()
    assert marks == {held.session: 0, free.session: 3} and alive == (1,)


# --- what a step costs the session row (migration 16) ----------------------------------------------------


def _step(turn_id: str, n: int) -> Commit:
    """A model step's checkpoint: its reply, its memo, its event; no status, park or lease change."""
    return Commit(
        messages=[(n, AssistantMessage(turn_id=turn_id, text=f"step {n}"))],
        steps=[StepRecord(step_id=f"model:{n}", turn_id=turn_id, data={"text": f"step {n}"})],
        events=[MessageCompleted(turn_id=turn_id, step=f"model:{n}", text=f"step {n}")],
    )


def _session_row_updates(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(updates, HOT updates) of june_sessions so far, this backend's own counts flushed first."""
    conn.execute("select pg_stat_force_next_flush()")  # flushed as the backend goes idle after this statement
    row = conn.execute(
        "select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables where relname = 'june_sessions'"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_a_plain_steps_update_of_its_session_row_is_hot(database_url: str) -> None:
    # Given a database of this test's own (no other backend's counts) and a store on ONE connection, so the
    # counts this test reads are its own commits'
    for url in _database(database_url):
        store = PostgresStore(url, max_size=1)
        try:
            q = SessionQueue(store.pool, lease_s=30)
            ref = _ref()
            q.beat("w1", 60)
            lease = q.intake(ref, "t1", TurnPayload(text="hi"), "w1").lease
            assert lease is not None
            store.commit(ref, _opening("t1"), fence=lease.fence)
            with store.pool.connection() as conn:
                before = _session_row_updates(conn)
            # When the turn commits twenty plain steps
            for n in range(1, 21):
                store.commit(ref, _step("t1", n), fence=lease.fence)
            with store.pool.connection() as conn:
                after = _session_row_updates(conn)
            # Then each one updated the session row in place: no new entry in any of its indexes
            assert (after[0] - before[0], after[1] - before[1]) == (20, 20)
            _, released = store.commit_releasing(ref, _ending("t1"), fence=lease.fence)
            assert released
        finally:
            store.close()


def _relay_due(url: str, ref: SessionRef) -> tuple[bool, int, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "select relay_due, event_seq, relayed_seq from june_sessions where agent = %s and session = %s",
            (ref.agent, ref.session),
        ).fetchone()
    assert row is not None
    return bool(row[0]), int(row[1]), int(row[2])


def test_the_relay_flag_is_set_by_events_kept_while_held_and_cleared_once_the_stream_has_them(
    queue: tuple[PostgresStore, SessionQueue], fresh_db: str
) -> None:
    store, q = queue
    ref = _ref()
    q.beat("w1", 60)
    lease = q.intake(ref, "t1", TurnPayload(text="hi"), "w1").lease
    assert lease is not None
    # Given a turn whose commits put events in the outbox
    store.commit(ref, _opening("t1"), fence=lease.fence)
    store.commit(ref, _step("t1", 1), fence=lease.fence)
    assert _relay_due(fresh_db, ref) == (True, 2, 0)
    # When its holder's heartbeat marks what it published, while it still holds the session
    q.beat("w1", 60, relayed={ref: 2})
    # Then the mark moves and the flag stays (the next step would set it again: both updates stay HOT)
    assert _relay_due(fresh_db, ref) == (True, 2, 2)
    assert ref not in [r for r, _ in q.unrelayed(limit=100)]  # held by a live worker: its own to relay
    # When the turn ends (the lease released) and the holder dies before marking the last event
    _, released = store.commit_releasing(ref, _ending("t1"), fence=lease.fence)
    assert released
    # Then the sweeper's candidates hold it, with its committed count
    assert (ref, 3) in q.unrelayed(limit=100)
    # When a mark for what is already marked comes (a stream found complete up to an older mark)
    q.mark_relayed([(ref, 2)])
    assert _relay_due(fresh_db, ref) == (True, 3, 2)  # the outbox is still ahead: still due
    q.mark_relayed([(ref, 3)])
    # Then a mark that reaches the outbox clears it, and the sweeper no longer looks at the session
    assert _relay_due(fresh_db, ref) == (False, 3, 3)
    assert ref not in [r for r, _ in q.unrelayed(limit=100)]
    # A heartbeat's mark of a session nobody holds clears it as well
    lease = q.intake(ref, "t2", TurnPayload(text="again"), "w1").lease
    assert lease is not None
    store.commit_releasing(ref, _ending("t2"), fence=lease.fence)
    assert _relay_due(fresh_db, ref) == (True, 4, 3)
    q.beat("w1", 60, relayed={ref: 4})
    assert _relay_due(fresh_db, ref) == (False, 4, 4)
