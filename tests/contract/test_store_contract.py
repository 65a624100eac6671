"""The SessionStore contract: one suite, run against every store.

Memory, SQLite (a file and ``:memory:``) and Postgres (a fresh database for this test
session, ``june_test_<random>``, dropped at the end) must behave alike: a commit lands whole
or not at all, a fenced-off or conflicting commit writes nothing, event ``seq`` is
consecutive per session, intake is idempotent, cancel and reset follow the same rules. Where
a store is allowed to differ, the test says so (the memory store cannot roll back a tool's
writes and refuses them).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from june_worker.engine.events import (
    ActionCompleted,
    Completed,
    MessageCompleted,
    Suspended,
    TurnCompleted,
    TurnEvent,
    TurnStarted,
)
from june_worker.engine.store import (
    Commit,
    SessionRef,
    StepRecord,
    StoreHandle,
    SuspendedCheckpoint,
    TurnPayload,
)
from june_worker.engine.types import (
    AssistantMessage,
    InputRequest,
    Message,
    ProactiveTrigger,
    ReasoningBlock,
    SummaryMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from june_worker.errors import (
    FatalToolError,
    LeaseLostError,
    MessageIndexTakenError,
    ResumeConflictError,
    StoreUnavailableError,
)
from june_worker.stores import MemoryStore, PostgresStore, SQLiteStore
from june_worker.stores._sql import message_from_row, message_text, qmark_to_format

pytestmark = pytest.mark.contract

STORES = ["memory", "sqlite-file", "sqlite-memory", "postgres", "postgres-partitioned"]
SQL_STORES = ["sqlite-file", "sqlite-memory", "postgres", "postgres-partitioned"]
PARTITIONS = 4
"""``postgres-partitioned``: the per-session tables hash-partitioned by session (``june migrate --partitions 4``)."""


# --- the stores under test ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_url(database_url: str) -> Iterator[str]:
    """A database of this test session's own, dropped at the end."""
    name = f"june_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f'create database "{name}"')
    try:
        yield psycopg.conninfo.make_conninfo(database_url, dbname=name)
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(f'drop database if exists "{name}" with (force)')


@pytest.fixture(scope="session")
def pg_partitioned_url(database_url: str) -> Iterator[str]:
    """A database of this test session's own whose per-session tables are hash-partitioned, dropped at the end."""
    name = f"june_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f'create database "{name}"')
    try:
        url = psycopg.conninfo.make_conninfo(database_url, dbname=name)
        store = PostgresStore(url, min_size=1, max_size=1)
        try:
            assert store.partition(PARTITIONS) is True
        finally:
            store.close()
        yield url
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(f'drop database if exists "{name}" with (force)')


@dataclass
class Kit:
    """A store and the means to look at what it wrote, store by store."""

    kind: str
    store: Any

    @property
    def is_sql(self) -> bool:
        return self.kind != "memory"

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        """Run ``query`` (``?`` placeholders) outside any store transaction; return its rows."""
        if isinstance(self.store, SQLiteStore):
            return [tuple(r) for r in self.store._conn.execute(query, params).fetchall()]
        assert isinstance(self.store, PostgresStore)
        with self.store.pool.connection() as conn:
            cur = conn.execute(qmark_to_format(query), params, prepare=False)
            return cur.fetchall() if cur.description else []

    def archived(self, ref: SessionRef, generation: int) -> tuple[list[Message], dict[str, Any]]:
        """The messages and step data archived for ``ref`` under ``generation``."""
        if isinstance(self.store, MemoryStore):
            found = [a for a in self.store.archives if a["session"] == ref.key and a["generation"] == generation]
            if not found:
                return [], {}
            (entry,) = found
            return list(entry["messages"]), {k: s.data for k, s in entry["steps"].items()}
        messages = [
            message_from_row(role, turn_id, body)
            for role, turn_id, body in self.sql(
                "select role, turn_id, cast(body as text) from june_archived_messages "
                "where agent = ? and session = ? and generation = ? order by idx",
                ref.agent,
                ref.session,
                generation,
            )
        ]
        steps = {
            step_id: json.loads(data)
            for step_id, data in self.sql(
                "select step_id, cast(data as text) from june_archived_steps "
                "where agent = ? and session = ? and generation = ?",
                ref.agent,
                ref.session,
                generation,
            )
        }
        return messages, steps

    def orders(self, ref: SessionRef) -> list[str]:
        """What the test tool wrote for ``ref``."""
        return [r[0] for r in self.sql("select item from contract_orders where session = ? order by item", ref.key)]


def _make_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite-file":
        return SQLiteStore(tmp_path / "contract.db")
    if kind == "sqlite-memory":
        return SQLiteStore(":memory:")
    if kind == "postgres-partitioned":
        store = PostgresStore(request.getfixturevalue("pg_partitioned_url"), min_size=1, max_size=4)
        assert set(store.partitions().values()) == {PARTITIONS}
        return store
    assert kind == "postgres"
    return PostgresStore(request.getfixturevalue("pg_url"), min_size=1, max_size=4)


@pytest.fixture(params=STORES)
def kit(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Kit]:
    store = _make_store(request.param, request, tmp_path)
    k = Kit(request.param, store)
    if k.is_sql:
        k.sql("create table if not exists contract_orders (session text not null, item text not null)")
    try:
        yield k
    finally:
        store.close()


@pytest.fixture(params=SQL_STORES)
def sql_kit(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Kit]:
    store = _make_store(request.param, request, tmp_path)
    k = Kit(request.param, store)
    k.sql("create table if not exists contract_orders (session text not null, item text not null)")
    try:
        yield k
    finally:
        store.close()


@pytest.fixture
def ref(session_id: str) -> SessionRef:
    return SessionRef("contract", session_id)


# --- builders of commits -----------------------------------------------------------------------------


def started(turn_id: str) -> TurnStarted:
    return TurnStarted(turn_id=turn_id, trigger=ProactiveTrigger(by="test"))


def said(turn_id: str, text: str) -> MessageCompleted:
    return MessageCompleted(turn_id=turn_id, step="model:1", text=text)


def checkpoint(turn_id: str, input_id: str) -> SuspendedCheckpoint:
    return SuspendedCheckpoint(
        turn_id=turn_id,
        request=InputRequest(id=input_id, prompt="approve?", schema={"type": "boolean"}),
        call_id="c1",
        opening_text="refund order 42",
    )


