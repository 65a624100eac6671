"""Subagents as child turns, in process (``ctx.delegate``): the parent parks on its child and wakes when it ends.

Every test runs on the memory and SQLite stores. Crash tests name the boundary: a "crash" is
CrashAt raising where the process would die, then a new Runtime over the same store carries on.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from june_worker import Agent, Runtime, ToolContext, tool
from june_worker.engine.children import child_session_id, child_turn_id
from june_worker.engine.crash import CrashAt
from june_worker.engine.events import Cancelled, TurnResult
from june_worker.engine.signals import CrashInjected
from june_worker.engine.store import SessionRef, SessionStore
from june_worker.errors import FatalToolError, ResumeAuthorizationError
from june_worker.models import Reply, ScriptedModel

from .kit import Counter, make_store

TERMINAL = {"turn.completed", "turn.failed", "turn.cancelled"}
ANSWER = "widgets are trending; buy 3"


def delegating_tool(counter: Counter, agent: str = "researcher", *, wait: bool = True) -> Any:
    @tool
    async def ask_researcher(ctx: ToolContext, q: str) -> dict[str, Any]:
        """Ask the researcher agent."""
        counter.runs += 1
        return await ctx.delegate(agent=agent, text=q, wait=wait)

    return ask_researcher


def parent_script(calls: int = 1) -> list[Reply]:
    return [
        Reply(
            "Let me research that.",
            calls=[
                {"id": f"c{i + 1}", "name": "ask_researcher", "input": {"q": f"question {i + 1}"}} for i in range(calls)
            ],
        ),
        Reply("Research says: " + ANSWER),
    ]


class CountingModel(ScriptedModel):
    def __init__(self, replies: list[Reply], counter: Counter) -> None:
        super().__init__(replies)
        self.counter = counter

    def choose(self, request: Any) -> Reply:
        self.counter.runs += 1
        return super().choose(request)


def runtime(
    store: SessionStore,
    *,
    tool_runs: Counter | None = None,
    child_calls: Counter | None = None,
    child_tools: list[Any] | None = None,
    child_script: list[Reply] | None = None,
    calls: int = 1,
    **parent_kw: Any,
) -> Runtime:
    parent = Agent(
        name="ops",
        model=ScriptedModel(parent_script(calls)),
        tools=[delegating_tool(tool_runs if tool_runs is not None else Counter())],
        **parent_kw,
    )
    child = Agent(
        name="researcher",
        model=CountingModel(child_script or [Reply(ANSWER)], child_calls if child_calls is not None else Counter()),
        tools=child_tools or [],
    )
    return Runtime([parent, child], store)


async def ended(rt: Runtime, agent: str, session: str, turn_id: str, timeout_s: float = 10.0) -> TurnResult:
    """Wait for the turn's terminal event (it may park and resume in between), then its stored result."""
    s = rt.session(agent, session)
    done = asyncio.Event()
    stop = s.observe(lambda e: done.set() if e.type in TERMINAL else None, turn_id=turn_id, replay=True)
    try:
        await s.result(turn_id)  # kicks the session (a new runtime looks at it)
        await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        stop()
    rec = rt.store.get_turn(SessionRef(agent, session), turn_id)
    assert rec is not None and rec.result is not None
    return rec.result


def child_ref(call: str = "c1", turn: str = "t1") -> SessionRef:
    """The session of the child turn that call ``call`` of ops/s1's turn ``turn`` started on the researcher agent."""
    parent = SessionRef("ops", "s1")
    return SessionRef("researcher", child_session_id(parent.session, child_turn_id(parent, turn, call), call))


def child_of(parent: SessionRef, turn: str, call: str, agent: str) -> tuple[SessionRef, str]:
    """The child session and turn that call ``call`` of ``turn`` in ``parent`` starts on ``agent``."""
    turn_id = child_turn_id(parent, turn, call)
    return SessionRef(agent, child_session_id(parent.session, turn_id, call)), turn_id


