"""Control that always finishes, in process (issue 11): a reset a new turn queues behind, parks that expire anywhere."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from june_worker import ToolContext, tool
from june_worker.engine.events import Completed, Suspended
from june_worker.errors import InputTimeoutError, ResumeConflictError
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import SQLiteStore

from . import kit


async def test_s90_a_turn_started_right_after_a_reset_of_a_parked_session_runs_on_the_new_generation(
    store_kind: str,
) -> None:
    # Given a session parked on t1's approval
    store = kit.make_store(store_kind)
    model = ScriptedModel(
        lambda request: (
            kit.APPROVE_SCRIPT[0] if request.messages[-1].text == "refund" else Reply("on the new generation")
        )
    )
    s = kit.runtime_with(store, model, [kit.approve_tool()]).session("ops", "s1")
    assert isinstance(await s.result(await s.start("refund", turn_id="t1")), Suspended)
    # When it is reset, not awaited, and a turn starts at once
    reset = s.reset()
    t2 = await s.start("hello", turn_id="t2")
    # Then the turn queued behind the reset and ran on the new generation
    assert (await reset).generation == 0
    done = await s.result(t2)
    assert isinstance(done, Completed) and done.text == "on the new generation"
    assert [m.turn_id for m in kit.transcript(store)] == ["t2", "t2"]
    assert store.get_turn(s.ref, "t1").status == "cancelled"  # type: ignore[union-attr]


def _asking(timeout_s: float) -> Any:
    @tool
    async def ask(ctx: ToolContext) -> dict[str, Any]:
        """Ask, briefly."""
        try:
            return {"answer": await ctx.request_input(id="q", prompt="?", timeout_s=timeout_s)}
        except InputTimeoutError:
            return {"answer": "timed out"}

    return ask


def _model() -> ScriptedModel:
    def script(request: Any) -> Reply:
        last = request.messages[-1]
        if last.role == "tool":
            return Reply(f"went on: {last.result['answer']}")
        if last.text == "ask":
            return Reply("", calls=[{"id": "c1", "name": "ask", "input": {}}])
        return Reply(f"ok: {last.text}")

    return ScriptedModel(script)


async def test_a_park_left_by_a_process_that_ended_expires_in_the_next_runtime(tmp_path: Path) -> None:
    # Given a runtime that parked t1 for 50 ms and then went away (its timer with it)
    path = tmp_path / "june.db"
    first = SQLiteStore(path)
    s1 = kit.runtime_with(first, _model(), [_asking(0.05)]).session("ops", "s1")
    assert isinstance(await s1.result(await s1.start("ask", turn_id="t1")), Suspended)
    for timer in s1._timers.values():  # the process ended: nothing it armed survives
        timer.cancel()
    first.close()
    await asyncio.sleep(0.1)
    # When a new runtime over the same file first looks at the session
    second = SQLiteStore(path)
    s2 = kit.runtime_with(second, _model(), [_asking(0.05)]).session("ops", "s1")
    t2 = await s2.start("next", turn_id="t2")  # not refused: the expired park is answered first
    # Then the parked turn went on without an answer, and the new turn ran after it
    assert (await s2.result("t1")).text == "went on: timed out"  # type: ignore[union-attr]
    assert (await s2.result(t2)).text == "ok: next"  # type: ignore[union-attr]
    second.close()


async def test_a_park_that_expired_is_answered_by_its_next_look_and_a_late_answer_is_refused(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "june.db")
    s1 = kit.runtime_with(store, _model(), [_asking(0.05)]).session("ops", "s1")
    await s1.result(await s1.start("ask", turn_id="t1"))
    for timer in s1._timers.values():
        timer.cancel()
    await asyncio.sleep(0.1)
    s2 = kit.runtime_with(store, _model(), [_asking(0.05)]).session("ops", "s1")
    with pytest.raises(ResumeConflictError, match="expired before this answer came"):
        await s2.resume("t1", "q", True)
    assert (await s2.result("t1")).text == "went on: timed out"  # type: ignore[union-attr]
    store.close()