def opening(turn_id: str, index: int = 0, text: str = "hello") -> Commit:
    """What a turn's first checkpoint writes: the opening message, an event, status and turn update."""
    return Commit(
        messages=[(index, UserMessage(turn_id=turn_id, text=text))],
        steps=[StepRecord(step_id=f"open:{turn_id}", turn_id=turn_id, data={"opened": True})],
        events=[started(turn_id)],
        status="running",
        turn_id=turn_id,
        turn_status="running",
    )


def park(store: Any, ref: SessionRef, turn_id: str, input_id: str) -> None:
    store.commit(
        ref,
        Commit(
            status="suspended",
            suspended=checkpoint(turn_id, input_id),
            turn_id=turn_id,
            turn_status="suspended",
            turn_result=Suspended(turn_id=turn_id, request=checkpoint(turn_id, input_id).request),
        ),
    )


def state(store: Any, ref: SessionRef, turn_ids: tuple[str, ...] = ()) -> dict[str, Any]:
    """Everything a reader can see of a session, for before/after comparisons."""
    snap = store.load(ref)
    return {
        "snapshot": snap.model_dump(),
        "events": [e.model_dump() for e in store.events(ref)],
        "pending": store.pending(ref),
        "turns": {t: (r.model_dump() if (r := store.get_turn(ref, t)) else None) for t in turn_ids},
    }


# --- load and commit ---------------------------------------------------------------------------------


def test_an_unknown_session_loads_empty(kit: Kit, ref: SessionRef) -> None:
    snap = kit.store.load(ref)
    assert (snap.status, snap.generation, snap.event_seq) == ("new", 0, 0)
    assert snap.messages == [] and snap.steps == {} and snap.suspended is None
    assert (snap.ref_agent, snap.ref_session) == (ref.agent, ref.session)


def test_a_commit_writes_messages_steps_events_status_and_turn_together(kit: Kit, ref: SessionRef) -> None:
    kit.store.enqueue_turn(ref, "t1", TurnPayload(text="hello"))
    events = kit.store.commit(ref, opening("t1"))
    assert [(e.type, e.seq) for e in events] == [("turn.started", 1)]
    snap = kit.store.load(ref)
    assert snap.messages == [UserMessage(turn_id="t1", text="hello")]
    assert snap.steps == {"open:t1": StepRecord(step_id="open:t1", turn_id="t1", data={"opened": True})}
    assert (snap.status, snap.event_seq) == ("running", 1)
    assert kit.store.events(ref) == events
    turn = kit.store.get_turn(ref, "t1")
    assert turn is not None and (turn.status, turn.attempts) == ("running", 1)


def test_the_first_commit_creates_the_session(kit: Kit, ref: SessionRef) -> None:
    kit.store.commit(ref, Commit(messages=[(0, UserMessage(turn_id="t1", text="hi"))], events=[started("t1")]))
    snap = kit.store.load(ref)
    assert [m.turn_id for m in snap.messages] == ["t1"] and snap.event_seq == 1 and snap.status == "new"


def test_status_changes_only_when_the_commit_sets_it(kit: Kit, ref: SessionRef) -> None:
    kit.store.commit(ref, Commit(status="running"))
    kit.store.commit(ref, Commit(events=[started("t1")]))
    assert kit.store.load(ref).status == "running"
    kit.store.commit(ref, Commit(status="done"))
    assert kit.store.load(ref).status == "done"


def test_steps_are_insert_if_absent(kit: Kit, ref: SessionRef) -> None:
    kit.store.commit(ref, Commit(steps=[StepRecord(step_id="model:1", turn_id="t1", data={"v": 1})]))
    kit.store.commit(
        ref,
        Commit(
            steps=[
                StepRecord(step_id="model:1", turn_id="t2", data={"v": 2}),
                StepRecord(step_id="model:3", turn_id="t2", data=None),
            ]
        ),
    )
    steps = kit.store.load(ref).steps
    assert steps["model:1"] == StepRecord(step_id="model:1", turn_id="t1", data={"v": 1})
    assert steps["model:3"] == StepRecord(step_id="model:3", turn_id="t2", data=None)


def test_the_transcript_keeps_its_order_and_every_value_exactly(kit: Kit, ref: SessionRef) -> None:
    odd = "nul \u0000, newline \n, tab \t, quote \" backslash \\ emoji \U0001f600 percent %s %% ? ' ;"
    messages: list[Message] = [UserMessage(turn_id="t1", text=odd)]
    for i in range(7):  # more rows than fit a small statement: the bulk path of the SQL stores
        call = ToolCall(id=f"c{i}", name="lookup", input={"q": odd, "n": i, "f": 1.5e-7, "big": 2**62})
        messages.append(AssistantMessage(turn_id="t1", text=f"step {i}", tool_calls=[call]))
        messages.append(ToolMessage(turn_id="t1", call_id=f"c{i}", name="lookup", result={"rows": [odd, None, i]}))
    steps = [StepRecord(step_id=f"tool:{i}:c{i}", turn_id="t1", data={"result": odd, "i": i}) for i in range(6)]
    events: list[TurnEvent] = [said("t1", odd + str(i)) for i in range(6)]
    kit.store.commit(ref, Commit(messages=list(enumerate(messages)), steps=steps, events=events))
    snap = kit.store.load(ref)
    assert snap.messages == messages
    assert {s.step_id: s for s in steps} == snap.steps
    assert [e.model_copy(update={"seq": None}) for e in kit.store.events(ref)] == events
    assert [e.seq for e in kit.store.events(ref)] == [1, 2, 3, 4, 5, 6]