def tool_result(store: SessionStore, step: str = "tool:1:c1") -> Any:
    snap = store.load(SessionRef("ops", "s1"))
    return snap.steps[step].data


async def test_a_delegated_child_turn_answers_its_parent_which_resumes_with_its_result(store_kind: str) -> None:
    store = make_store(store_kind)
    rt = runtime(store)
    await rt.session("ops", "s1").start("should I order widgets?", turn_id="t1")

    result = await ended(rt, "ops", "s1", "t1")

    assert result.status == "completed" and result.text == "Research says: " + ANSWER
    child_turn = child_turn_id(SessionRef("ops", "s1"), "t1", "c1")
    (child,) = [store.get_turn(child_ref(), child_turn)]
    assert child is not None and child.status == "completed" and child.payload.parent is not None
    assert (child.payload.parent.turn_id, child.payload.parent.call_id, child.payload.parent.depth) == ("t1", "c1", 1)
    assert tool_result(store)["result"] == {
        "status": "completed",
        "text": ANSWER,
        "agent": "researcher",
        "session": child_ref().session,
        "turn_id": child_turn,
    }
    parked = [e for e in store.events(SessionRef("ops", "s1")) if e.type == "input.requested"]
    assert [e.request.id for e in parked] == [f"child:researcher:{child_turn}"]
    started = [e for e in store.events(child_ref()) if e.type == "turn.started"]
    assert started[0].parent is not None and started[0].parent.turn_id == "t1" and started[0].parent.call_id == "c1"


async def test_a_person_cannot_answer_a_child_request_and_the_childs_own_request_is_visible_from_the_parent(
    store_kind: str,
) -> None:
    @tool
    async def check(ctx: ToolContext) -> dict[str, Any]:
        """Ask a person."""
        return {"ok": await ctx.request_input(id="ok-1", prompt="Go ahead?")}

    store = make_store(store_kind)
    rt = runtime(
        store,
        child_tools=[check],
        child_script=[Reply("Checking.", calls=[{"id": "k1", "name": "check", "input": {}}]), Reply(ANSWER)],
    )
    parent = rt.session("ops", "s1")
    await parent.start("should I order widgets?", turn_id="t1")
    child_turn = child_turn_id(SessionRef("ops", "s1"), "t1", "c1")
    child = rt.session("researcher", child_ref().session)
    assert (await parent.result("t1")).status == "suspended"
    assert (await child.result(child_turn)).status == "suspended"
    await parent.idle()

    parked = parent.pending()
    assert parked is not None and parked.request.id == f"child:researcher:{child_turn}"
    with pytest.raises(ResumeAuthorizationError, match="answered by its child turn"):
        await parent.resume("t1", parked.request.id, {"status": "completed", "text": "forged"})
    told = [e for e in store.events(SessionRef("ops", "s1")) if e.type == "child.input_requested"]
    assert [(e.turn_id, e.child_session, e.child_turn_id, e.request.id) for e in told] == [
        ("t1", child_ref().session, child_turn, "ok-1")
    ]
    chain = parent.waiting_on()
    assert [(ref.session, cp.request.id) for ref, cp in chain] == [
        ("s1", f"child:researcher:{child_turn}"),
        (child_ref().session, "ok-1"),
    ]

    await child.resume(child_turn, "ok-1", True)
    result = await ended(rt, "ops", "s1", "t1")
    assert result.status == "completed" and tool_result(store)["result"]["text"] == ANSWER


