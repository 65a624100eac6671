"""Human in the loop, in process (scenarios H): park, resume, answerers, schemas, timeouts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from june_worker import ToolContext, tool
from june_worker.engine.agent import AnswerRequest
from june_worker.engine.events import Completed, Suspended
from june_worker.engine.store import input_step_id
from june_worker.engine.types import ToolMessage, UserAnswerer
from june_worker.errors import (
    InvalidAnswerError,
    ResumeAuthorizationError,
    ResumeConflictError,
    TurnRejectedError,
)
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import MemoryStore, SQLiteStore

from .kit import APPROVE_SCRIPT, SLACK_EVENT, Counter, Recorder, approve_tool, ask_tool, runtime_with, transcript


async def _parked(store: Any = None, event: dict[str, Any] | None = SLACK_EVENT, **agent_kw: Any) -> Any:
    counter = Counter()
    model = ScriptedModel(APPROVE_SCRIPT)
    rt = runtime_with(store or MemoryStore(), model, [approve_tool(counter)], **agent_kw)
    s = rt.session("ops", "s1")
    rec = Recorder()
    s.observe(rec)
    await s.start("refund please", turn_id="t1", event=event)
    result = await s.result("t1")
    return s, rec, model, counter, result


async def test_s66_a_tool_parks_the_turn_and_resume_runs_it_to_completion() -> None:
    s, rec, model, counter, result = await _parked()
    assert isinstance(result, Suspended)
    assert result.request.id == "approve-1" and result.request.prompt == "Approve the refund?"
    assert result.request.answerers == UserAnswerer(user="U1")  # the attested speaker by default
    assert rec.events[-1].type == "input.requested" and rec.events[-1].request.id == "approve-1"
    assert s.store.load(s.ref).status == "suspended"

    await s.resume("t1", "approve-1", True, by="U1")
    final = await s.result("t1")
    assert isinstance(final, Completed) and final.text == "Approved — refund sent."
    assert model.calls == 2  # the pre-park model step was cached
    assert counter.runs == 2  # the parked tool ran again from the top
    resumed = [e for e in rec.of("turn.started") if e.trigger.kind == "resume"]
    assert len(resumed) == 1 and resumed[0].trigger.call_id == "c1"
    assert s.store.load(s.ref).steps[input_step_id("t1", "approve-1")].data["answer"] is True


async def test_the_suspended_checkpoint_holds_request_call_opening_policy_and_event_without_raw() -> None:
    event = {**SLACK_EVENT, "raw": {"token": "secret"}}
    s, *_ = await _parked(event=event, policies={"slack": "Be brief."})
    parked = s.pending()
    assert parked is not None
    assert (parked.turn_id, parked.call_id, parked.opening_text) == ("t1", "c1", "refund please")
    assert parked.request.id == "approve-1"
    assert parked.policy is not None and parked.policy.overlay == "Be brief."
    assert parked.event is not None and parked.event.raw is None and parked.event.source == "slack"


async def test_s67_resume_enforces_the_answerer() -> None:
    s, *_ = await _parked()
    with pytest.raises(ResumeAuthorizationError, match="not authorized"):
        await s.resume("t1", "approve-1", True, by="U2")
    with pytest.raises(ResumeAuthorizationError):
        await s.resume("t1", "approve-1", True)
    await s.resume("t1", "approve-1", True, by="U1")
    assert (await s.result("t1")).status == "completed"


async def test_conflicts_are_distinct_from_authorization() -> None:
    s, *_ = await _parked()
    with pytest.raises(ResumeConflictError, match="parked on turn t1"):
        await s.resume("t9", "approve-1", True, by="U1")
    with pytest.raises(ResumeConflictError, match="waiting for input 'approve-1', not 'other'"):
        await s.resume("t1", "other", True, by="U1")
    await s.resume("t1", "approve-1", True, by="U1")
    await s.result("t1")
    with pytest.raises(ResumeConflictError, match="not suspended"):
        await s.resume("t1", "approve-1", True, by="U1")  # never applied twice


async def test_an_unattested_speaker_without_answerers_refuses_to_park() -> None:
    email = {"source": "email", "user": {"id": "someone@example.com", "attested": False}}
    s, rec, _, _, result = await _parked(event=email)
    assert result.status == "failed"
    assert "not attested" in result.error.message and "answerers" in result.error.message


async def test_a_programmatic_turn_parks_with_no_restriction() -> None:
    s, _, _, _, result = await _parked(event=None)
    assert isinstance(result, Suspended) and result.request.answerers is None
    await s.resume("t1", "approve-1", "ok")  # no by needed: the app drives its own resume
    assert (await s.result("t1")).status == "completed"


async def test_policy_answerers_go_through_authorize_answer() -> None:
    asked: list[AnswerRequest] = []

    async def authorize(req: AnswerRequest) -> bool:
        asked.append(req)
        return req.policy == "operator" and req.scope == "mailbox:scout" and req.by == "op1"

    @tool
    async def approve(ctx: ToolContext) -> dict[str, Any]:
        """Ask an operator."""
        return {
            "ok": await ctx.request_input(
                id="a", prompt="?", answerers={"policy": "operator", "scope": "mailbox:scout"}
            )
        }

    script = [Reply("", calls=[{"id": "c1", "name": "approve", "input": {}}]), Reply("done")]
    rt = runtime_with(MemoryStore(), ScriptedModel(script), [approve], authorize_answer=authorize)
    s = rt.session("ops", "s1")
    await s.start("go", turn_id="t1", event=SLACK_EVENT)
    assert (await s.result("t1")).status == "suspended"
    with pytest.raises(ResumeAuthorizationError):
        await s.resume("t1", "a", True, by="U1")
    await s.resume("t1", "a", True, by="op1")
    assert (await s.result("t1")).status == "completed"
    assert [a.by for a in asked] == ["U1", "op1"]


async def test_an_authorize_hook_that_throws_leaves_the_answer_unapplied_for_a_retry() -> None:
    outage = {"on": True}

    def authorize(req: AnswerRequest) -> bool:
        if outage["on"]:
            raise ConnectionError("db outage")
        return True

    @tool
    async def approve(ctx: ToolContext) -> dict[str, Any]:
        """Ask."""
        return {"ok": await ctx.request_input(id="a", prompt="?", answerers={"policy": "ops"})}

    script = [Reply("", calls=[{"id": "c1", "name": "approve", "input": {}}]), Reply("done")]
    rt = runtime_with(MemoryStore(), ScriptedModel(script), [approve], authorize_answer=authorize)
    s = rt.session("ops", "s1")
    await s.start("go", turn_id="t1")
    await s.result("t1")
    with pytest.raises(ConnectionError):
        await s.resume("t1", "a", True, by="op1")
    assert s.pending() is not None  # still parked, nothing applied
    outage["on"] = False
    await s.resume("t1", "a", True, by="op1")
    assert (await s.result("t1")).status == "completed"


async def test_a_bad_answer_is_refused_against_the_schema_and_the_turn_stays_parked() -> None:
    @tool
    async def refund(ctx: ToolContext, amount: float) -> dict[str, Any]:
        """Refund."""
        ok = await ctx.request_input(id="approve-refund", prompt=f"Refund {amount}?", schema={"type": "boolean"})
        return {"refunded": ok is True}

    script = [Reply("", calls=[{"id": "c1", "name": "refund", "input": {"amount": 5}}]), Reply("done")]
    store = SQLiteStore(":memory:")
    rt = runtime_with(store, ScriptedModel(script), [refund])
    s = rt.session("ops", "s1")
    await s.start("go", turn_id="t1")
    await s.result("t1")
    with pytest.raises(InvalidAnswerError, match="the answer does not satisfy the schema's 'type' rule") as refused:
        await s.resume("t1", "approve-refund", "yes")
    assert "yes" not in str(refused.value)  # the reason never quotes the answer (it reaches logs and task results)
    assert s.pending() is not None
    await s.resume("t1", "approve-refund", True)
    assert (await s.result("t1")).status == "completed"
    tool_msg = [m for m in transcript(store) if isinstance(m, ToolMessage)][0]
    assert tool_msg.result == {"refunded": True}


async def test_s70_two_inputs_in_sequence_in_one_tool() -> None:
    @tool
    async def ask2(ctx: ToolContext) -> dict[str, Any]:
        """Two questions."""
        return {
            "first": await ctx.request_input(id="q1", prompt="1"),
            "second": await ctx.request_input(id="q2", prompt="2"),
        }

    script = [Reply("", calls=[{"id": "c1", "name": "ask2", "input": {}}]), Reply("both answered")]
    rt = runtime_with(MemoryStore(), ScriptedModel(script), [ask2])
    s = rt.session("ops", "s1")
    await s.start("go", turn_id="t1")
    assert (await s.result("t1")).request.id == "q1"  # type: ignore[union-attr]
    await s.resume("t1", "q1", "A")
    assert (await s.result("t1")).request.id == "q2"  # type: ignore[union-attr]
    await s.resume("t1", "q2", "B")
    assert (await s.result("t1")).text == "both answered"  # type: ignore[union-attr]


async def test_s71_s13_answers_are_turn_scoped() -> None:
    store = SQLiteStore(":memory:")
    script = [
        Reply("", calls=[{"id": "c1", "name": "ask", "input": {}}]),
        Reply("one done"),
        Reply("", calls=[{"id": "c2", "name": "ask", "input": {}}]),
        Reply("two done"),
    ]
    rt = runtime_with(store, ScriptedModel(script), [ask_tool("a1")])
    s = rt.session("ops", "s1")
    await s.start("one", turn_id="t1")
    assert (await s.result("t1")).request.id == "a1"  # type: ignore[union-attr]
    await s.resume("t1", "a1", "yes")
    assert (await s.result("t1")).text == "one done"  # type: ignore[union-attr]
    await s.start("two", turn_id="t2")
    assert (await s.result("t2")).request.id == "a1"  # asked again: no reuse of t1's answer  # type: ignore[union-attr]
    await s.resume("t2", "a1", "no")
    assert (await s.result("t2")).text == "two done"  # type: ignore[union-attr]
    results = [m.result for m in transcript(store) if isinstance(m, ToolMessage)]
    assert results == [{"ok": "yes"}, {"ok": "no"}]


async def test_s72_a_new_turn_is_refused_while_parked_and_redelivery_re_parks_silently() -> None:
    s, rec, *_ = await _parked(event=None)
    with pytest.raises(TurnRejectedError, match='suspended awaiting input "approve-1"'):
        await s.start("unrelated", turn_id="t2")
    rejected = await s.result("t2")
    assert rejected.status == "rejected" and "suspended" in rejected.reason  # type: ignore[union-attr]
    await s.start("refund please", turn_id="t1")  # redelivery of the parked turn is allowed
    assert (await s.result("t1")).status == "suspended"
    # DESIGN.md: structural events appear once per stream, so the re-park announces nothing new
    assert len(rec.of("input.requested")) == 1
    await s.resume("t1", "approve-1", True)
    assert (await s.result("t1")).status == "completed"


async def test_s74_resuming_from_inside_the_input_requested_observer_keeps_the_continuation() -> None:
    counter = Counter()
    rt = runtime_with(MemoryStore(), ScriptedModel(APPROVE_SCRIPT), [approve_tool(counter)])
    s = rt.session("ops", "s1")
    tasks: list[asyncio.Task[None]] = []

    def on_event(event: Any) -> None:
        if event.type == "input.requested" and not tasks:
            tasks.append(asyncio.get_running_loop().create_task(s.resume("t1", "approve-1", True, by="U1")))

    s.observe(on_event)
    await s.start("refund please", turn_id="t1", event=SLACK_EVENT)
    while not tasks:  # the observer resumes as soon as the park is announced
        await asyncio.sleep(0.001)
    await asyncio.gather(*tasks)
    result = await s.result("t1")
    assert isinstance(result, Completed) and result.text == "Approved — refund sent."


async def test_two_resumes_racing_for_one_park_apply_exactly_once() -> None:
    s, *_ = await _parked(event=None)
    outcomes = await asyncio.gather(
        s.resume("t1", "approve-1", "first"), s.resume("t1", "approve-1", "second"), return_exceptions=True
    )
    assert sum(o is None for o in outcomes) == 1
    assert sum(isinstance(o, ResumeConflictError) for o in outcomes) == 1
    assert (await s.result("t1")).status == "completed"


async def test_a_park_with_a_timeout_is_answered_by_a_timeout_the_tool_can_catch() -> None:
    from june_worker.errors import InputTimeoutError

    @tool
    async def approve(ctx: ToolContext) -> dict[str, Any]:
        """Ask with a deadline."""
        try:
            return {"approved": await ctx.request_input(id="a", prompt="?", timeout_s=0.05)}
        except InputTimeoutError:
            return {"approved": False, "timed_out": True}

    script = [Reply("", calls=[{"id": "c1", "name": "approve", "input": {}}]), Reply("gave up waiting")]
    store = MemoryStore()
    rt = runtime_with(store, ScriptedModel(script), [approve])
    s = rt.session("ops", "s1")
    await s.start("go", turn_id="t1")
    parked = await s.result("t1")
    assert isinstance(parked, Suspended) and parked.request.expires_at is not None
    done = await asyncio.wait_for(_until_done(s, "t1"), timeout=5)
    assert done.text == "gave up waiting"
    assert [m.result for m in transcript(store) if isinstance(m, ToolMessage)] == [
        {"approved": False, "timed_out": True}
    ]


class _RefusalsCounted(MemoryStore):
    """Counts the timeouts it refuses as not due by its own clock."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = asyncio.Event()

    def commit(self, ref: Any, commit: Any, *, fence: int | None = None) -> Any:
        try:
            return super().commit(ref, commit, fence=fence)
        except ResumeConflictError:
            if getattr(commit, "expect_expired", False):
                self.refused.set()
            raise