def test_a_transcript_row_stores_only_what_its_columns_do_not_and_rows_written_before_still_load(
    sql_kit: Kit, ref: SessionRef
) -> None:
    # the body leaves out the row's role and turn id and every field at its default; reading puts them back
    turn = 'odd "turn" \\ id'
    messages: list[Message] = [
        UserMessage(turn_id=turn, text="hi"),
        AssistantMessage(turn_id=turn),
        AssistantMessage(turn_id=turn, text="look", tool_calls=[ToolCall(id="c1", name="lookup")]),
        ToolMessage(turn_id=turn, call_id="c1", name="lookup", result=False),
    ]
    sql_kit.store.commit(ref, Commit(messages=list(enumerate(messages))))
    rows = sql_kit.sql(
        "select role, turn_id, cast(body as text) from june_messages where agent = ? and session = ? order by idx",
        ref.agent,
        ref.session,
    )
    assert [(role, turn_id) for role, turn_id, _ in rows] == [(m.role, turn) for m in messages]
    assert [body for _, _, body in rows] == [
        '{"text":"hi"}',
        "{}",
        '{"text":"look","tool_calls":[{"id":"c1","name":"lookup"}]}',
        '{"call_id":"c1","name":"lookup","result":false}',
    ]
    # a row as the stores wrote them before (the whole message in the body) loads as it did
    older = AssistantMessage(turn_id="t0", text="before", reasoning=[ReasoningBlock(text="hm")])
    sql_kit.sql(
        "insert into june_messages (agent, session, idx, turn_id, role, body) values (?, ?, 4, 't0', 'assistant', ?)",
        ref.agent,
        ref.session,
        older.model_dump_json(),
    )
    assert sql_kit.store.load(ref).messages == [*messages, older]
    if isinstance(sql_kit.store, PostgresStore):  # the SQL function that puts a row together is _sql's twin
        rows = sql_kit.sql(
            "select role, turn_id, cast(body as text), june_message(role, turn_id, body) from june_messages "
            "where agent = ? and session = ? order by idx",
            ref.agent,
            ref.session,
        )
        assert [whole for *_, whole in rows] == [message_text(role, t, body) for role, t, body, _ in rows]


def test_a_taken_message_index_fails_the_commit_and_writes_nothing(kit: Kit, ref: SessionRef) -> None:
    kit.store.enqueue_turn(ref, "t1", TurnPayload(text="hello"))
    kit.store.commit(ref, opening("t1"))
    before = state(kit.store, ref, ("t1",))
    clash = Commit(
        messages=[(0, AssistantMessage(turn_id="t1", text="second writer"))],
        steps=[StepRecord(step_id="model:0", turn_id="t1", data={})],
        events=[said("t1", "second writer")],
        status="done",
        turn_id="t1",
        turn_status="completed",
        turn_result=Completed(turn_id="t1", text="second writer"),
    )
    with pytest.raises(MessageIndexTakenError, match="message index .*taken"):  # said so, partitioned or not
        kit.store.commit(ref, clash)
    assert state(kit.store, ref, ("t1",)) == before


# --- events --------------------------------------------------------------------------------------------


def test_events_get_consecutive_seq_per_session_independent_across_sessions(kit: Kit, ref: SessionRef) -> None:
    other = SessionRef(ref.agent, ref.session + "-other")
    first = kit.store.commit(ref, Commit(events=[started("t1"), said("t1", "a")]))
    elsewhere = kit.store.commit(other, Commit(events=[started("t9")]))
    second = kit.store.commit(ref, Commit(events=[said("t1", "b"), said("t1", "c"), said("t1", "d")]))
    kit.store.commit(ref, Commit(status="running"))  # no events: the sequence does not move
    third = kit.store.commit(ref, Commit(events=[said("t1", "e")]))
    assert [e.seq for e in first + second + third] == [1, 2, 3, 4, 5, 6]
    assert [e.seq for e in elsewhere] == [1]
    assert [e.seq for e in kit.store.events(ref)] == [1, 2, 3, 4, 5, 6]
    assert kit.store.load(ref).event_seq == 6 and kit.store.load(other).event_seq == 1


def test_events_read_back_in_order_filtered_by_turn_and_after_seq(kit: Kit, ref: SessionRef) -> None:
    kit.store.commit(ref, Commit(events=[started("t1"), said("t1", "a")]))
    kit.store.commit(ref, Commit(events=[started("t2"), said("t2", "b"), said("t1", "late")]))
    assert [(e.turn_id, e.seq) for e in kit.store.events(ref, turn_id="t1")] == [("t1", 1), ("t1", 2), ("t1", 5)]
    assert [e.seq for e in kit.store.events(ref, after_seq=3)] == [4, 5]
    assert [e.seq for e in kit.store.events(ref, turn_id="t2", after_seq=3)] == [4]
    assert kit.store.events(ref, after_seq=5) == []
    assert kit.store.events(SessionRef(ref.agent, "nobody-" + ref.session)) == []


def test_concurrent_commits_get_distinct_consecutive_seq(kit: Kit, ref: SessionRef) -> None:
    barrier = threading.Barrier(4)
    seqs: list[int] = []
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            barrier.wait(timeout=10)
            for i in range(5):
                out = kit.store.commit(ref, Commit(events=[said(f"t{n}", str(i)), said(f"t{n}", str(i))]))
                seqs.extend(e.seq or 0 for e in out)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert sorted(seqs) == list(range(1, 41))
    assert [e.seq for e in kit.store.events(ref)] == list(range(1, 41))


# --- the checkpoint of a parked turn ------------------------------------------------------------------


def test_pending_shows_the_parked_checkpoint_until_it_is_cleared(kit: Kit, ref: SessionRef) -> None:
    assert kit.store.pending(ref) is None
    park(kit.store, ref, "t1", "approve")
    assert kit.store.pending(ref) == checkpoint("t1", "approve")
    snap = kit.store.load(ref)
    assert snap.suspended == checkpoint("t1", "approve") and snap.status == "suspended"
    kit.store.commit(ref, Commit(clear_suspended=True, status="running"))
    assert kit.store.pending(ref) is None and kit.store.load(ref).suspended is None


def test_a_resume_applies_only_when_parked_on_that_turn_and_input(kit: Kit, ref: SessionRef) -> None:
    kit.store.enqueue_turn(ref, "t1", TurnPayload(text="refund"))
    answer = StepRecord(step_id="input:t1:approve", turn_id="t1", data={"answer": True})

    def resume(turn_id: str, input_id: str) -> Commit:
        return Commit(
            steps=[answer],
            events=[said("t1", "resumed")],
            status="running",
            clear_suspended=True,
            turn_id="t1",
            turn_status="running",
            expect_suspended=(turn_id, input_id),
        )

    with pytest.raises(ResumeConflictError):  # not parked at all
        kit.store.commit(ref, resume("t1", "approve"))
    park(kit.store, ref, "t1", "approve")
    before = state(kit.store, ref, ("t1",))
    for wrong in (("t1", "other-input"), ("t2", "approve")):
        with pytest.raises(ResumeConflictError):
            kit.store.commit(ref, resume(*wrong))
        assert state(kit.store, ref, ("t1",)) == before
    kit.store.commit(ref, resume("t1", "approve"))
    assert kit.store.pending(ref) is None and kit.store.load(ref).steps["input:t1:approve"] == answer
    with pytest.raises(ResumeConflictError):  # a racing second resume of the same park
        kit.store.commit(ref, resume("t1", "approve"))