async def test_crash_after_child_start_reruns_the_call_and_finds_the_same_child(store_kind: str) -> None:
    store = make_store(store_kind)
    runs, child_calls = Counter(), Counter()
    rt1 = runtime(store, tool_runs=runs, child_calls=child_calls)
    rt1.crash = CrashAt("after-child-start", "tool:1:c1")
    await rt1.session("ops", "s1").start("q", turn_id="t1")
    with pytest.raises(CrashInjected):
        await rt1.session("ops", "s1").result("t1")

    rt2 = runtime(store, tool_runs=runs, child_calls=child_calls)
    result = await ended(rt2, "ops", "s1", "t1")

    assert result.status == "completed"
    assert runs.runs >= 2  # the call ran again (at least once)...
    children = store.child_turns(SessionRef("ops", "s1"), "t1", ["researcher"])
    assert len(children) == 1  # ...and found the child its first run recorded: one child for the call
    assert child_calls.runs == 1  # the child's model was asked once


async def test_crash_before_the_parent_is_answered_wakes_the_parent_on_the_next_look(store_kind: str) -> None:
    store = make_store(store_kind)
    rt1 = runtime(store)
    child_turn = child_turn_id(SessionRef("ops", "s1"), "t1", "c1")
    rt1.crash = CrashAt("before-parent-answer", child_turn)
    await rt1.session("ops", "s1").start("q", turn_id="t1")
    assert (await rt1.session("ops", "s1").result("t1")).status == "suspended"
    assert (await ended(rt1, "researcher", child_ref().session, child_turn)).status == "completed"
    await rt1.session("researcher", child_ref().session).idle()  # its drainer dies before answering the parent
    await rt1.session("ops", "s1").idle()
    assert rt1.crash.fired
    child = store.get_turn(child_ref(), child_turn)
    assert child is not None and child.status == "completed"
    assert store.pending(SessionRef("ops", "s1")) is not None  # the parent was never answered

    rt2 = runtime(store)
    result = await ended(rt2, "ops", "s1", "t1")

    assert result.status == "completed" and tool_result(store)["result"]["status"] == "completed"
    assert len(store.child_turns(SessionRef("ops", "s1"), "t1", ["researcher"])) == 1


@pytest.mark.parametrize("point", ["before-tool-commit", "after-tool-commit"])
async def test_crash_at_the_parents_tool_commit_after_the_answer_starts_no_second_child(
    store_kind: str, point: str
) -> None:
    store = make_store(store_kind)
    runs, child_calls = Counter(), Counter()
    rt1 = runtime(store, tool_runs=runs, child_calls=child_calls)
    rt1.crash = crash = CrashAt(point, "tool:1:c1")
    await rt1.session("ops", "s1").start("q", turn_id="t1")
    assert (await rt1.session("ops", "s1").result("t1")).status == "suspended"
    child_turn = child_turn_id(SessionRef("ops", "s1"), "t1", "c1")
    assert (await ended(rt1, "researcher", child_ref().session, child_turn)).status == "completed"
    await rt1.session("ops", "s1").idle()  # resumed by the child's answer: it dies at the tool's commit
    assert crash.fired

    rt2 = runtime(store, tool_runs=runs, child_calls=child_calls)
    result = await ended(rt2, "ops", "s1", "t1")

    assert result.status == "completed"
    assert len(store.child_turns(SessionRef("ops", "s1"), "t1", ["researcher"])) == 1
    assert child_calls.runs == 1
    # the park's run, the resumed run; a committed result is never run again, an uncommitted one once more
    assert runs.runs == (3 if point == "before-tool-commit" else 2)


async def test_depth_past_the_limit_is_a_tool_error_the_model_reads(store_kind: str) -> None:
    @tool
    async def dig(ctx: ToolContext) -> dict[str, Any]:
        """Delegate to myself."""
        return await ctx.delegate(agent="nest", text="deeper")

    store = make_store(store_kind)
    nest = Agent(
        name="nest",
        model=ScriptedModel([Reply("", calls=[{"id": "d", "name": "dig", "input": {}}]), Reply("bottom")]),
        tools=[dig],
        max_child_depth=2,
    )
    rt = Runtime([nest], store)
    await rt.session("nest", "s1").start("go", turn_id="t1")

    result = await ended(rt, "nest", "s1", "t1")

    assert result.status == "completed"
    first, first_turn = child_of(SessionRef("nest", "s1"), "t1", "d", "nest")
    deepest, deepest_turn = child_of(first, first_turn, "d", "nest")
    data = store.load(deepest).steps["tool:1:d"].data
    assert "max_child_depth" in data["error"] and "depth 3" in data["error"]
    too_deep, _ = child_of(deepest, deepest_turn, "d", "nest")
    assert store.unfinished_turns(too_deep) == [] and store.load(too_deep).messages == []
    assert len(store.child_turns(deepest, deepest_turn, ["nest"])) == 0


