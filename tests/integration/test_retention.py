"""Retention (issue 11): after the retention periods and a sweep, storage holds only what the knobs say.

This module's workers keep relayed outbox events, ended turns and archived generations for one
second, and a quiet session's Redis keys for a few seconds. A follower still catches up on the
whole stream while it lives; the transcript is never pruned; a parked turn is kept.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from june_worker.stores.postgres import PostgresStore

from .conftest import Stack, _database, wait_for

pytestmark = pytest.mark.integration

STREAM_TTL_S = 8


@pytest.fixture(scope="module")
def kept(database_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    db = _database(database_url)
    url = next(db)
    try:
        PostgresStore(url).close()
        stack = Stack(url, redis_url, tmp_path_factory.mktemp("retention"))
        stack.sql("create table it_orders (turn_id text not null, call_id text not null, item text, qty integer)")
        knobs = {
            "JUNE_OUTBOX_RETENTION_S": "1",
            "JUNE_TURN_RETENTION_S": "1",
            "JUNE_ARCHIVE_RETENTION_S": "1",
            "JUNE_STREAM_TTL_S": str(STREAM_TTL_S),
        }
        stack.env.update(knobs)
        stack.worker("kept", pool="prefork", concurrency=1)
        stack.beat()
        try:
            yield stack
        finally:
            stack.stop()
    finally:
        db.close()


def _count(stack: Stack, table: str, session: str) -> int:
    return int(stack.sql(f"select count(*) from {table} where session = %s", session)[0][0])  # noqa: S608


def test_after_the_retention_periods_a_sweep_leaves_only_what_the_knobs_keep(kept: Stack, tmp_path: Path) -> None:
    stack = kept
    session, parked_session = f"ret-{uuid.uuid4().hex[:6]}", f"ret-parked-{uuid.uuid4().hex[:6]}"
    turns = []
    for n in range(1, 11):
        turns.append(stack.turn("ops", session, f"order {n} bolt"))
        assert stack.wait_terminal("ops", session, turns[-1])["type"] == "turn.completed"
        if n == 5:
            assert stack.send("june.reset", {"agent": "ops", "session": session}).get(timeout=30)["status"] == "reset"
    parked = stack.turn(
        "ops", parked_session, "refund", event={"source": "slack", "user": {"id": "U1", "attested": True}}
    )
    assert stack.wait_terminal("ops", parked_session, parked)["type"] == "input.requested"
    committed = int(stack.sql("select event_seq from june_sessions where session = %s", session)[0][0])

    # The sweeper prunes what is past retention: relayed events, ended turns with their steps, archives.
    wait_for(
        lambda: (
            _count(stack, "june_events", session) == 0
            and _count(stack, "june_turns", session) == 0
            and _count(stack, "june_archived_messages", session) == 0
            and _count(stack, "june_archived_steps", session) == 0
        ),
        timeout_s=30,
        what="the sweeper to prune the session",
    )
    assert stack.sql("select step_id from june_steps where session = %s", session) == []
    # What is still needed stays: the live transcript (generation 1: five turns of four messages), every
    # order written once, and the parked turn with its checkpoint.
    assert _count(stack, "june_messages", session) == 20
    assert stack.sql("select count(*) from it_orders where turn_id = any(%s)", turns) == [(10,)]
    assert stack.turn_row("ops", parked_session, parked)["status"] == "suspended"  # type: ignore[index]
    assert stack.sql("select suspended is not null from june_sessions where session = %s", parked_session) == [(True,)]

    # A follower catches up on the whole stream while the session's keys live.
    seqs = [e["seq"] for e in stack.structural("ops", session)]
    assert seqs == list(range(1, committed + 1))
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
    after = stack.turn("ops", session, "order 11 bolt")
    assert stack.wait_terminal("ops", session, after)["type"] == "turn.completed"