# --- fencing ---------------------------------------------------------------------------------------------


def test_a_stale_fence_is_refused_with_lease_lost_and_writes_nothing(kit: Kit, ref: SessionRef) -> None:
    kit.store.enqueue_turn(ref, "t1", TurnPayload(text="hello"))
    old = kit.store.acquire_fence(ref)
    new = kit.store.acquire_fence(ref)
    assert new > old
    kit.store.commit(ref, opening("t1"), fence=new)
    before = state(kit.store, ref, ("t1",))
    zombie = Commit(
        messages=[(1, AssistantMessage(turn_id="t1", text="zombie"))],
        steps=[StepRecord(step_id="model:1", turn_id="t1", data={})],
        events=[said("t1", "zombie")],
        status="done",
        suspended=checkpoint("t1", "x"),
        turn_id="t1",
        turn_status="completed",
        turn_result=Completed(turn_id="t1", text="zombie"),
    )
    with pytest.raises(LeaseLostError):
        kit.store.commit(ref, zombie, fence=old)
    assert state(kit.store, ref, ("t1",)) == before
    kit.store.commit(ref, zombie, fence=new)  # the holder's own commit still applies
    assert kit.store.load(ref).messages[-1].turn_id == "t1" and kit.store.load(ref).status == "done"


def test_a_fence_on_a_session_nobody_leased_must_be_zero(kit: Kit, ref: SessionRef) -> None:
    with pytest.raises(LeaseLostError):
        kit.store.commit(ref, Commit(events=[started("t1")]), fence=1)
    assert kit.store.events(ref) == []
    assert [e.seq for e in kit.store.commit(ref, Commit(events=[started("t1")]), fence=0)] == [1]


def test_each_acquire_gives_a_greater_fence(kit: Kit, ref: SessionRef) -> None:
    fences = [kit.store.acquire_fence(ref) for _ in range(3)]
    assert fences == sorted(fences) and len(set(fences)) == 3
    other = kit.store.acquire_fence(SessionRef(ref.agent, ref.session + "-b"))
    assert other == 1


# --- turns ------------------------------------------------------------------------------------------------


def test_enqueue_is_idempotent_per_turn_id(kit: Kit, ref: SessionRef) -> None:
    first, created = kit.store.enqueue_turn(ref, "t1", TurnPayload(text="hello"))
    again, created_again = kit.store.enqueue_turn(ref, "t1", TurnPayload(text="a different payload"))
    assert (created, created_again) == (True, False)
    assert again == first and again.payload.text == "hello"
    assert kit.store.get_turn(ref, "t1") == first
    assert [t.turn_id for t in kit.store.unfinished_turns(ref)] == ["t1"]


def test_a_new_turn_record_is_queued_now_in_the_current_generation(kit: Kit, ref: SessionRef) -> None:
    before = time.time()
    rec, _ = kit.store.enqueue_turn(ref, "t1", TurnPayload(text="hi", trigger_by="cron:daily", replace=True))
    after = time.time()
    assert (rec.turn_id, rec.agent, rec.session, rec.status) == ("t1", ref.agent, ref.session, "queued")
    assert (rec.attempts, rec.generation, rec.result, rec.cancel_reason, rec.finished_at) == (0, 0, None, None, None)
    assert rec.payload == TurnPayload(text="hi", trigger_by="cron:daily", replace=True)
    assert before - 5 <= rec.created_at <= after + 5  # the database's clock may differ a little
    assert kit.store.load(ref).status == "new"  # intake does not start the session
    kit.store.reset(ref)
    later, _ = kit.store.enqueue_turn(ref, "t2", TurnPayload(text="after reset"))
    assert later.generation == 1


def test_positions_follow_arrival_order(kit: Kit, ref: SessionRef) -> None:
    ids = ["t_c", "t_a", "t_b", "t_d"]
    recs = [kit.store.enqueue_turn(ref, t, TurnPayload(text=t))[0] for t in ids]
    kit.store.enqueue_turn(ref, "t_a", TurnPayload(text="again"))
    positions = [r.position for r in recs]
    assert positions == sorted(positions) and len(set(positions)) == 4
    assert [t.turn_id for t in kit.store.unfinished_turns(ref)] == ids


def test_unfinished_turns_are_the_queued_and_running_ones_in_order(kit: Kit, ref: SessionRef) -> None:
    for t in ("t1", "t2", "t3", "t4", "t5"):
        kit.store.enqueue_turn(ref, t, TurnPayload(text=t))
    kit.store.enqueue_turn(SessionRef(ref.agent, ref.session + "-other"), "t0", TurnPayload(text="elsewhere"))
    kit.store.commit(ref, Commit(turn_id="t2", turn_status="running"))
    kit.store.commit(ref, Commit(turn_id="t3", turn_status="completed", turn_result=Completed(turn_id="t3", text="")))
    park(kit.store, ref, "t4", "approve")
    kit.store.commit(ref, Commit(clear_suspended=True))
    kit.store.commit(ref, Commit(turn_id="t5", turn_status="cancelled"))
    assert [(t.turn_id, t.status) for t in kit.store.unfinished_turns(ref)] == [("t1", "queued"), ("t2", "running")]


def test_turn_status_and_result_are_written_together_and_none_clears_the_result(kit: Kit, ref: SessionRef) -> None:
    kit.store.enqueue_turn(ref, "t1", TurnPayload(text="refund"))
    kit.store.commit(ref, Commit(turn_id="t1", turn_status="running"))
    parked = Suspended(turn_id="t1", request=checkpoint("t1", "approve").request)
    kit.store.commit(ref, Commit(turn_id="t1", turn_status="suspended", turn_result=parked))
    rec = kit.store.get_turn(ref, "t1")
    assert rec is not None and (rec.status, rec.result, rec.attempts) == ("suspended", parked, 1)
    assert rec.finished_at is not None and rec.finished_at >= rec.created_at - 5
    kit.store.commit(ref, Commit(turn_id="t1", turn_status="running"))  # resumed: the old result goes
    rec = kit.store.get_turn(ref, "t1")
    assert rec is not None and (rec.status, rec.result, rec.attempts, rec.finished_at) == ("running", None, 2, None)
    done = Completed(turn_id="t1", text="refunded")
    kit.store.commit(
        ref,
        Commit(
            events=[TurnCompleted(turn_id="t1", text="refunded")],
            turn_id="t1",
            turn_status="completed",
            turn_result=done,
        ),
    )
    rec = kit.store.get_turn(ref, "t1")
    assert rec is not None and (rec.status, rec.result, rec.attempts) == ("completed", done, 2)
    assert rec.finished_at is not None