async def test_fan_out_past_the_limit_is_a_tool_error_the_model_reads(store_kind: str) -> None:
    store = make_store(store_kind)
    rt = runtime(store, calls=3, max_children_per_turn=2)
    await rt.session("ops", "s1").start("q", turn_id="t1")

    result = await ended(rt, "ops", "s1", "t1")

    assert result.status == "completed"
    assert [tool_result(store, f"tool:1:c{i}")["result"]["status"] for i in (1, 2)] == ["completed", "completed"]
    third = tool_result(store, "tool:1:c3")
    assert "max_children_per_turn" in third["error"]
    assert len(store.child_turns(SessionRef("ops", "s1"), "t1", ["researcher"])) == 2


async def test_a_sync_tool_cannot_delegate(store_kind: str) -> None:
    @tool
    def ask_researcher(ctx: ToolContext, q: str) -> dict[str, Any]:
        """Sync, by mistake."""
        ctx.delegate(agent="researcher", text=q)
        return {}

    store = make_store(store_kind)
    rt = Runtime(
        [
            Agent(name="ops", model=ScriptedModel(parent_script()), tools=[ask_researcher]),
            Agent(name="researcher", model=ScriptedModel([Reply(ANSWER)])),
        ],
        store,
    )
    await rt.session("ops", "s1").start("q", turn_id="t1")
    result = await ended(rt, "ops", "s1", "t1")
    assert result.status == "failed" and "only an async tool can delegate" in result.error.message


async def _parked_on_a_busy_child(store_kind: str) -> tuple[SessionStore, Runtime, Any, asyncio.Event]:
    """ops/s1 turn t1 parked on its child, whose tool waits for the returned gate: (store, runtime, parent, gate)."""
    gate = asyncio.Event()
    entered = asyncio.Event()

    @tool
    async def slow(ctx: ToolContext) -> str:
        """Take a while."""
        entered.set()
        await gate.wait()
        return "slow done"

    store = make_store(store_kind)
    rt = runtime(
        store,
        child_tools=[slow],
        child_script=[Reply("", calls=[{"id": "w", "name": "slow", "input": {}}]), Reply(ANSWER)],
    )
    parent = rt.session("ops", "s1")
    await parent.start("q", turn_id="t1")
    await asyncio.wait_for(entered.wait(), 10)
    await parent.idle()
    return store, rt, parent, gate


async def test_cancelling_a_parent_parked_on_its_child_cancels_both_and_wedges_neither(store_kind: str) -> None:
    store, rt, parent, gate = await _parked_on_a_busy_child(store_kind)
    assert parent.pending() is not None

    assert await parent.cancel("t1")
    gate.set()
    result = await ended(rt, "ops", "s1", "t1")

    assert result.status == "cancelled"
    child = store.get_turn(child_ref(), child_turn_id(SessionRef("ops", "s1"), "t1", "c1"))
    assert child is not None and child.result is not None and child.result.status == "cancelled"
    assert child.result.reason == "parent"
    assert parent.pending() is None and rt.session("researcher", child_ref().session).pending() is None
    rt.agents["ops"].model = ScriptedModel([Reply("next turn ran")])
    assert await parent.turn("next", turn_id="t2") == "next turn ran"


