"""Replay: a turn crashed at any commit boundary and delivered again ends as one clean run would.

Each crash test names the boundary it crashes at. "Crash" is CrashAt: the host stops right
there, in-process state is gone, stored state is kept; a new Runtime over the same store
plays the part of the next worker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from june_worker import ToolContext, tool
from june_worker.engine.crash import CrashAt
from june_worker.engine.signals import CrashInjected
from june_worker.engine.store import SessionRef, SessionStore
from june_worker.engine.types import UserMessage
from june_worker.models import Reply, ScriptedModel

from .kit import ORDER_SCRIPT, Counter, Recorder, count_orders, make_store, order_tool, runtime_with, transcript

BATCH_SCRIPT = [
    Reply(
        "Placing two orders.",
        calls=[
            {"id": "c1", "name": "create_order", "input": {"item": "widget", "qty": 3}},
            {"id": "c2", "name": "create_order", "input": {"item": "gadget", "qty": 1}},
        ],
    ),
    Reply("Done — orders placed."),
]

CRASHES = [
    ("before-model-commit", "model:1"),
    ("after-model-commit", "model:1"),
    ("before-tool-commit", "tool:1:c1"),
    ("after-tool-commit", "tool:1:c1"),
    ("before-tool-commit", "tool:1:c2"),
    ("after-tool-commit", "tool:1:c2"),
    ("before-model-commit", "model:4"),
    ("before-publish", "tool:1:c2"),
]


def _tool_for(kind: str, counter: Counter, store: SessionStore) -> Any:
    """The order tool: through the store's transaction on SQLite; on the memory store, which has
    no transaction to join, a tool whose result depends on its input only."""
    if kind != "memory":
        return order_tool(counter)

    @tool
    def create_order(item: str, qty: int = 1) -> dict[str, Any]:
        """Place an order for an item."""
        counter.runs += 1
        return {"item": item, "qty": qty}

    return create_order


async def _run(store: SessionStore, kind: str, counter: Counter, crash: CrashAt | None = None) -> str:
    rt = runtime_with(store, ScriptedModel(BATCH_SCRIPT), [_tool_for(kind, counter, store)])
    rt.crash = crash
    return await rt.session("ops", "s1").turn("Order things", turn_id="t1")


def _dump(store: SessionStore) -> list[dict[str, Any]]:
    return [m.model_dump() for m in transcript(store)]


@pytest.mark.parametrize(("point", "step"), CRASHES, ids=[f"{p}@{s}" for p, s in CRASHES])
async def test_crash_at_each_boundary_replays_to_the_clean_transcript(
    store_kind: str, point: str, step: str, tmp_path: Path
) -> None:
    clean = make_store("memory" if store_kind == "memory" else "sqlite")
    await _run(clean, store_kind, Counter())

    crashed = make_store(store_kind, tmp_path)
    with pytest.raises(CrashInjected):
        await _run(crashed, store_kind, Counter(), CrashAt(point, step))
    assert await _run(crashed, store_kind, Counter()) == "Done — orders placed."

    assert _dump(crashed) == _dump(clean)
    events = [(e.type, e.seq) for e in crashed.events(SessionRef("ops", "s1"))]
    assert [s for _, s in events] == list(range(1, len(events) + 1))
    assert [t for t, _ in events].count("turn.started") == 1


async def test_s8_sync_tool_crashed_after_commit_leaves_one_row_and_runs_once(sql_kind: str, tmp_path: Path) -> None:
    # Given a durable SQL store; runtime 1 crashes right after the tool step committed
    counter = Counter()
    store1 = make_store(sql_kind, tmp_path)
    rt1 = runtime_with(store1, ScriptedModel(ORDER_SCRIPT), [order_tool(counter)])
    rt1.crash = CrashAt("after-tool-commit", "tool:1:c1")
    with pytest.raises(CrashInjected, match="after-tool-commit"):
        await rt1.session("ops", "s1").turn("Order 3 widgets", turn_id="t1")
    assert count_orders(store1) == 1
    store1.close()
    # When a brand-new runtime over a new store on the same database delivers t1 again
    store2 = make_store(sql_kind, tmp_path)
    rt2 = runtime_with(store2, ScriptedModel(ORDER_SCRIPT), [order_tool(counter)])
    assert await rt2.session("ops", "s1").turn("Order 3 widgets", turn_id="t1") == "Done — order placed."
    # Then still one order, and the tool ran once in total
    assert count_orders(store2) == 1
    assert counter.runs == 1


async def test_sync_tool_crashed_before_commit_rolls_back_and_leaves_one_row_after_replay(
    sql_kind: str, tmp_path: Path
) -> None:
    counter = Counter()
    store1 = make_store(sql_kind, tmp_path)
    rt1 = runtime_with(store1, ScriptedModel(ORDER_SCRIPT), [order_tool(counter)])
    rt1.crash = CrashAt("before-tool-commit", "tool:1:c1")
    with pytest.raises(CrashInjected):
        await rt1.session("ops", "s1").turn("Order 3 widgets", turn_id="t1")
    assert count_orders(store1) == 0  # the tool's insert rolled back with the step
    store1.close()  # the crashed process's store goes with it (and lets the file's lock go)
    store2 = make_store(sql_kind, tmp_path)
    rt2 = runtime_with(store2, ScriptedModel(ORDER_SCRIPT), [order_tool(counter)])
    await rt2.session("ops", "s1").turn("Order 3 widgets", turn_id="t1")
    assert count_orders(store2) == 1
    assert counter.runs == 2  # it ran twice, but only the second run's write exists


async def test_async_tool_crashed_before_commit_runs_twice_at_least_once(store_kind: str) -> None:
    # An async tool cannot join the step's transaction: a crash after it returned but before the
    # checkpoint committed re-runs it. That is the documented at-least-once guarantee.
    counter = Counter()

    @tool
    async def notify(ctx: ToolContext, who: str) -> dict[str, str]:
        """Send a notification."""
        counter.runs += 1
        return {"sent": who}

    script = [Reply("", calls=[{"id": "c1", "name": "notify", "input": {"who": "ops"}}]), Reply("sent")]
    store = make_store(store_kind)
    rt1 = runtime_with(store, ScriptedModel(script), [notify])
    rt1.crash = CrashAt("before-tool-commit", "tool:1:c1")
    with pytest.raises(CrashInjected):
        await rt1.session("ops", "s1").turn("go", turn_id="t1")
    rt2 = runtime_with(store, ScriptedModel(script), [notify])
    assert await rt2.session("ops", "s1").turn("go", turn_id="t1") == "sent"
    assert counter.runs == 2


async def test_a_cached_model_step_emits_no_delta_on_replay(store_kind: str) -> None:
    store = make_store(store_kind)
    counter = Counter()
    model = ScriptedModel(ORDER_SCRIPT, delay_s=0.0001)
    rt1 = runtime_with(store, model, [_tool_for(store_kind, counter, store)])
    rt1.crash = CrashAt("after-model-commit", "model:1")
    first = Recorder()
    rt1.session("ops", "s1").observe(first)
    with pytest.raises(CrashInjected):
        await rt1.session("ops", "s1").turn("Order 3 widgets", turn_id="t1")
    rt2 = runtime_with(store, model, [_tool_for(store_kind, counter, store)])
    second = Recorder()
    rt2.session("ops", "s1").observe(second)
    await rt2.session("ops", "s1").turn("Order 3 widgets", turn_id="t1")
    assert {d.step for d in first.of("message.delta")} == {"model:1"}
    assert {d.step for d in second.of("message.delta")} == {"model:3"}  # model:1 was cached: silent
    assert model.calls == 2


async def test_redelivery_never_appends_the_opening_twice(store_kind: str) -> None:
    store = make_store(store_kind)
    rt = runtime_with(store, ScriptedModel(["hello"]))
    s = rt.session("ops", "s1")
    await s.turn("hi", turn_id="t1")
    await s.start("hi", turn_id="t1")
    await s.result("t1")
    rt2 = runtime_with(store, ScriptedModel(["hello"]))
    await rt2.session("ops", "s1").start("hi", turn_id="t1")
    assert sum(isinstance(m, UserMessage) for m in transcript(store)) == 1


async def test_a_crash_mid_batch_resumes_only_the_calls_still_owed(sql_kind: str, tmp_path: Path) -> None:
    counter = Counter()
    store = make_store(sql_kind, tmp_path)
    rt1 = runtime_with(store, ScriptedModel(BATCH_SCRIPT), [order_tool(counter)])
    rt1.crash = CrashAt("after-tool-commit", "tool:1:c1")
    with pytest.raises(CrashInjected):
        await rt1.session("ops", "s1").turn("go", turn_id="t1")
    assert counter.runs == 1
    rt2 = runtime_with(store, ScriptedModel(BATCH_SCRIPT), [order_tool(counter)])
    await rt2.session("ops", "s1").turn("go", turn_id="t1")
    assert counter.runs == 2  # c2 only
    assert count_orders(store) == 2


async def test_a_redelivered_finished_turn_reports_its_own_result_after_later_turns(store_kind: str) -> None:
    store = make_store(store_kind)
    rt = runtime_with(store, ScriptedModel(["first answer", "second answer"]))
    s = rt.session("ops", "s1")
    await s.turn("one", turn_id="t1")
    await s.turn("two", turn_id="t2")
    rt2 = runtime_with(store, ScriptedModel(["first answer", "second answer"]))
    s2 = rt2.session("ops", "s1")
    await s2.start("one", turn_id="t1")
    result = await s2.result("t1")
    assert result.status == "completed" and result.text == "first answer"  # type: ignore[union-attr]
    assert len(transcript(store)) == 4


async def test_deltas_carry_their_attempt_so_a_dead_attempts_text_can_be_dropped(store_kind: str) -> None:
    # Given a turn whose first model step streamed its text and died before committing (crash before-model-commit)
    store = make_store(store_kind)
    rt1 = runtime_with(store, ScriptedModel(["Hello there."]))
    rt1.crash = CrashAt("before-model-commit", "model:1")
    first = Recorder()
    rt1.session("ops", "s1").observe(first)
    with pytest.raises(CrashInjected):
        await rt1.session("ops", "s1").turn("hi", turn_id="t1")
    # When the next runtime over the same store runs the turn again
    rt2 = runtime_with(store, ScriptedModel(["Hello there."]))
    second = Recorder()
    rt2.session("ops", "s1").observe(second)
    assert await rt2.session("ops", "s1").turn("hi", turn_id="t1") == "Hello there."
    # Then both attempts streamed step model:1, each delta tagged with its own attempt
    dead, retry = first.of("message.delta"), second.of("message.delta")
    assert dead and retry
    assert {(d.step, d.attempt) for d in dead} == {("model:1", 1)}
    assert {(d.step, d.attempt) for d in retry} == {("model:1", 2)}
