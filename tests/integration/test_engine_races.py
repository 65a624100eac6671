"""Two in-process runtimes on one Postgres database racing one turn id (issue 24, item 4).

The in-process runtime takes no lease, so two of them (two processes, or two runtimes of one) may run the
same turn at once. The store's unique message index lets only one commit of each step land; the runner
whose commit is refused lost a race, not its turn: it stops, and reports the winner's outcome.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from june_worker import ToolContext, tool
from june_worker.engine.crash import CrashAt
from june_worker.engine.events import Completed
from june_worker.engine.signals import CrashInjected
from june_worker.engine.store import SessionRef, SessionStore
from june_worker.models import ScriptedModel
from tests.integration.test_engine_postgres import own_schema  # noqa: F401 - each test in a schema of its own
from tests.unit import kit

pytestmark = pytest.mark.integration

REF = SessionRef("ops", "s1")


def _stored_status(store: SessionStore, turn_id: str) -> str | None:
    rec = store.get_turn(REF, turn_id)
    return rec.status if rec is not None else None


async def test_a_runtime_whose_commit_of_a_turn_is_refused_reports_the_winners_result() -> None:
    # Given two runtimes, each on its own store over one Postgres database, serving a turn that calls a sync tool
    counter = kit.Counter()
    stores = [kit.make_store("postgres"), kit.make_store("postgres")]
    model = ScriptedModel(kit.ORDER_SCRIPT, delay_s=0.001)
    sessions = [kit.runtime_with(s, model, [kit.order_tool(counter)]).session("ops", "s1") for s in stores]
    # When both start the same turn id at once (one opens it, the other replays it; both ask the model, one
    # reply commits and the other's commit of that step is refused)
    for session in sessions:
        await session.start("Order 3 widgets", turn_id="t1")
    results = await asyncio.wait_for(asyncio.gather(*(s.result("t1") for s in sessions)), 30)
    # Then both report the turn's completion, which is what the store holds, with one terminal event
    assert all(isinstance(r, Completed) and r.text == "Done — order placed." for r in results), results
    assert _stored_status(stores[0], "t1") == "completed"
    terminal = [e.type for e in stores[0].events(REF) if e.type.startswith("turn.") and e.type != "turn.started"]
    assert terminal == ["turn.completed"]
    assert model.calls == 3  # both asked for the first step; only the winner went on


async def test_a_runtime_that_lost_the_race_runs_the_turn_on_when_the_winner_dies() -> None:
    # Given two runtimes racing one turn as above, and whichever wins the first step dies right after its tool
    # step committed (one crash hook, shared: it fires once)
    counter = kit.Counter()
    crash = CrashAt("after-tool-commit", "tool:1:c1")
    stores = [kit.make_store("postgres"), kit.make_store("postgres")]
    model = ScriptedModel(kit.ORDER_SCRIPT, delay_s=0.001)
    runtimes = [kit.runtime_with(s, model, [kit.order_tool(counter)]) for s in stores]
    for rt in runtimes:
        rt.crash, rt.race_stall_s = crash, 0.5
    sessions = [rt.session("ops", "s1") for rt in runtimes]
    # When both start the turn
    for session in sessions:
        await session.start("Order 3 widgets", turn_id="t1")
    results = await asyncio.wait_for(asyncio.gather(*(s.result("t1") for s in sessions), return_exceptions=True), 30)
    # Then the winner's host stopped at the crash, and the other, seeing the turn stop moving, finished it from
    # the store: the tool ran once, the turn completed
    assert sorted(type(r).__name__ for r in results) == ["Completed", "CrashInjected"], results
    assert counter.runs == 1 and kit.count_orders(stores[0]) == 1
    assert _stored_status(stores[0], "t1") == "completed"


async def test_a_sync_tool_both_runtimes_ran_for_one_step_commits_its_write_once() -> None:
    # Given a turn left running after its model step committed a call to a sync tool (its process died)
    counter = kit.Counter()
    crashed = kit.make_store("postgres")
    first = kit.runtime_with(crashed, ScriptedModel(kit.ORDER_SCRIPT), [kit.order_tool(counter)])
    first.crash = CrashAt("after-model-commit", "model:1")
    with pytest.raises(CrashInjected):
        await first.session("ops", "s1").turn("Order 3 widgets", turn_id="t1")
    # ... and two runtimes in two threads (two event loops, two stores on the database), whose tool holds its
    # step's transaction open until both are inside it
    both_inside = threading.Barrier(2, timeout=20)
    ran: list[str] = []

    @tool
    def create_order(ctx: ToolContext, item: str, qty: int = 1) -> dict[str, Any]:
        """Place an order for an item."""
        ran.append(threading.current_thread().name)
        ctx.store.execute("insert into orders (item, qty) values (?, ?)", item, qty)
        both_inside.wait()
        return {"item": item, "qty": qty}

    stores = [kit.make_store("postgres"), kit.make_store("postgres")]
    with stores[0].pool.connection() as conn:  # type: ignore[attr-defined]
        conn.execute("create table orders (item text, qty integer)")  # made up front: a create would lock

    def replay(store: SessionStore) -> Any:
        session = kit.runtime_with(store, ScriptedModel(kit.ORDER_SCRIPT), [create_order]).session("ops", "s1")
        return asyncio.run(asyncio.wait_for(session.result("t1"), 30))

    # When both replay the turn at once
    results = await asyncio.gather(*(asyncio.to_thread(replay, s) for s in stores))
    # Then the tool ran in both, its write committed once, and both report the turn's one completion
    assert len(ran) == 2
    assert kit.count_orders(stores[0]) == 1
    assert all(isinstance(r, Completed) and r.text == "Done — order placed." for r in results), results
    completed = [e for e in stores[0].events(REF) if e.type == "action.completed"]
    assert len(completed) == 1