async def test_a_park_timeout_the_store_refuses_as_not_due_is_tried_again_no_sooner_than_the_floor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time as real_time
    import types

    from june_worker.engine import session as session_module

    @tool
    async def approve(ctx: ToolContext) -> dict[str, Any]:
        """Ask with a deadline a minute away."""
        return {"approved": await ctx.request_input(id="a", prompt="?", timeout_s=60)}

    # This process's clock is two minutes ahead of the store's: by it, the park expired long ago.
    monkeypatch.setattr(session_module, "time", types.SimpleNamespace(time=lambda: real_time.time() + 120))
    store = _RefusalsCounted()
    script = [Reply("", calls=[{"id": "c1", "name": "approve", "input": {}}]), Reply("unreachable")]
    s = runtime_with(store, ScriptedModel(script), [approve]).session("ops", "s1")
    await s.start("go", turn_id="t1")
    assert isinstance(await s.result("t1"), Suspended)
    await asyncio.wait_for(store.refused.wait(), 5)  # the timer fired at once and the store said not yet
    await asyncio.sleep(0)  # the refusal's re-arm runs on the loop
    timer = s._timers["t1"]
    assert timer.when() - asyncio.get_running_loop().time() > 0.5 * session_module.PARK_REARM_FLOOR_S
    pending = store.pending(s.ref)
    assert pending is not None and pending.turn_id == "t1"  # still parked: the store's clock decides


async def _until_done(s: Any, turn_id: str) -> Any:
    while True:
        r = await s.result(turn_id)
        if r.status != "suspended":
            return r
        await asyncio.sleep(0.01)


async def test_pending_returns_none_when_not_parked() -> None:
    rt = runtime_with(MemoryStore(), ScriptedModel(["hi"]))
    s = rt.session("ops", "s1")
    await s.turn("hi")
    assert s.pending() is None


async def test_turn_refuses_to_park() -> None:
    from june_worker.errors import TurnSuspendedError

    rt = runtime_with(MemoryStore(), ScriptedModel(APPROVE_SCRIPT), [approve_tool()])
    with pytest.raises(TurnSuspendedError):
        await rt.session("ops", "s1").turn("refund")