async def test_resetting_a_parent_parked_on_its_child_cancels_the_child(store_kind: str) -> None:
    store, rt, parent, gate = await _parked_on_a_busy_child(store_kind)

    reset = parent.reset()
    gate.set()
    await reset
    child_turn = child_turn_id(SessionRef("ops", "s1"), "t1", "c1")
    child = await ended(rt, "researcher", child_ref().session, child_turn)

    assert child.status == "cancelled" and child.reason == "parent"
    assert parent.pending() is None
    assert (await parent.result("t1")).status == "cancelled"


async def test_parallel_calls_each_delegating_park_the_parent_once_on_all_its_children(store_kind: str) -> None:
    store = make_store(store_kind)
    runs = Counter()
    rt = runtime(store, tool_runs=runs, calls=4, parallel_tools=4)
    parent = rt.session("ops", "s1")
    await parent.start("q", turn_id="t1")

    result = await ended(rt, "ops", "s1", "t1")

    assert result.status == "completed"
    children = store.child_turns(SessionRef("ops", "s1"), "t1", ["researcher"])
    assert sorted(t.session for t in children) == [child_ref(f"c{i}").session for i in range(1, 5)]
    events = store.events(SessionRef("ops", "s1"))
    asked = [e.request.id for e in events if e.type == "input.requested"]
    # the children had not ended when the batch parked: one park with four child requests, one resume
    assert sorted(asked) == sorted(f"child:researcher:{t.turn_id}" for t in children)
    assert [e.trigger.kind for e in events if e.type == "turn.started"] == ["inbound", "resume"]
    assert [tool_result(store, f"tool:1:c{i}")["result"]["status"] for i in range(1, 5)] == ["completed"] * 4
    assert runs.runs == 8  # each call ran to its park, then once more to read its answer


async def test_cancelling_a_parent_whose_child_waits_for_a_person_says_nothing_was_cancelled(store_kind: str) -> None:
    @tool
    async def check(ctx: ToolContext) -> dict[str, Any]:
        """Ask a person."""
        return {"ok": await ctx.request_input(id="ok-1", prompt="Go ahead?")}

    store = make_store(store_kind)
    rt = runtime(
        store,
        child_tools=[check],
        child_script=[Reply("Checking.", calls=[{"id": "k1", "name": "check", "input": {}}]), Reply(ANSWER)],
    )
    parent = rt.session("ops", "s1")
    await parent.start("q", turn_id="t1")
    child_turn = child_turn_id(SessionRef("ops", "s1"), "t1", "c1")
    assert (await parent.result("t1")).status == "suspended"
    assert (await rt.session("researcher", child_ref().session).result(child_turn)).status == "suspended"

    # a parked child is never cancelled, so neither is its parent: the answer says so instead of pretending
    assert await parent.cancel("t1") is False
    assert parent.pending() is not None
    # and neither session is wedged: answering the child lets both finish
    await rt.session("researcher", child_ref().session).resume(child_turn, "ok-1", True)
    assert (await ended(rt, "ops", "s1", "t1")).status == "completed"