def test_a_turn_update_needs_a_status_and_spares_other_turns(kit: Kit, ref: SessionRef) -> None:
    kit.store.enqueue_turn(ref, "t1", TurnPayload(text="a"))
    kit.store.enqueue_turn(ref, "t2", TurnPayload(text="b"))
    kit.store.commit(ref, Commit(turn_id="t1", turn_result=Completed(turn_id="t1", text="no status")))
    kit.store.commit(ref, Commit(turn_id="t-unknown", turn_status="completed", events=[started("t-unknown")]))
    t1, t2 = kit.store.get_turn(ref, "t1"), kit.store.get_turn(ref, "t2")
    assert t1 is not None and (t1.status, t1.result) == ("queued", None)
    assert t2 is not None and t2.status == "queued"
    assert kit.store.get_turn(ref, "t-unknown") is None and kit.store.load(ref).event_seq == 1


def test_get_turn_of_an_unknown_turn_is_none(kit: Kit, ref: SessionRef) -> None:
    kit.store.enqueue_turn(ref, "t1", TurnPayload(text="a"))
    assert kit.store.get_turn(ref, "t2") is None
    assert kit.store.get_turn(SessionRef(ref.agent, ref.session + "-other"), "t1") is None


def test_concurrent_enqueues_of_one_turn_create_it_once(kit: Kit, ref: SessionRef) -> None:
    barrier = threading.Barrier(4)
    created: list[bool] = []
    errors: list[BaseException] = []

    def intake() -> None:
        try:
            barrier.wait(timeout=10)
            created.append(kit.store.enqueue_turn(ref, "t1", TurnPayload(text="once"))[1])
            created.append(kit.store.enqueue_turn(ref, f"t-{threading.get_ident()}", TurnPayload(text="x"))[1])
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=intake) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert sorted(created) == [False, False, False, True, True, True, True, True]
    turns = kit.store.unfinished_turns(ref)
    assert len(turns) == 5 and len({t.position for t in turns}) == 5


# --- cancellation -----------------------------------------------------------------------------------------


def test_cancel_marks_only_queued_and_running_turns_never_a_parked_one(kit: Kit, ref: SessionRef) -> None:
    for t in ("t1", "t2", "t3", "t4"):
        kit.store.enqueue_turn(ref, t, TurnPayload(text=t))
    kit.store.commit(ref, Commit(turn_id="t2", turn_status="running"))
    park(kit.store, ref, "t3", "approve")
    kit.store.commit(ref, Commit(turn_id="t4", turn_status="completed", turn_result=Completed(turn_id="t4", text="")))
    marked = kit.store.request_cancel(ref, "requested")
    assert sorted(marked) == ["t1", "t2"]
    reasons = {t: (r.cancel_reason if (r := kit.store.get_turn(ref, t)) else "gone") for t in ("t1", "t2", "t3", "t4")}
    assert reasons == {"t1": "requested", "t2": "requested", "t3": None, "t4": None}
    assert kit.store.pending(ref) == checkpoint("t3", "approve")


def test_a_commit_marks_its_turn_cancel_requested_even_parked_keeping_the_first_reason(
    kit: Kit, ref: SessionRef
) -> None:
    for t in ("t1", "t2", "t3"):
        kit.store.enqueue_turn(ref, t, TurnPayload(text=t))
    kit.store.commit(ref, Commit(turn_id="t1", turn_status="completed", turn_result=Completed(turn_id="t1", text="")))
    park(kit.store, ref, "t2", "approve")
    # a parked turn is marked (request_cancel never marks one), the first reason stays, an ended turn gets none
    kit.store.commit(ref, Commit(turn_id="t2", cancel_reason="requested"))
    kit.store.commit(ref, Commit(turn_id="t2", cancel_reason="parent"))
    kit.store.commit(ref, Commit(turn_id="t1", cancel_reason="requested"))
    reasons = {t: (r.cancel_reason if (r := kit.store.get_turn(ref, t)) else "gone") for t in ("t1", "t2", "t3")}
    assert reasons == {"t1": None, "t2": "requested", "t3": None}
    assert kit.store.pending(ref) == checkpoint("t2", "approve")  # the mark alone leaves the park as it is
    # and in the commit that answers the park and queues the turn again
    kit.store.commit(
        ref,
        Commit(
            clear_suspended=True,
            turn_id="t2",
            turn_status="queued",
            cancel_reason="parent",
            expect_suspended=("t2", "approve"),
        ),
    )
    kit.store.commit(ref, Commit(turn_id="t3", cancel_reason="replaced"))
    assert [(t.turn_id, t.status, t.cancel_reason) for t in kit.store.unfinished_turns(ref)] == [
        ("t2", "queued", "requested"),
        ("t3", "queued", "replaced"),
    ]


def test_child_turns_are_the_turns_one_turn_started_in_its_sub_sessions_on_the_agents_named(
    kit: Kit, ref: SessionRef
) -> None:
    from june_worker.engine.types import ParentLink

    def link(turn_id: str, call: str, parent: SessionRef = ref) -> TurnPayload:
        return TurnPayload(
            text="q", parent=ParentLink(agent=parent.agent, session=parent.session, turn_id=turn_id, call_id=call)
        )

    # Given children of t1 on two agents, a child of another turn, a grandchild, and a look-alike without a link
    a1 = SessionRef("researcher", f"{ref.session}:sub:c1")
    a2 = SessionRef("writer", f"{ref.session}:sub:c2")
    kit.store.enqueue_turn(a1, "k1", link("t1", "c1"))
    kit.store.enqueue_turn(a2, "k2", link("t1", "c2"))
    kit.store.enqueue_turn(SessionRef("researcher", f"{ref.session}:sub:c3"), "k3", link("t2", "c3"))
    kit.store.enqueue_turn(SessionRef("researcher", f"{a1.session}:sub:g1"), "g1", link("k1", "g1", a1))
    kit.store.enqueue_turn(SessionRef("researcher", f"{ref.session}:sub:c4"), "k4", TurnPayload(text="q"))
    kit.store.enqueue_turn(SessionRef("researcher", f"{ref.session}x:sub:c5"), "k5", link("t1", "c5"))

    # Then only t1's own children on the agents asked for are found, with their sessions
    found = kit.store.child_turns(ref, "t1", ["researcher", "writer"])
    assert sorted((t.agent, t.session, t.turn_id) for t in found) == [
        ("researcher", a1.session, "k1"),
        ("writer", a2.session, "k2"),
    ]
    assert [t.turn_id for t in kit.store.child_turns(ref, "t1", ["writer"])] == ["k2"]
    assert [t.turn_id for t in kit.store.child_turns(a1, "k1", ["researcher"])] == ["g1"]


