"""Retention (issue 11): after the retention periods and a sweep, storage holds only what the knobs say.

Two stacks, each with the knobs of its own:

* ``short``: relayed outbox events, ended turns and archived generations kept one second, a quiet
  session's Redis keys a few seconds. What is past retention goes; what a turn still needs stays
  (the transcript, a parked turn with its events, a turn whose delivery is still due); a follower
  catches up on the stream while it lives, and after the keys expired it goes on from where it was,
  or is told what it lacks.
* ``window``: the outbox and ended turns kept an hour, archived generations one second. Once a sweep
  pruned the archives, everything inside the window is still there, and the store answers with it.

Every "a sweep ran since" is shown by rows a sweep deleted, never by waiting a while.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from june_worker.engine.store import SessionRef
from june_worker.stores.postgres import PostgresStore
from producers import StreamGapError

from .conftest import Stack, _database, wait_for

pytestmark = pytest.mark.integration

STREAM_TTL_S = 8


def _stack(database_url: str, redis_url: str, tmp: Path, knobs: dict[str, str]) -> Iterator[Stack]:
    db = _database(database_url)
    url = next(db)
    try:
        PostgresStore(url).close()
        stack = Stack(url, redis_url, tmp)
        stack.sql("create table it_orders (turn_id text not null, call_id text not null, item text, qty integer)")
        stack.env.update(knobs)
        stack.worker("kept", concurrency=1)
        stack.beat()
        try:
            yield stack
        finally:
            stack.stop()
    finally:
        db.close()


@pytest.fixture
def short(database_url: str, redis_url: str, tmp_path: Path) -> Iterator[Stack]:
    knobs = {
        "JUNE_OUTBOX_RETENTION_S": "1",
        "JUNE_TURN_RETENTION_S": "1",
        "JUNE_ARCHIVE_RETENTION_S": "1",
        "JUNE_STREAM_TTL_S": str(STREAM_TTL_S),
        "JUNE_DELIVERY_ATTEMPTS": "1000",  # a broken target's turn stays due for delivery throughout
    }
    yield from _stack(database_url, redis_url, tmp_path, knobs)


@pytest.fixture
def window(database_url: str, redis_url: str, tmp_path: Path) -> Iterator[Stack]:
    knobs = {"JUNE_OUTBOX_RETENTION_S": "3600", "JUNE_TURN_RETENTION_S": "3600", "JUNE_ARCHIVE_RETENTION_S": "1"}
    yield from _stack(database_url, redis_url, tmp_path, knobs)


def _count(stack: Stack, table: str, session: str) -> int:
    return int(stack.sql(f"select count(*) from {table} where session = %s", session)[0][0])  # noqa: S608


def _session(name: str) -> str:
    return f"ret-{name}-{uuid.uuid4().hex[:6]}"


def _run(stack: Stack, session: str, text: str, **fields: Any) -> str:
    turn_id = stack.turn("ops", session, text, **fields)
    assert stack.wait_terminal("ops", session, turn_id)["type"] in ("turn.completed", "input.requested")
    return turn_id


def test_after_the_retention_periods_a_sweep_leaves_only_what_the_knobs_keep(short: Stack) -> None:
    stack = short
    session, parked_session, due_session, clock = (_session(n) for n in ("main", "parked", "due", "clock"))
    turns = []
    for n in range(1, 11):
        turns.append(_run(stack, session, f"order {n} bolt"))
        if n == 5:
            assert stack.send("june.reset", {"agent": "ops", "session": session}).get(timeout=30)["status"] == "reset"
    committed = int(stack.sql("select event_seq from june_sessions where session = %s", session)[0][0])
    early_id = next(e["id"] for e in stack.structural("ops", session) if e["seq"] == 3)
    # A turn with a target parks on an approval; another's delivery keeps failing, so it stays due
    slack = {"source": "slack", "user": {"id": "U1", "attested": True}}
    parked = _run(stack, parked_session, "refund", event=slack, target={"channel": "C-ops"})
    before_park = [e["type"] for e in stack.structural("ops", parked_session)]
    due = _run(stack, due_session, "order 1 nut", target={"channel": "broken"})
    wait_for(lambda: stack.redis.llen(f"it:delivery-failed:{due_session}"), what="a failed delivery")
    # and a later turn elsewhere, whose events' pruning shows a sweep ran once all of the above were past retention
    _run(stack, clock, "hello")

    # The sweeper prunes what is past retention: relayed events, ended turns with their steps, archives.
    wait_for(
        lambda: (
            _count(stack, "june_events", clock) == 0
            and _count(stack, "june_events", session) == 0
            and _count(stack, "june_turns", session) == 0
            and _count(stack, "june_archived_messages", session) == 0
            and _count(stack, "june_archived_steps", session) == 0
        ),
        timeout_s=30,
        what="the sweeper to prune the sessions",
    )
    assert stack.sql("select step_id from june_steps where session = %s", session) == []
    # What is still needed stays: the live transcript (generation 1: five turns of four messages), every
    # order written once, the parked turn with its checkpoint and its events, the turn still due with its events.
    assert _count(stack, "june_messages", session) == 20
    assert stack.sql("select count(*) from it_orders where turn_id = any(%s)", turns) == [(10,)]
    assert stack.turn_row("ops", parked_session, parked)["status"] == "suspended"  # type: ignore[index]
    assert stack.sql("select suspended is not null from june_sessions where session = %s", parked_session) == [(True,)]
    assert _count(stack, "june_events", parked_session) == len(before_park) == 4
    assert stack.sql("select deliver_due from june_turns where turn_id = %s", due) == [(True,)]
    assert _count(stack, "june_events", due_session) == len(stack.structural("ops", due_session))

    # The parked turn, answered after its events passed the outbox's retention, is delivered with its whole history
    answer = {"agent": "ops", "session": parked_session, "turn_id": parked, "input_id": "approve-refund"}
    assert stack.send("june.resume", {**answer, "value": True, "by": "op-a"}).get(timeout=30)["status"] == "accepted"
    rendered = f"it:delivered-events:{parked_session}"  # a delivery when it parked (the prompt), one when it ended
    wait_for(lambda: stack.redis.llen(rendered) == 2, what="the delivery of the answered turn")
    history = stack.redis.lindex(rendered, 1).split(",")
    assert history[: len(before_park)] == before_park and history[-1] == "turn.completed"

    # A follower catches up on the whole stream while the session's keys live.
    assert [e["seq"] for e in stack.structural("ops", session)] == list(range(1, committed + 1))
    tip_id = stack.events("ops", session)[-1]["id"]
    with stack.producer() as producer:
        followed = [e.data["seq"] for e in producer.follow("ops", session, turn_id=turns[-1]) if "seq" in e.data]
    assert followed and followed[-1] == committed

    # Once the session was quiet for the keys' time to live, its Redis keys and firehose field are gone.
    wait_for(
        lambda: not stack.redis.exists(stack.stream_key("ops", session), f"{stack.prefix}:relayed:{{ops:{session}}}"),
        timeout_s=STREAM_TTL_S + 20,
        what="the session's Redis keys to expire",
    )
    marker = f"{stack.prefix}:firehose:relayed:{{{stack.prefix}:events:all:0}}"
    wait_for(lambda: not stack.redis.hexists(marker, f"ops:{session}"), timeout_s=20, what="the firehose field to go")
    # The session goes on: a new turn rebuilds its stream from what the store still holds.
    after = _run(stack, session, "order 11 bolt")
    with stack.producer() as producer:
        # A follower that held everything goes on from its id of the old stream, missing nothing
        went_on = [e.seq for e in producer.follow("ops", session, turn_id=after, last_id=tip_id, last_seq=committed)]
        assert [s for s in went_on if s is not None][0] == committed + 1
        # and one that was behind is told what it lacks, and where the stream goes on
        with pytest.raises(StreamGapError) as raised:
            list(producer.follow("ops", session, turn_id=after, last_id=early_id, last_seq=3, timeout_s=0))
    assert (raised.value.first_missing_seq, raised.value.next_seq) == (4, committed + 1)


def test_inside_the_retention_windows_nothing_is_pruned_and_the_store_answers(window: Stack) -> None:
    stack = window
    session = _session("window")
    turns = []
    for n in range(1, 5):
        turns.append(_run(stack, session, f"order {n} washer"))
        if n == 2:
            assert stack.send("june.reset", {"agent": "ops", "session": session}).get(timeout=30)["status"] == "reset"
    committed = int(stack.sql("select event_seq from june_sessions where session = %s", session)[0][0])
    steps = _count(stack, "june_steps", session)
    assert _count(stack, "june_archived_messages", session) > 0 and steps > 0

    # A sweep ran once the archives were past their second of retention: they are gone
    wait_for(
        lambda: _count(stack, "june_archived_messages", session) + _count(stack, "june_archived_steps", session) == 0,
        timeout_s=30,
        what="the sweeper to prune the archived generation",
    )
    # while the outbox and the ended turns, kept an hour, are whole
    assert stack.sql("select seq from june_events where session = %s order by seq", session) == [
        (s,) for s in range(1, committed + 1)
    ]
    assert _count(stack, "june_turns", session) == 4 and _count(stack, "june_steps", session) == steps
    # And the store (what the gateway's /log reads) answers from any seq inside the window
    store = PostgresStore(stack.db_url, migrate=False)
    try:
        ref = SessionRef("ops", session)
        assert [e.seq for e in store.events(ref)] == list(range(1, committed + 1))
        assert [e.seq for e in store.events(ref, after_seq=3)] == list(range(4, committed + 1))
    finally:
        store.close()
    # And a follower from the start catches up on every event
    with stack.producer() as producer:
        followed = [e.seq for e in producer.follow("ops", session, timeout_s=0) if not e.delta]
    assert followed == list(range(1, committed + 1))