async def _parked_on_a_busy_child_and_a_person(
    store_kind: str,
) -> tuple[SessionStore, Runtime, Any, asyncio.Event, str]:
    """ops/s1 turn t1 parked on two requests: its child's (whose tool waits for the returned gate) and a person's.
    Returns (store, runtime, parent, gate, child turn id)."""
    gate = asyncio.Event()
    entered = asyncio.Event()

    @tool
    async def slow(ctx: ToolContext) -> str:
        """Take a while."""
        entered.set()
        await gate.wait()
        return "slow done"

    @tool
    async def approve(ctx: ToolContext) -> dict[str, Any]:
        """Ask a person."""
        return {"ok": await ctx.request_input(id="approve", prompt="Go?")}

    store = make_store(store_kind)
    script = [
        Reply(
            "",
            calls=[
                {"id": "c1", "name": "ask_researcher", "input": {"q": "q"}},
                {"id": "c2", "name": "approve", "input": {}},
            ],
        ),
        Reply("parent done"),
    ]
    parent_agent = Agent(
        name="ops", model=ScriptedModel(script), tools=[delegating_tool(Counter()), approve], parallel_tools=2
    )
    child_agent = Agent(
        name="researcher",
        model=ScriptedModel([Reply("", calls=[{"id": "w", "name": "slow", "input": {}}]), Reply(ANSWER)]),
        tools=[slow],
    )
    rt = Runtime([parent_agent, child_agent], store)
    parent = rt.session("ops", "s1")
    await parent.start("q", turn_id="t1")
    await asyncio.wait_for(entered.wait(), 10)
    await parent.idle()
    parked = parent.pending()
    assert parked is not None and len(parked.inputs()) == 2
    return store, rt, parent, gate, child_turn_id(SessionRef("ops", "s1"), "t1", "c1")


async def test_a_cancelled_parent_parked_on_a_child_and_a_person_ends_cancelled_when_the_child_ends(
    store_kind: str,
) -> None:
    # Given a parent parked on its busy child and on a person's request
    store, rt, parent, gate, child_turn = await _parked_on_a_busy_child_and_a_person(store_kind)

    # When the parent is cancelled, and its child then ends (cancelled with it)
    assert await parent.cancel("t1")
    stored = store.get_turn(SessionRef("ops", "s1"), "t1")
    assert stored is not None and stored.status == "suspended" and stored.cancel_reason == "requested"  # durable
    gate.set()

    # Then the parent ends cancelled without anyone answering the person's request, and the session goes on
    assert (await ended(rt, "researcher", child_ref().session, child_turn)).status == "cancelled"
    result = await ended(rt, "ops", "s1", "t1")
    assert result.status == "cancelled" and result.reason == "requested"
    assert parent.pending() is None
    calls = [m for m in store.load(SessionRef("ops", "s1")).messages if m.role == "tool"]
    assert [(m.call_id, m.result) for m in calls] == [("c1", {"cancelled": True}), ("c2", {"cancelled": True})]
    rt.agents["ops"].model = ScriptedModel([Reply("next turn ran")])
    assert await parent.turn("next", turn_id="t2") == "next turn ran"


async def test_a_crash_right_after_the_cancelled_childs_answer_still_ends_the_parent_cancelled(
    store_kind: str,
) -> None:
    # Given a parent parked on its busy child, cancelled, on a runtime that dies right after the child's answer
    store, rt, parent, gate = await _parked_on_a_busy_child(store_kind)
    child_turn = child_turn_id(SessionRef("ops", "s1"), "t1", "c1")
    rt.crash = crash = CrashAt("after-parent-answer", child_turn)
    assert await parent.cancel("t1")

    # When the child ends cancelled and answers its parent, and the process dies at once
    gate.set()
    assert (await ended(rt, "researcher", child_ref().session, child_turn)).status == "cancelled"
    await rt.session("researcher", child_ref().session).idle()
    assert crash.fired

    # Then the parent's cancel was stored with the answer: whoever runs it next ends it cancelled
    rec = store.get_turn(SessionRef("ops", "s1"), "t1")
    assert rec is not None and rec.cancel_reason == "requested"
    rt2 = runtime(store)
    result = await ended(rt2, "ops", "s1", "t1")
    assert result.status == "cancelled" and result.reason == "requested"