def test_cancel_keeps_the_first_reason(kit: Kit, ref: SessionRef) -> None:
    kit.store.enqueue_turn(ref, "t1", TurnPayload(text="a"))
    assert kit.store.request_cancel(ref, "replaced") == ["t1"]
    assert kit.store.request_cancel(ref, "reset") == ["t1"]
    rec = kit.store.get_turn(ref, "t1")
    assert rec is not None and rec.cancel_reason == "replaced" and rec.status == "queued"


def test_cancel_by_id_marks_only_those_turns(kit: Kit, ref: SessionRef) -> None:
    for t in ("t1", "t2", "t3"):
        kit.store.enqueue_turn(ref, t, TurnPayload(text=t))
    other = SessionRef(ref.agent, ref.session + "-other")
    kit.store.enqueue_turn(other, "t1", TurnPayload(text="elsewhere"))
    assert sorted(kit.store.request_cancel(ref, "requested", turn_ids=["t1", "t3", "t-unknown"])) == ["t1", "t3"]
    assert kit.store.request_cancel(ref, "requested", turn_ids=[]) == []
    assert [t.cancel_reason for t in kit.store.unfinished_turns(ref)] == ["requested", None, "requested"]
    rec = kit.store.get_turn(other, "t1")
    assert rec is not None and rec.cancel_reason is None


# --- reset ----------------------------------------------------------------------------------------------


def _history(kit: Kit, ref: SessionRef) -> None:
    kit.store.enqueue_turn(ref, "t1", TurnPayload(text="hello"))
    kit.store.commit(ref, opening("t1"))
    kit.store.commit(
        ref,
        Commit(
            messages=[(1, AssistantMessage(turn_id="t1", text="hi there"))],
            steps=[StepRecord(step_id="model:1", turn_id="t1", data={"usage": {"input_tokens": 3}})],
            events=[said("t1", "hi there")],
        ),
    )
    park(kit.store, ref, "t1", "approve")


def test_load_reports_where_the_latest_context_summary_is_and_a_reset_forgets_it(kit: Kit, ref: SessionRef) -> None:
    assert kit.store.load(ref).compacted_at is None
    kit.store.commit(ref, opening("t1"))
    kit.store.commit(ref, Commit(messages=[(1, SummaryMessage(turn_id="t1", text="so far", kept_from=1))]))
    kit.store.commit(ref, Commit(messages=[(2, AssistantMessage(turn_id="t1", text="ok"))]))
    assert kit.store.load(ref).compacted_at == 1
    kit.store.commit(ref, Commit(messages=[(3, SummaryMessage(turn_id="t1", text="later", kept_from=2))]))
    snap = kit.store.load(ref)
    assert snap.compacted_at == 3 and snap.messages[1] == SummaryMessage(turn_id="t1", text="so far", kept_from=1)
    kit.store.reset(ref)
    assert kit.store.load(ref).compacted_at is None


def test_reset_archives_the_generation_and_starts_the_next(kit: Kit, ref: SessionRef) -> None:
    _history(kit, ref)
    live = kit.store.load(ref)
    result = kit.store.reset(ref)
    assert (result.previous_session, result.generation) == (f"{ref.session}#g0", 0)
    snap = kit.store.load(ref)
    assert (snap.generation, snap.status, snap.suspended, snap.messages, snap.steps) == (1, "new", None, [], {})
    assert kit.store.pending(ref) is None
    messages, steps = kit.archived(ref, 0)
    assert messages == live.messages
    assert steps == {k: s.data for k, s in live.steps.items()}
    kit.store.commit(ref, opening("t2", index=0))  # the new generation's transcript starts at 0
    assert [m.turn_id for m in kit.store.load(ref).messages] == ["t2"]


def test_reset_keeps_the_event_log_and_its_sequence(kit: Kit, ref: SessionRef) -> None:
    _history(kit, ref)
    seq = kit.store.load(ref).event_seq
    kit.store.reset(ref)
    assert kit.store.load(ref).event_seq == seq and len(kit.store.events(ref)) == seq
    assert [e.seq for e in kit.store.commit(ref, Commit(events=[started("t2")]))] == [seq + 1]


def test_each_reset_archives_its_own_generation(kit: Kit, ref: SessionRef) -> None:
    _history(kit, ref)
    kit.store.reset(ref)
    kit.store.commit(ref, Commit(messages=[(0, UserMessage(turn_id="t2", text="second life"))]))
    second = kit.store.reset(ref)
    assert (second.previous_session, second.generation) == (f"{ref.session}#g1", 1)
    assert kit.store.load(ref).generation == 2
    assert [m.turn_id for m in kit.archived(ref, 0)[0]] == ["t1", "t1"]
    assert kit.archived(ref, 1) == ([UserMessage(turn_id="t2", text="second life")], {})


def test_reset_touches_only_its_own_session(kit: Kit, ref: SessionRef) -> None:
    other = SessionRef(ref.agent, ref.session + "-other")
    same_id_other_agent = SessionRef(ref.agent + "-b", ref.session)
    _history(kit, ref)
    _history(kit, other)
    _history(kit, same_id_other_agent)
    before = [state(kit.store, r, ("t1",)) for r in (other, same_id_other_agent)]
    kit.store.reset(ref)
    assert [state(kit.store, r, ("t1",)) for r in (other, same_id_other_agent)] == before
    assert kit.archived(other, 0) == ([], {}) and kit.archived(same_id_other_agent, 0) == ([], {})


def test_reset_of_a_session_never_written_starts_generation_one(kit: Kit, ref: SessionRef) -> None:
    result = kit.store.reset(ref)
    assert (result.previous_session, result.generation) == (f"{ref.session}#g0", 0)
    assert kit.store.load(ref).generation == 1 and kit.archived(ref, 0) == ([], {})


# --- a sync tool's writes: the builder and the handle -----------------------------------------------------


