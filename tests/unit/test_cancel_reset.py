"""Cancellation, replace and reset, in process (scenarios J and K)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from june_worker import tool
from june_worker.engine.events import Cancelled, Completed, Rejected, Suspended
from june_worker.engine.model import Done, ModelDelta, ModelRequest
from june_worker.engine.store import INITIATOR_STEP, SessionRef
from june_worker.engine.types import AssistantMessage, ModelReply, ToolMessage
from june_worker.errors import ResetNotSupportedError, ResumeConflictError, TurnRejectedError
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import MemoryStore, SQLiteStore

from .kit import (
    ORDER_SCRIPT,
    Counter,
    DribblingModel,
    FnModel,
    Recorder,
    ask_tool,
    order_tool,
    runtime_with,
    transcript,
)


async def _until_streaming(rec: Recorder) -> None:
    while not rec.of("message.delta"):
        await asyncio.sleep(0.001)


async def test_s78_a_replace_turn_supersedes_the_in_flight_turn_between_deltas() -> None:
    store = MemoryStore()
    rt = runtime_with(store, DribblingModel())
    s = rt.session("ops", "s1")
    rec = Recorder()
    s.observe(rec)
    await s.start("old question", turn_id="t1")
    await _until_streaming(rec)
    await s.start("corrected question", turn_id="t2", replace=True)
    assert await s.result("t1") == Cancelled(turn_id="t1", reason="replaced")
    assert (await s.result("t2")).text == "fresh answer"  # type: ignore[union-attr]
    assert [e.reason for e in rec.of("turn.cancelled")] == ["replaced"]
    assistants = [m for m in transcript(store) if isinstance(m, AssistantMessage)]
    assert [(m.turn_id, m.text) for m in assistants] == [("t2", "fresh answer")]


async def test_s80_cancelled_mid_batch_the_remaining_calls_get_synthetic_results() -> None:
    b_runs = Counter()
    holder: dict[str, Any] = {}

    @tool
    def a() -> dict[str, int]:
        """Cancels the turn it runs in."""
        holder["session"].cancel_all("requested")
        return {"ok": 1}

    @tool
    def b() -> dict[str, int]:
        """Counts."""
        b_runs.runs += 1
        return {"ok": 2}

    script = [
        Reply("", calls=[{"id": "c1", "name": "a", "input": {}}, {"id": "c2", "name": "b", "input": {}}]),
        Reply("done"),
    ]
    store = SQLiteStore(":memory:")
    rt = runtime_with(store, ScriptedModel(script), [a, b])
    s = holder["session"] = rt.session("ops", "s1")
    await s.start("go", turn_id="t1")
    assert await s.result("t1") == Cancelled(turn_id="t1", reason="requested")
    assert b_runs.runs == 0
    tools = [m for m in transcript(store) if isinstance(m, ToolMessage)]
    assert [(m.call_id, m.result) for m in tools] == [("c1", {"ok": 1}), ("c2", {"cancelled": True})]
    assert await s.turn("again", turn_id="t2") == "done"  # the closed batch is a valid transcript


async def test_s81_replace_never_cancels_a_parked_approval() -> None:
    script = [Reply("", calls=[{"id": "c1", "name": "ask", "input": {}}]), Reply("after")]
    rt = runtime_with(MemoryStore(), ScriptedModel(script), [ask_tool("q")])
    s = rt.session("ops", "s1")
    await s.start("park", turn_id="t1")
    assert isinstance(await s.result("t1"), Suspended)
    with pytest.raises(TurnRejectedError, match="suspended"):
        await s.start("new", turn_id="t2", replace=True)
    assert await s.cancel("t1") is False
    assert isinstance(await s.result("t1"), Suspended)


async def test_s83_turn_cancelled_carries_the_reason() -> None:
    reasons: list[str] = []
    rt = runtime_with(MemoryStore(), DribblingModel())
    sessions = [rt.session("ops", n) for n in ("A", "B", "C")]
    recs = []
    for s in sessions:
        rec = Recorder()
        s.observe(rec)
        s.observe(lambda e: reasons.append(e.reason) if e.type == "turn.cancelled" else None)
        recs.append(rec)
    a, b, c = sessions
    await a.start("x", turn_id="t1")
    await _until_streaming(recs[0])
    await a.start("y", turn_id="t2", replace=True)
    await a.result("t1")
    # fresh models for B and C so each first call dribbles
    for s in (b, c):
        s.agent = type(s.agent)(name="ops", model=DribblingModel())
    await b.start("x", turn_id="t1")
    await _until_streaming(recs[1])
    await b.cancel("t1")
    await b.result("t1")
    await c.start("x", turn_id="t1")
    await _until_streaming(recs[2])
    await c.reset()
    assert reasons == ["replaced", "requested", "reset"]


async def test_s84_a_cancel_landing_during_the_streams_cleanup_still_wins() -> None:
    holder: dict[str, Any] = {}
    calls = {"n": 0}

    async def gen(_: ModelRequest) -> AsyncIterator[ModelDelta]:
        calls["n"] += 1
        if calls["n"] > 1:
            yield Done(reply=ModelReply(text="fresh answer"))
            return
        try:
            yield Done(reply=ModelReply(text="stale answer"))
        finally:
            await asyncio.sleep(0)
            await holder["s"].start("corrected", turn_id="t2", replace=True)

    store = MemoryStore()
    rt = runtime_with(store, FnModel(gen))
    s = holder["s"] = rt.session("ops", "s1")
    await s.start("old", turn_id="t1")
    assert await s.result("t1") == Cancelled(turn_id="t1", reason="replaced")
    assert (await s.result("t2")).text == "fresh answer"  # type: ignore[union-attr]
    assistants = [m for m in transcript(store) if isinstance(m, AssistantMessage)]
    assert [m.turn_id for m in assistants] == ["t2"]


async def test_s85_a_turn_queued_behind_one_that_later_parks_is_rejected_at_run_time() -> None:
    script = [Reply("", calls=[{"id": "c1", "name": "ask", "input": {}}]), Reply("after")]
    store = MemoryStore()
    rt = runtime_with(store, ScriptedModel(script), [ask_tool("q")])
    s = rt.session("ops", "s1")
    rec = Recorder()
    s.observe(rec)
    await s.start("park", turn_id="t1")
    await s.start("sneaks in", turn_id="t2")
    assert isinstance(await s.result("t1"), Suspended)
    t2 = await s.result("t2")
    assert isinstance(t2, Rejected) and "suspended awaiting input" in t2.reason
    assert not any(m.turn_id == "t2" for m in transcript(store))
    failed = [e for e in rec.of("turn.failed") if e.turn_id == "t2"]
    assert len(failed) == 1 and failed[0].phase == "intake"  # the follower of t2 sees it end


async def test_a_queued_turn_cancelled_before_it_starts_never_runs() -> None:
    store = MemoryStore()
    model = ScriptedModel(["ran"], delay_s=0.001)
    rt = runtime_with(store, model)
    s = rt.session("ops", "s1")
    await s.start("first", turn_id="t1")
    await s.start("second", turn_id="t2")
    assert await s.cancel("t2") is True
    assert (await s.result("t1")).status == "completed"
    assert await s.result("t2") == Cancelled(turn_id="t2", reason="requested")
    assert model.calls == 1
    assert not any(m.turn_id == "t2" for m in transcript(store))


async def test_a_cancel_request_is_durable_across_a_restart() -> None:
    # The cancel is stored; a new runtime over the same store finds it and never runs the turn.
    store = SQLiteStore(":memory:")
    ref = SessionRef("ops", "s1")
    from june_worker.engine.store import TurnPayload

    store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    assert store.request_cancel(ref, "requested", turn_ids=["t1"]) == ["t1"]
    model = ScriptedModel(["ran"])
    rt = runtime_with(store, model)
    assert await rt.session("ops", "s1").result("t1") == Cancelled(turn_id="t1", reason="requested")
    assert model.calls == 0


async def test_cancel_is_checked_between_tool_calls() -> None:
    holder: dict[str, Any] = {}

    @tool
    async def slow(n: int) -> dict[str, int]:
        """One of a batch."""
        if n == 0:
            await holder["s"].cancel("t1")
        return {"n": n}

    calls = [{"id": f"c{i}", "name": "slow", "input": {"n": i}} for i in range(3)]
    store = MemoryStore()
    rt = runtime_with(store, ScriptedModel([Reply("", calls=calls), Reply("x")]), [slow])
    s = holder["s"] = rt.session("ops", "s1")
    await s.start("go", turn_id="t1")
    assert (await s.result("t1")).status == "cancelled"
    results = [m.result for m in transcript(store) if isinstance(m, ToolMessage)]
    assert results == [{"n": 0}, {"cancelled": True}, {"cancelled": True}]


async def test_cancel_of_a_finished_turn_returns_false() -> None:
    rt = runtime_with(MemoryStore(), ScriptedModel(["hi"]))
    s = rt.session("ops", "s1")
    await s.turn("x", turn_id="t1")
    assert await s.cancel("t1") is False


# --- reset ----------------------------------------------------------------------------------------------


async def test_s87_reset_archives_the_history_and_returns_the_audit_handle() -> None:
    store = MemoryStore()
    rt = runtime_with(store, ScriptedModel(["hi there"]))
    s = rt.session("ops", "s1")
    await s.turn("hello", turn_id="t1", event={"source": "web", "principal": {"id": "A"}})
    assert store.load(s.ref).steps[INITIATOR_STEP].data == {"id": "A"}
    result = await s.reset()
    assert (result.previous_session, result.generation) == ("s1#g0", 0)
    snap = store.load(s.ref)
    assert snap.messages == [] and snap.status == "new" and INITIATOR_STEP not in snap.steps
    assert len(store.archives) == 1 and len(store.archives[0]["messages"]) == 2
    await s.turn("again", turn_id="t2")
    second = await s.reset()
    assert (second.previous_session, second.generation) == ("s1#g1", 1)


async def test_s88_reset_cancels_the_in_flight_turn_then_archives() -> None:
    store = MemoryStore()
    rt = runtime_with(store, DribblingModel(stale="x", fresh="fresh"))
    s = rt.session("ops", "s1")
    rec = Recorder()
    s.observe(rec)
    await s.start("one", turn_id="t1")
    await _until_streaming(rec)
    result = await s.reset()
    assert (result.previous_session, result.generation) == ("s1#g0", 0)
    assert await s.result("t1") == Cancelled(turn_id="t1", reason="reset")
    assert transcript(store) == []
    assert [m.turn_id for m in store.archives[0]["messages"]] == ["t1"]
    assert await s.turn("two", turn_id="t2") == "fresh"
    assert {m.turn_id for m in transcript(store)} == {"t2"}


async def test_s91_resume_is_refused_while_a_reset_is_pending() -> None:
    script = [Reply("", calls=[{"id": "c1", "name": "ask", "input": {}}]), Reply("after")]
    rt = runtime_with(MemoryStore(), ScriptedModel(script), [ask_tool("q")])
    s = rt.session("ops", "s1")
    await s.start("park", turn_id="t1")
    await s.result("t1")
    pending_reset = s.reset()
    with pytest.raises(ResumeConflictError, match="reset is pending"):
        await s.resume("t1", "q", True)
    await pending_reset
    assert s.pending() is None  # the stale park was archived: nobody needs to answer it
    assert await s.result("t1") == Cancelled(turn_id="t1", reason="reset")


async def test_s92_a_store_without_reset_fails_loudly_and_changes_nothing() -> None:
    class NoReset(MemoryStore):
        reset = None  # type: ignore[assignment]

    store = NoReset()
    rt = runtime_with(store, ScriptedModel(["hi"]))
    s = rt.session("ops", "s1")
    await s.turn("x", turn_id="t1")
    with pytest.raises(ResetNotSupportedError, match="does not implement reset"):
        s.reset()
    assert len(transcript(store)) == 2


async def test_s93_sqlite_reset_archives_only_this_session() -> None:
    store = SQLiteStore(":memory:")
    rt = runtime_with(store, ScriptedModel(ORDER_SCRIPT), [order_tool()])
    for who in ("alice", "bob"):
        await rt.session("ops", who).turn("Order 3 widgets", turn_id="t1")
    result = await rt.session("ops", "alice").reset()
    assert (result.previous_session, result.generation) == ("alice#g0", 0)
    assert transcript(store, session="alice") == []
    assert len(transcript(store, session="bob")) == 4
    rows = store._conn.execute("select distinct agent, session, generation from june_archived_messages").fetchall()
    assert rows == [("ops", "alice", 0)]
    assert await rt.session("ops", "alice").turn("Order 3 widgets", turn_id="t2") == "Done — order placed."


async def test_turns_queued_during_a_reset_run_on_the_new_generation() -> None:
    store = MemoryStore()
    rt = runtime_with(store, DribblingModel(stale="old", fresh="new"))
    s = rt.session("ops", "s1")
    rec = Recorder()
    s.observe(rec)
    await s.start("one", turn_id="t1")
    await _until_streaming(rec)
    pending = s.reset()
    await s.start("two", turn_id="t2")
    await pending
    assert isinstance(await s.result("t2"), Completed)
    assert {m.turn_id for m in transcript(store)} == {"t2"}


async def test_a_cancel_interrupts_a_model_that_is_waiting_for_its_first_token() -> None:
    gate = asyncio.Event()  # never opened: the model would wait forever
    waiting = asyncio.Event()

    async def gated(_: ModelRequest) -> AsyncIterator[ModelDelta]:
        waiting.set()
        await gate.wait()
        yield Done(reply=ModelReply(text="done late"))

    store = MemoryStore()
    rt = runtime_with(store, FnModel(gated))
    s = rt.session("ops", "s1")
    await s.start("hi", turn_id="t1")
    await asyncio.wait_for(waiting.wait(), timeout=5)
    assert await s.cancel("t1") is True
    result = await asyncio.wait_for(s.result("t1"), timeout=5)
    assert result == Cancelled(turn_id="t1", reason="requested")
    assert not any(isinstance(m, AssistantMessage) for m in transcript(store))