async def test_cancelling_a_grandparent_reaches_a_grandchild_through_a_child_parked_on_it(store_kind: str) -> None:
    gate = asyncio.Event()
    entered = asyncio.Event()

    @tool
    async def dig(ctx: ToolContext) -> dict[str, Any]:
        """Delegate one level down."""
        return await ctx.delegate(agent="leaf" if ctx.session_id.count(":sub:") else "mid", text="deeper")

    @tool
    async def slow(ctx: ToolContext) -> str:
        """Take a while."""
        entered.set()
        await gate.wait()
        return "slow done"

    def digger(name: str) -> Agent:
        return Agent(
            name=name,
            model=ScriptedModel([Reply("", calls=[{"id": "d", "name": "dig", "input": {}}]), Reply(f"{name} done")]),
            tools=[dig],
        )

    store = make_store(store_kind)
    leaf = Agent(
        name="leaf",
        model=ScriptedModel([Reply("", calls=[{"id": "w", "name": "slow", "input": {}}]), Reply("leaf done")]),
        tools=[slow],
    )
    rt = Runtime([digger("top"), digger("mid"), leaf], store)
    top = rt.session("top", "s1")
    # Given top parked on mid, mid parked on leaf, and leaf still working
    await top.start("go", turn_id="t1")
    await asyncio.wait_for(entered.wait(), 10)
    mid_ref, mid_turn = child_of(SessionRef("top", "s1"), "t1", "d", "mid")
    leaf_ref, leaf_turn = child_of(mid_ref, mid_turn, "d", "leaf")
    assert (await rt.session("mid", mid_ref.session).result(mid_turn)).status == "suspended"

    # When top is cancelled
    assert await top.cancel("t1")
    gate.set()

    # Then the cancel went down through mid to leaf, and came back up: all three end cancelled
    assert (await ended(rt, "leaf", leaf_ref.session, leaf_turn)).status == "cancelled"
    assert (await ended(rt, "mid", mid_ref.session, mid_turn)) == Cancelled(turn_id=mid_turn, reason="parent")
    assert (await ended(rt, "top", "s1", "t1")) == Cancelled(turn_id="t1", reason="requested")


async def test_a_parent_that_fails_cancels_its_unfinished_children(store_kind: str) -> None:
    gate, entered = asyncio.Event(), asyncio.Event()

    @tool
    async def slow(ctx: ToolContext) -> str:
        """Take a while."""
        entered.set()
        await gate.wait()
        return "slow done"

    @tool
    async def give_up(ctx: ToolContext) -> str:
        """Fail the turn once the child works."""
        await entered.wait()
        raise FatalToolError("the parent gives up")

    store = make_store(store_kind)
    script = [
        Reply(
            "",
            calls=[
                {"id": "c1", "name": "ask_researcher", "input": {"q": "q"}},
                {"id": "c2", "name": "give_up", "input": {}},
            ],
        ),
        Reply("never"),
    ]
    rt = Runtime(
        [
            Agent(
                name="ops", model=ScriptedModel(script), tools=[delegating_tool(Counter()), give_up], parallel_tools=2
            ),
            Agent(
                name="researcher",
                model=ScriptedModel([Reply("", calls=[{"id": "w", "name": "slow", "input": {}}]), Reply(ANSWER)]),
                tools=[slow],
            ),
        ],
        store,
    )
    # Given a parent whose call failed the turn while its other call's child turn is still working
    await rt.session("ops", "s1").start("q", turn_id="t1")
    result = await ended(rt, "ops", "s1", "t1")
    assert result.status == "failed" and "gives up" in result.error.message
    child_turn = child_turn_id(SessionRef("ops", "s1"), "t1", "c1")

    # Then the child was asked to stop, and ends cancelled once its tool returns: nobody reads its result
    child = store.get_turn(child_ref(), child_turn)
    assert child is not None and child.cancel_reason == "parent"
    gate.set()
    assert (await ended(rt, "researcher", child_ref().session, child_turn)) == Cancelled(
        turn_id=child_turn, reason="parent"
    )