def _tool_commit(item: str, index: int = 0) -> Callable[[StoreHandle], Commit]:
    def build(handle: StoreHandle) -> Commit:
        echoed = handle.query("select cast(? as text)", item)[0][0]
        assert echoed == item
        return Commit(
            messages=[(index, ToolMessage(turn_id="t1", call_id="c1", name="order", result={"item": item}))],
            steps=[StepRecord(step_id=f"tool:{index}:c1", turn_id="t1", data={"result": {"item": item}})],
            events=[ActionCompleted(turn_id="t1", step=f"tool:{index}:c1", call=ToolCall(id="c1", name="order"))],
        )

    return build


def _writing(ref: SessionRef, item: str, then: Callable[[StoreHandle], Commit]) -> Callable[[StoreHandle], Commit]:
    def build(handle: StoreHandle) -> Commit:
        assert handle.execute("insert into contract_orders (session, item) values (?, ?)", ref.key, item) == 1
        # the handle reads its own writes; a '?' or '%' inside a quoted literal is not a placeholder
        assert handle.query("select count(*) from contract_orders where session = ? and item <> '100% ?'", ref.key) == [
            (1,)
        ]
        return then(handle)

    return build


def test_sql_stores_support_rollback_and_memory_says_it_does_not(kit: Kit) -> None:
    assert kit.store.supports_rollback is kit.is_sql


def test_a_tool_write_commits_with_its_checkpoint(sql_kit: Kit, ref: SessionRef) -> None:
    events = sql_kit.store.commit(ref, _writing(ref, "widget 100% ?", _tool_commit("widget")))
    assert [e.seq for e in events] == [1]
    assert sql_kit.orders(ref) == ["widget 100% ?"]
    assert [m.role for m in sql_kit.store.load(ref).messages] == ["tool"]


def test_a_builder_that_raises_rolls_back_the_tool_writes_and_the_commit(sql_kit: Kit, ref: SessionRef) -> None:
    before = state(sql_kit.store, ref)
    boom = ValueError("the tool failed after writing")

    def failing(handle: StoreHandle) -> Commit:
        raise boom

    with pytest.raises(ValueError) as raised:
        sql_kit.store.commit(ref, _writing(ref, "widget", failing))
    assert raised.value is boom  # the builder's exception, unchanged
    assert sql_kit.orders(ref) == [] and state(sql_kit.store, ref) == before
    sql_kit.store.commit(ref, _writing(ref, "gadget", _tool_commit("gadget")))  # the store is still usable
    assert sql_kit.orders(ref) == ["gadget"]


def test_a_base_exception_from_the_builder_also_rolls_back(sql_kit: Kit, ref: SessionRef) -> None:
    class Signal(BaseException):
        pass

    def signalling(handle: StoreHandle) -> Commit:
        raise Signal()

    with pytest.raises(Signal):
        sql_kit.store.commit(ref, _writing(ref, "widget", signalling))
    assert sql_kit.orders(ref) == [] and sql_kit.store.load(ref).messages == []


def test_a_fenced_off_builder_commit_rolls_back_the_tool_writes(sql_kit: Kit, ref: SessionRef) -> None:
    old = sql_kit.store.acquire_fence(ref)
    sql_kit.store.acquire_fence(ref)
    with pytest.raises(LeaseLostError):
        sql_kit.store.commit(ref, _writing(ref, "widget", _tool_commit("widget")), fence=old)
    assert sql_kit.orders(ref) == [] and sql_kit.store.load(ref).messages == [] and sql_kit.store.events(ref) == []


def test_a_builder_commit_with_a_taken_index_rolls_back_the_tool_writes(sql_kit: Kit, ref: SessionRef) -> None:
    sql_kit.store.commit(ref, Commit(messages=[(0, UserMessage(turn_id="t1", text="first"))]))
    with pytest.raises(MessageIndexTakenError):
        sql_kit.store.commit(ref, _writing(ref, "widget", _tool_commit("widget", index=0)))
    assert sql_kit.orders(ref) == [] and len(sql_kit.store.load(ref).messages) == 1


def test_a_builder_with_a_resume_conflict_rolls_back_the_tool_writes(sql_kit: Kit, ref: SessionRef) -> None:
    def resume(handle: StoreHandle) -> Commit:
        return Commit(clear_suspended=True, expect_suspended=("t1", "approve"))

    with pytest.raises(ResumeConflictError):
        sql_kit.store.commit(ref, _writing(ref, "widget", resume))
    assert sql_kit.orders(ref) == []


def test_the_handle_unwraps_to_the_driver_connection_inside_the_transaction(sql_kit: Kit, ref: SessionRef) -> None:
    def build(handle: StoreHandle) -> Commit:
        conn = handle.unwrap()
        if isinstance(conn, sqlite3.Connection):
            conn.execute("insert into contract_orders (session, item) values (?, ?)", (ref.key, "raw"))
        else:
            assert isinstance(conn, psycopg.Connection)
            conn.execute("insert into contract_orders (session, item) values (%s, %s)", (ref.key, "raw"))
        raise RuntimeError("undo")

    with pytest.raises(RuntimeError):
        sql_kit.store.commit(ref, build)
    assert sql_kit.orders(ref) == []


def test_a_builder_that_does_not_touch_the_handle_commits_like_a_plain_commit(kit: Kit, ref: SessionRef) -> None:
    events = kit.store.commit(ref, lambda handle: Commit(events=[started("t1")], status="running"))
    assert [e.seq for e in events] == [1] and kit.store.load(ref).status == "running"


def test_the_memory_store_refuses_tool_writes(ref: SessionRef) -> None:
    store = MemoryStore()
    seen: list[str] = []

    def build(handle: StoreHandle) -> Commit:
        for attempt in (
            lambda: handle.execute("insert into orders values (?)", "x"),
            lambda: handle.query("select 1"),
            handle.unwrap,
        ):
            with pytest.raises(FatalToolError):
                attempt()
            seen.append("refused")
        return Commit(events=[started("t1")])

    assert [e.seq for e in store.commit(ref, build)] == [1]
    assert seen == ["refused"] * 3 and store.supports_rollback is False


# --- schema ----------------------------------------------------------------------------------------------


def test_migrate_twice_is_harmless(sql_kit: Kit, ref: SessionRef) -> None:
    sql_kit.store.commit(ref, Commit(messages=[(0, UserMessage(turn_id="t1", text="kept"))]))
    sql_kit.store.migrate()
    sql_kit.store.migrate()
    versions = [v for (v,) in sql_kit.sql("select version from june_schema order by version")]
    assert versions == list(range(1, len(versions) + 1)) and versions
    assert [m.text for m in sql_kit.store.load(ref).messages if isinstance(m, UserMessage)] == ["kept"]


