"""Parallel async tool calls (``Agent(parallel_tools=N)``), in process.

The rules: the async calls of one reply run concurrently, at most N at a time; each commits its own
result as it finishes; sync calls run one at a time in their own transaction; the transcript, and so
the model, gets the results in call order; a crash re-runs only the calls without a committed result.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from june_worker import ToolContext, tool
from june_worker.engine.crash import CrashAt
from june_worker.engine.events import ActionCompleted, ActionRequested
from june_worker.engine.signals import CrashInjected
from june_worker.engine.store import SessionRef, SessionStore
from june_worker.engine.tools import Tool
from june_worker.engine.types import ToolMessage
from june_worker.errors import AgentDefinitionError, FatalToolError
from june_worker.models import Reply, ScriptedModel

from .kit import Counter, Recorder, count_orders, make_store, order_tool, runtime_with, transcript

CALLS = ["c1", "c2", "c3", "c4"]


def _script(calls: list[dict[str, Any]], final: str = "all looked up") -> list[Reply | str]:
    return [Reply("Looking these up.", calls=calls), final]


def _lookups(n: int = 4) -> list[dict[str, Any]]:
    return [{"id": f"c{i}", "name": "lookup", "input": {"key": f"k{i}"}} for i in range(1, n + 1)]


class Probe:
    """What the lookup tool saw: runs per key, the most calls in flight at once, the order they finished."""

    def __init__(self) -> None:
        self.runs: dict[str, int] = {}
        self.in_flight = 0
        self.most = 0
        self.finished: list[str] = []


def lookup_tool(probe: Probe, delays: dict[str, float] | None = None, gate: asyncio.Event | None = None) -> Tool:
    """An async lookup: waits ``delays[key]`` (later keys first by default, so they finish in reverse)."""

    @tool
    async def lookup(ctx: ToolContext, key: str) -> dict[str, str]:
        """Look a key up."""
        probe.runs[key] = probe.runs.get(key, 0) + 1
        probe.in_flight += 1
        probe.most = max(probe.most, probe.in_flight)
        try:
            if gate is not None:
                await gate.wait()
            await asyncio.sleep((delays or {}).get(key, 0.05 - 0.01 * int(key[1:])))
        finally:
            probe.in_flight -= 1
        probe.finished.append(key)
        return {"key": key, "value": key.upper()}

    return lookup


async def _turn(
    store: SessionStore, probe: Probe, *, parallel: int = 8, crash: CrashAt | None = None, **kw: Any
) -> str:
    model = kw.pop("model", None) or ScriptedModel(_script(_lookups()))
    rt = runtime_with(store, model, [lookup_tool(probe, **kw)], parallel_tools=parallel)
    rt.crash = crash
    return await rt.session("ops", "s1").turn("look up four keys", turn_id="t1")


def _tool_messages(store: SessionStore) -> list[str]:
    return [m.call_id for m in transcript(store) if isinstance(m, ToolMessage)]


async def test_the_async_calls_of_a_batch_run_at_once_up_to_the_agents_limit(store_kind: str) -> None:
    probe = Probe()
    assert await _turn(make_store(store_kind), probe, parallel=8) == "all looked up"
    assert probe.most == 4  # all four together

    limited = Probe()
    await _turn(make_store(store_kind), limited, parallel=2)
    assert limited.most == 2
    assert limited.runs == {"k1": 1, "k2": 1, "k3": 1, "k4": 1}


async def test_the_default_runs_one_call_at_a_time_as_the_reference_does(store_kind: str) -> None:
    probe = Probe()
    model = ScriptedModel(_script(_lookups()))
    rt = runtime_with(make_store(store_kind), model, [lookup_tool(probe)])
    await rt.session("ops", "s1").turn("look up four keys", turn_id="t1")
    assert probe.most == 1
    assert probe.finished == ["k1", "k2", "k3", "k4"]


async def test_results_reach_the_model_in_call_order_whatever_order_they_finish_in(store_kind: str) -> None:
    store = make_store(store_kind)
    probe = Probe()
    model = ScriptedModel(_script(_lookups()), record=True)
    await _turn(store, probe, model=model)
    assert probe.finished == ["k4", "k3", "k2", "k1"]  # the later keys wait less
    assert _tool_messages(store) == CALLS
    second = model.requests[1].messages
    assert [m.call_id for m in second if isinstance(m, ToolMessage)] == CALLS


async def test_each_call_commits_its_result_as_it_finishes_and_the_events_say_which_run_together(
    store_kind: str,
) -> None:
    store = make_store(store_kind)
    probe = Probe()
    seen = Recorder()
    rt = runtime_with(store, ScriptedModel(_script(_lookups())), [lookup_tool(probe)], parallel_tools=8)
    rt.session("ops", "s1").observe(seen)
    await rt.session("ops", "s1").turn("look up four keys", turn_id="t1")
    requested: list[ActionRequested] = seen.of("action.requested")
    assert [e.batch for e in requested] == [CALLS] * 4
    completed: list[ActionCompleted] = seen.of("action.completed")
    assert [e.call.id for e in completed] == ["c4", "c3", "c2", "c1"]  # as each finished, not at the end
    stored = store.events(SessionRef("ops", "s1"))
    assert [e.call.id for e in stored if isinstance(e, ActionCompleted)] == ["c4", "c3", "c2", "c1"]


async def test_the_events_of_a_batch_larger_than_the_limit_say_how_many_of_it_run_at_once(store_kind: str) -> None:
    store = make_store(store_kind)
    probe = Probe()
    seen = Recorder()
    rt = runtime_with(store, ScriptedModel(_script(_lookups())), [lookup_tool(probe)], parallel_tools=2)
    rt.session("ops", "s1").observe(seen)
    await rt.session("ops", "s1").turn("look up four keys", turn_id="t1")
    requested: list[ActionRequested] = seen.of("action.requested")
    # the batch is every async call of the reply; batch_limit of them run at once (and did: no more)
    assert [(e.batch, e.batch_limit) for e in requested] == [(CALLS, 2)] * 4
    assert probe.most == 2
    assert requested[0].model_dump(mode="json")["batch_limit"] == 2


async def test_a_serial_agent_says_each_call_runs_alone(store_kind: str) -> None:
    seen = Recorder()
    rt = runtime_with(make_store(store_kind), ScriptedModel(_script(_lookups(2))), [lookup_tool(Probe())])
    rt.session("ops", "s1").observe(seen)
    await rt.session("ops", "s1").turn("look up", turn_id="t1")
    assert [(e.batch, e.batch_limit) for e in seen.of("action.requested")] == [(None, None), (None, None)]
    assert "batch_limit" not in seen.of("action.requested")[0].model_dump(mode="json")


# --- crashes at every commit of a parallel batch ---------------------------------------------------------

CRASHES = [
    (point, f"tool:1:{call}")
    for call in ("c4", "c3", "c1")  # the first to finish (no message yet), one in the middle, the last
    for point in ("before-tool-commit", "after-tool-commit", "before-publish")
]


@pytest.mark.parametrize(("point", "step"), CRASHES, ids=[f"{p}@{s}" for p, s in CRASHES])
async def test_a_crash_anywhere_in_a_parallel_batch_reruns_only_calls_without_a_committed_result(
    store_kind: str, point: str, step: str, tmp_path: Path
) -> None:
    clean = make_store("memory")
    await _turn(clean, Probe())

    store = make_store(store_kind, tmp_path)
    first = Probe()
    with pytest.raises(CrashInjected):
        await _turn(store, first, crash=CrashAt(point, step))
    committed = {s.split(":")[2] for s in store.load(SessionRef("ops", "s1")).steps if s.startswith("tool:1:")}
    second = Probe()
    assert await _turn(store, second) == "all looked up"

    for call in CALLS:
        key = f"k{call[1:]}"
        if call in committed:
            assert key not in second.runs, f"{call} committed a result, yet ran again"
        else:
            assert second.runs.get(key) == 1
    assert _tool_messages(store) == CALLS
    assert [m.model_dump() for m in transcript(store)] == [m.model_dump() for m in transcript(clean)]
    types = [e.type for e in store.events(SessionRef("ops", "s1"))]
    assert types.count("action.completed") == 4 and types.count("turn.completed") == 1


async def test_results_stored_without_their_messages_join_the_transcript_without_running_again(
    store_kind: str, tmp_path: Path
) -> None:
    # A crash right after the last-but-one result committed, the three later ones having finished first:
    # three results are stored, none in the transcript yet (c1's is owed before them).
    store = make_store(store_kind, tmp_path)
    first = Probe()
    with pytest.raises(CrashInjected):
        await _turn(store, first, crash=CrashAt("after-tool-commit", "tool:1:c2"))
    assert _tool_messages(store) == []
    second = Probe()
    await _turn(store, second)
    assert second.runs == {"k1": 1}
    assert _tool_messages(store) == CALLS


# --- sync calls, failures, parks, cancels ------------------------------------------------------------------


async def test_sync_calls_of_a_parallel_batch_run_one_at_a_time_each_in_its_transaction(
    sql_kind: str, tmp_path: Path
) -> None:
    store = make_store(sql_kind, tmp_path)
    orders = Counter()
    probe = Probe()
    calls = [
        {"id": "c1", "name": "lookup", "input": {"key": "k1"}},
        {"id": "c2", "name": "create_order", "input": {"item": "widget", "qty": 2}},
        {"id": "c3", "name": "lookup", "input": {"key": "k3"}},
        {"id": "c4", "name": "create_order", "input": {"item": "gadget", "qty": 1}},
    ]
    seen = Recorder()
    rt = runtime_with(store, ScriptedModel(_script(calls)), [lookup_tool(probe), order_tool(orders)], parallel_tools=4)
    rt.session("ops", "s1").observe(seen)
    rt.crash = CrashAt("after-tool-commit", "tool:1:c4")
    with pytest.raises(CrashInjected):
        await rt.session("ops", "s1").turn("order and look up", turn_id="t1")
    rt2 = runtime_with(store, ScriptedModel(_script(calls)), [lookup_tool(probe), order_tool(orders)], parallel_tools=4)
    assert await rt2.session("ops", "s1").turn("order and look up", turn_id="t1") == "all looked up"
    assert orders.runs == 2 and count_orders(store) == 2  # each sync call once: its commit held its write
    assert _tool_messages(store) == CALLS
    assert [e.batch for e in seen.of("action.requested")] == [["c1", "c3"], None, ["c1", "c3"], None]


async def test_a_fatal_call_cancels_the_rest_of_the_batch_and_fails_the_turn_with_a_valid_transcript(
    store_kind: str,
) -> None:
    store = make_store(store_kind)
    gate = asyncio.Event()  # never set: the other lookups wait until they are cancelled
    probe = Probe()

    @tool
    async def explode(ctx: ToolContext) -> None:
        """Fail for good."""
        await asyncio.sleep(0.01)
        raise FatalToolError("the vault is sealed")

    calls = [*_lookups(2), {"id": "c3", "name": "explode", "input": {}}]
    rt = runtime_with(store, ScriptedModel(_script(calls)), [lookup_tool(probe, gate=gate), explode], parallel_tools=8)
    with pytest.raises(Exception, match="vault is sealed"):
        await rt.session("ops", "s1").turn("go", turn_id="t1")
    assert probe.in_flight == 0  # the waiting lookups were cancelled, not left running
    messages = transcript(store)
    assert [m.call_id for m in messages if isinstance(m, ToolMessage)] == ["c1", "c2", "c3"]
    assert messages[-1].result == {"error": "the vault is sealed"}
    turn = store.get_turn(SessionRef("ops", "s1"), "t1")
    assert turn is not None and turn.status == "failed"


async def test_a_call_that_parks_lets_the_others_commit_and_only_it_runs_after_the_answer(store_kind: str) -> None:
    store = make_store(store_kind)
    probe = Probe()
    asked = Counter()

    @tool
    async def approve(ctx: ToolContext) -> dict[str, Any]:
        """Ask a human."""
        asked.runs += 1
        return {"approved": await ctx.request_input(id="ok-1", prompt="Approve?")}

    calls = [
        *_lookups(2),
        {"id": "c3", "name": "approve", "input": {}},
        {"id": "c4", "name": "lookup", "input": {"key": "k4"}},
    ]
    rt = runtime_with(store, ScriptedModel(_script(calls)), [lookup_tool(probe), approve], parallel_tools=8)
    session = rt.session("ops", "s1")
    await session.start("go", turn_id="t1")
    assert (await session.result("t1")).status == "suspended"
    assert probe.runs == {"k1": 1, "k2": 1, "k4": 1}
    steps = store.load(SessionRef("ops", "s1")).steps
    assert {"tool:1:c1", "tool:1:c2", "tool:1:c4"} <= set(steps)
    await session.resume("t1", "ok-1", True)
    assert (await session.result("t1")).status == "completed"
    assert probe.runs == {"k1": 1, "k2": 1, "k4": 1}  # only the parked call ran again
    assert asked.runs == 2
    assert _tool_messages(store) == CALLS
    assert [m.result for m in transcript(store) if isinstance(m, ToolMessage)][2] == {"approved": True}


async def test_a_cancel_during_a_batch_lets_running_calls_finish_and_starts_no_more(store_kind: str) -> None:
    store = make_store(store_kind)
    gate = asyncio.Event()
    probe = Probe()
    rt = runtime_with(store, ScriptedModel(_script(_lookups())), [lookup_tool(probe, gate=gate)], parallel_tools=2)
    session = rt.session("ops", "s1")
    await session.start("go", turn_id="t1")
    while probe.in_flight < 2:
        await asyncio.sleep(0.001)
    assert await session.cancel("t1")
    gate.set()
    result = await session.result("t1")
    assert result.status == "cancelled"
    assert set(probe.runs) == {"k1", "k2"}  # the two running finished; k3 and k4 never started
    results = {m.call_id: m.result for m in transcript(store) if isinstance(m, ToolMessage)}
    assert results["c1"] == {"key": "k1", "value": "K1"} and results["c3"] == {"cancelled": True}
    assert list(results) == CALLS


def test_parallel_tools_must_be_a_positive_whole_number() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(AgentDefinitionError, match="parallel_tools"):
            runtime_with(make_store("memory"), ScriptedModel(["hi"]), parallel_tools=bad)


def _two_calls() -> list[dict[str, Any]]:
    return [{"id": "c1", "name": "first", "input": {}}, {"id": "c2", "name": "second", "input": {}}]


def _first_and_second(second_started: asyncio.Event, first: Any, release: asyncio.Event | None = None) -> list[Tool]:
    """Tools ``first`` (call c1) and ``second`` (c2): ``second`` says it started, then waits for ``release`` (or
    until it is cancelled); ``first`` is given, and waits for ``second_started`` itself."""

    @tool
    async def second(ctx: ToolContext) -> str:
        """Start, then wait."""
        second_started.set()
        await (release or asyncio.Event()).wait()
        return "second done"

    return [tool(first), second]


async def test_a_call_whose_result_the_store_refuses_fails_the_turn_at_its_own_step_not_a_sibling_s() -> None:
    from june_worker.engine.store import Commit
    from june_worker.errors import StoreError
    from june_worker.stores import MemoryStore

    class RefusesC1(MemoryStore):
        def commit(self, ref: Any, commit: Any, *, fence: int | None = None) -> Any:
            if isinstance(commit, Commit) and any(s.step_id == "tool:1:c1" for s in commit.steps):
                raise StoreError("the store refused the row")
            return super().commit(ref, commit, fence=fence)

    started = asyncio.Event()

    async def first(ctx: ToolContext) -> str:
        """Return once the other call runs."""
        await started.wait()
        return "first done"

    store = RefusesC1()
    rt = runtime_with(store, ScriptedModel(_script(_two_calls())), _first_and_second(started, first), parallel_tools=2)
    session = rt.session("ops", "s1")
    # Given two calls running together, the second started after the first
    await session.start("go", turn_id="t1")

    # When the first call's result cannot be committed (a fault outside any tool)
    result = await session.result("t1")

    # Then the turn fails at the first call's step, not at the step of the call that started last
    assert result.status == "failed" and "refused the row" in result.error.message
    assert (result.phase, result.step) == ("tool", "tool:1:c1")


async def test_a_transient_fault_in_a_parallel_call_is_logged_at_that_calls_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from june_worker.errors import StoreUnavailableError

    started, raised = asyncio.Event(), Counter()

    async def first(ctx: ToolContext) -> str:
        """Meet a lost connection once the other call runs, then succeed."""
        await started.wait()
        raised.runs += 1
        if raised.runs == 1:
            raise StoreUnavailableError("the connection was lost")
        return "first done"

    release = asyncio.Event()
    store = make_store("memory")
    tools = _first_and_second(started, first, release)
    session = runtime_with(store, ScriptedModel(_script(_two_calls())), tools, parallel_tools=2).session("ops", "s1")
    # Given two calls running together, the second started after the first
    with caplog.at_level("WARNING", logger="june_worker.turn"):
        await session.start("go", turn_id="t1")
        # When the first meets a transient fault, and its step runs again
        while raised.runs < 2:
            await asyncio.sleep(0.01)
        release.set()
        assert (await session.result("t1")).status == "completed"
    # Then the log names the first call's step, not the step of the call that started last
    faults = [r.getMessage() for r in caplog.records if "transient fault" in r.getMessage()]
    assert faults and all("transient fault at tool:1:c1 " in m for m in faults), faults


async def test_the_async_calls_of_a_batch_start_before_its_sync_calls_run(store_kind: str) -> None:
    order: list[str] = []

    @tool
    async def fetch(ctx: ToolContext) -> str:
        """An async call: note when it starts and ends."""
        order.append("fetch started")
        await asyncio.sleep(0.05)
        order.append("fetch ended")
        return "fetched"

    @tool
    def record(ctx: ToolContext) -> str:
        """A sync call: note when it runs."""
        order.append("record ran")
        return "recorded"

    store = make_store(store_kind)
    calls = [
        {"id": "c1", "name": "record", "input": {}},
        *({"id": f"c{i}", "name": "fetch", "input": {}} for i in (2, 3)),
    ]
    rt = runtime_with(store, ScriptedModel(_script(calls)), [record, fetch], parallel_tools=2)
    # Given a sync call before two async ones in a batch, When the batch runs
    assert await rt.session("ops", "s1").turn("go", turn_id="t1") == "all looked up"
    # Then the async calls were already waiting while the sync one ran; results keep call order
    assert order == ["fetch started", "fetch started", "record ran", "fetch ended", "fetch ended"]
    assert _tool_messages(store) == ["c1", "c2", "c3"]