async def test_two_parent_turns_that_reuse_a_call_id_get_a_child_session_each(store_kind: str) -> None:
    @tool
    async def check(ctx: ToolContext) -> dict[str, Any]:
        """Ask a person."""
        return {"ok": await ctx.request_input(id="ok-1", prompt="Go ahead?")}

    def parent_says(request: Any) -> Reply:
        last = request.messages[-1]
        if last.role == "tool":
            return Reply(f"started {last.result['status']}")
        # every turn's call has the same id, as a scripted model (or a provider numbering per reply) gives it
        return Reply("", calls=[{"id": "c1", "name": "ask_researcher", "input": {"q": last.text}}])

    def child_says(request: Any) -> Reply:
        last = request.messages[-1]
        if last.role == "user" and last.text == "ask first":
            return Reply("", calls=[{"id": "k1", "name": "check", "input": {}}])
        return Reply(f"answered {len(request.messages)} messages")

    store = make_store(store_kind)
    rt = Runtime(
        [
            Agent(name="ops", model=ScriptedModel(parent_says), tools=[delegating_tool(Counter(), wait=False)]),
            Agent(name="researcher", model=ScriptedModel(child_says), tools=[check]),
        ],
        store,
    )
    parent = rt.session("ops", "s1")
    # Given a first turn whose call c1 started a child that parked on a person
    assert await parent.turn("ask first", turn_id="t1") == "started started"
    first, first_turn = child_of(SessionRef("ops", "s1"), "t1", "c1", "researcher")
    assert (await rt.session("researcher", first.session).result(first_turn)).status == "suspended"

    # When a second turn's call, also c1, delegates again
    assert await parent.turn("second", turn_id="t2") == "started started"

    # Then its child runs in a session of its own: not rejected behind the first's park, nor reading its transcript
    second, second_turn = child_of(SessionRef("ops", "s1"), "t2", "c1", "researcher")
    done = await ended(rt, "researcher", second.session, second_turn)
    assert done.status == "completed" and done.text == "answered 1 messages"
    assert [m.text for m in store.load(second).messages if m.role == "user"] == ["second"]
    assert rt.session("researcher", first.session).pending() is not None  # the first child still waits
    assert second != first


async def test_the_parents_events_name_the_child_turn_of_a_delegated_call(store_kind: str) -> None:
    store = make_store(store_kind)
    rt = runtime(store)
    # Given a parent whose call delegates, When it parks on the child and wakes with its result
    await rt.session("ops", "s1").start("q", turn_id="t1")
    assert (await ended(rt, "ops", "s1", "t1")).status == "completed"

    # Then the parent's input.requested and action.completed carry the child's agent, session and turn id
    child, child_turn = child_of(SessionRef("ops", "s1"), "t1", "c1", "researcher")
    events = store.events(SessionRef("ops", "s1"))
    (asked,) = [e for e in events if e.type == "input.requested"]
    (done,) = [e for e in events if e.type == "action.completed"]
    for e in (asked, done):
        assert (e.turn_id, e.child_agent, e.child_session, e.child_turn_id) == (
            "t1",
            "researcher",
            child.session,
            child_turn,
        )
        assert {"child_agent", "child_session", "child_turn_id"} <= set(e.model_dump())
    # and the child's turn.started names the parent turn: each side carries the other's id
    (started,) = [e for e in store.events(child) if e.type == "turn.started"]
    assert started.parent is not None and started.parent.turn_id == "t1"


def test_events_of_calls_that_did_not_delegate_read_as_they_always_did() -> None:
    from june_worker.engine.events import ActionCompleted, InputRequested, TurnEventAdapter
    from june_worker.engine.types import InputRequest, ToolCall

    done = ActionCompleted(turn_id="t1", step="tool:1:c1", call=ToolCall(id="c1", name="n", input={}), result=1)
    asked = InputRequested(turn_id="t1", step="tool:1:c1", request=InputRequest(id="ok", prompt="?"))
    for e in (done, asked):
        data = e.model_dump(mode="json")
        assert not {"child_agent", "child_session", "child_turn_id"} & set(data)
        assert TurnEventAdapter.validate_python(data) == e  # and an event stored without them loads