def test_concurrent_migrations_on_a_fresh_postgres_database(database_url: str) -> None:
    name = f"june_test_mig_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f'create database "{name}"')
    url = psycopg.conninfo.make_conninfo(database_url, dbname=name)
    stores = [PostgresStore(url, migrate=False) for _ in range(6)]
    barrier = threading.Barrier(len(stores))
    errors: list[BaseException] = []

    def migrate(store: PostgresStore) -> None:
        try:
            barrier.wait(timeout=10)
            store.migrate()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=migrate, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        with psycopg.connect(url) as conn:
            versions = [v for (v,) in conn.execute("select version from june_schema order by version")]
            tables = {t for (t,) in conn.execute("select tablename from pg_tables where tablename like 'june_%'")}
        assert versions == list(range(1, len(versions) + 1)) and versions
        assert {
            "june_sessions",
            "june_turns",
            "june_messages",
            "june_steps",
            "june_events",
            "june_archived_messages",
            "june_archived_steps",
            "june_schema",
        } <= tables
        ref = SessionRef("contract", "after-migrate")
        assert [e.seq for e in stores[0].commit(ref, Commit(events=[started("t1")]))] == [1]
    finally:
        for s in stores:
            s.close()
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(f'drop database if exists "{name}" with (force)')


# --- Postgres: the connections can die under the store ---------------------------------------------------


def test_postgres_store_reconnects_after_its_connections_are_killed(pg_url: str, ref: SessionRef) -> None:
    store = PostgresStore(pg_url, min_size=2, max_size=2)
    try:
        store.enqueue_turn(ref, "t1", TurnPayload(text="hello"))
        store.commit(ref, opening("t1"))
        with psycopg.connect(pg_url, autocommit=True) as admin:
            killed = admin.execute(
                "select count(*) from (select pg_terminate_backend(pid, 5000) from pg_stat_activity "
                "where datname = current_database() and pid <> pg_backend_pid() "
                "and backend_type = 'client backend') k"
            ).fetchone()
        assert killed is not None and killed[0] >= 2
        assert [m.turn_id for m in store.load(ref).messages] == ["t1"]  # a read on a fresh connection
        events = store.commit(
            ref, Commit(messages=[(1, AssistantMessage(turn_id="t1", text="back"))], events=[said("t1", "back")])
        )
        assert [e.seq for e in events] == [2]
        assert store.get_turn(ref, "t1") is not None and store.unfinished_turns(ref)[0].turn_id == "t1"
    finally:
        store.close()


def _wait_for(query: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not query():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        threading.Event().wait(0.005)  # a short poll of the server's own view, not a sleep-and-hope


def test_a_commit_whose_connection_dies_raises_and_writes_nothing(pg_url: str, ref: SessionRef) -> None:
    store = PostgresStore(pg_url, min_size=1, max_size=1)
    admin = psycopg.connect(pg_url, autocommit=True)
    try:
        store.commit(ref, Commit(events=[started("t1")]))
        with store.pool.connection() as conn:
            store_pid = conn.execute("select pg_backend_pid()").fetchone()
        assert store_pid is not None
        outcome: list[BaseException | None] = []
        with admin.transaction():  # hold the session row so the store's commit blocks mid-statement
            admin.execute(
                "select 1 from june_sessions where agent = %s and session = %s for update", (ref.agent, ref.session)
            )

            def commit() -> None:
                try:
                    store.commit(
                        ref, Commit(messages=[(0, UserMessage(turn_id="t1", text="lost"))], events=[said("t1", "x")])
                    )
                    outcome.append(None)
                except BaseException as exc:  # reported below, in the test's thread
                    outcome.append(exc)

            writer = threading.Thread(target=commit)
            writer.start()
            _wait_for(
                lambda: bool(
                    admin.execute(
                        "select 1 from pg_stat_activity where pid = %s and wait_event_type = 'Lock'", store_pid
                    ).fetchone()
                ),
                "the store's commit to block on the row lock",
            )
            admin.execute("select pg_terminate_backend(%s, 5000)", store_pid)
            writer.join(30)
        # the store's failure class, not the driver's: a transient fault the engine retries from a fresh read
        assert len(outcome) == 1 and isinstance(outcome[0], StoreUnavailableError)
        assert isinstance(outcome[0].__cause__, psycopg.OperationalError)
        assert store.load(ref).messages == [] and [e.seq for e in store.events(ref)] == [1]
        assert [e.seq for e in store.commit(ref, Commit(events=[said("t1", "y")]))] == [2]  # a fresh connection
    finally:
        admin.close()
        store.close()


def test_a_tool_whose_connection_dies_mid_transaction_leaves_nothing(pg_url: str, ref: SessionRef) -> None:
    kit = Kit("postgres", PostgresStore(pg_url, min_size=1, max_size=1))
    kit.sql("create table if not exists contract_orders (session text not null, item text not null)")

    def dying(handle: StoreHandle) -> Commit:
        handle.execute("insert into contract_orders (session, item) values (?, ?)", ref.key, "lost")
        handle.execute("select pg_terminate_backend(pg_backend_pid())")
        return Commit(events=[started("t1")])

    try:
        with pytest.raises(StoreUnavailableError):
            kit.store.commit(ref, dying)
        assert kit.orders(ref) == [] and kit.store.events(ref) == []
        assert [e.seq for e in kit.store.commit(ref, Commit(events=[started("t1")]))] == [1]
    finally:
        kit.store.close()


def test_postgres_store_carries_on_after_a_server_restart(private_postgres: Any, ref: SessionRef) -> None:
    store = PostgresStore(private_postgres.url, min_size=2, max_size=2)
    try:
        store.commit(ref, opening("t1"))
        private_postgres.restart()
        assert [m.turn_id for m in store.load(ref).messages] == ["t1"]
        store.commit(
            ref, Commit(messages=[(1, AssistantMessage(turn_id="t1", text="back"))], events=[said("t1", "back")])
        )
        private_postgres.kill()  # a crash this time: the committed rows must survive it
        private_postgres.start()
        assert [m.turn_id for m in store.load(ref).messages] == ["t1", "t1"]
        assert [e.seq for e in store.events(ref)] == [1, 2]
    finally:
        store.close()
