"""Several pending inputs per turn, in process: calls run in parallel may each park.

The turn parks with every open request; each is answered on its own, by its own answerers; the
turn goes on when the last one is answered or expires. Two answers for different requests both
apply; two for the same request, one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from june_worker import ToolContext, tool
from june_worker.engine.crash import CrashAt
from june_worker.engine.events import InputAnswered, InputRequested, Suspended, TurnStarted
from june_worker.engine.signals import CrashInjected
from june_worker.engine.store import SessionRef, SessionStore
from june_worker.engine.types import ToolMessage
from june_worker.errors import InputTimeoutError, ResumeAuthorizationError, ResumeConflictError
from june_worker.models import Reply, ScriptedModel

from .kit import Counter, Recorder, make_store, runtime_with, transcript

REF = SessionRef("ops", "s1")

SCRIPT = [
    Reply(
        "Asking finance and legal.",
        calls=[
            {"id": "c1", "name": "sign_off", "input": {"desk": "finance"}},
            {"id": "c2", "name": "sign_off", "input": {"desk": "legal"}},
        ],
    ),
    "Both desks answered.",
]

ANSWERERS = {"finance": "cfo", "legal": "counsel"}


def sign_off_tool(runs: Counter, timeouts: dict[str, float] | None = None) -> Any:
    @tool
    async def sign_off(ctx: ToolContext, desk: str) -> dict[str, Any]:
        """Ask a desk to sign off."""
        runs.runs += 1
        try:
            ok = await ctx.request_input(
                id=f"{desk}-ok",
                prompt=f"Does {desk} sign off?",
                schema={"type": "boolean"},
                answerers={"user": ANSWERERS[desk]},
                timeout_s=(timeouts or {}).get(desk),
            )
        except InputTimeoutError:
            return {"desk": desk, "signed": None}
        return {"desk": desk, "signed": ok}

    return sign_off


async def _parked(store: SessionStore, runs: Counter | None = None, **kw: Any) -> tuple[Any, Recorder]:
    rt = runtime_with(store, ScriptedModel(SCRIPT), [sign_off_tool(runs or Counter(), **kw)], parallel_tools=4)
    session = rt.session("ops", "s1")
    seen = Recorder()
    session.observe(seen)
    await session.start("sign this off", turn_id="t1")
    result = await session.result("t1")
    assert isinstance(result, Suspended)
    return session, seen


async def _parked_by_a_process_that_ended(store: SessionStore, **kw: Any) -> None:
    """Park the turn on a runtime of its own event loop, then close that loop: no timer of it survives (as when
    the process that parked the turn ended)."""
    import asyncio

    def park() -> None:
        asyncio.run(_parked(store, **kw))

    await asyncio.to_thread(park)


def _signed(store: SessionStore) -> list[Any]:
    return [m.result for m in transcript(store) if isinstance(m, ToolMessage)]


async def test_two_parallel_calls_park_the_turn_on_both_requests(store_kind: str) -> None:
    store = make_store(store_kind)
    session, seen = await _parked(store)
    result = await session.result("t1")
    assert [result.request.id, *[r.id for r in result.more]] == ["finance-ok", "legal-ok"]
    parked = session.pending()
    assert parked is not None
    assert [(i.request.id, i.call_id) for i in parked.inputs()] == [("finance-ok", "c1"), ("legal-ok", "c2")]
    requested: list[InputRequested] = seen.of("input.requested")
    assert [e.request.id for e in requested] == ["finance-ok", "legal-ok"]


async def test_each_request_is_answered_on_its_own_and_the_turn_goes_on_after_the_last(store_kind: str) -> None:
    store = make_store(store_kind)
    runs = Counter()
    session, seen = await _parked(store, runs)
    # the second request first: the turn stays parked on the first
    await session.resume("t1", "legal-ok", False, by="counsel")
    assert (await session.result("t1")).status == "suspended"
    parked = session.pending()
    assert parked is not None and [i.request.id for i in parked.inputs()] == ["finance-ok"]
    answered: list[InputAnswered] = seen.of("input.answered")
    assert [(e.input_id, e.open) for e in answered] == [("legal-ok", 1)]
    assert not [e for e in seen.of("turn.started") if e.trigger.kind == "resume"]
    # then the other: the turn goes on, each call reads its own answer
    await session.resume("t1", "finance-ok", True, by="cfo")
    assert (await session.result("t1")).status == "completed"
    assert _signed(store) == [{"desk": "finance", "signed": True}, {"desk": "legal", "signed": False}]
    resumed = [e for e in seen.of("turn.started") if isinstance(e, TurnStarted) and e.trigger.kind == "resume"]
    assert len(resumed) == 1
    assert runs.runs == 4  # each call ran again once, after the park


async def test_a_partial_answer_rewrites_the_turns_stored_result_to_the_requests_still_open(store_kind: str) -> None:
    from june_worker.gateway.routes import recorded_outcome

    store = make_store(store_kind)
    session, _ = await _parked(store)
    rec = store.get_turn(REF, "t1")
    assert rec is not None and isinstance(rec.result, Suspended) and [q.id for q in rec.result.more] == ["legal-ok"]

    # When one of the two requests is answered
    await session.resume("t1", "finance-ok", True, by="cfo")

    # Then the turn's row (what a reader falls back on when the stream lost the events) waits on the other only
    rec = store.get_turn(REF, "t1")
    assert rec is not None and rec.status == "suspended" and isinstance(rec.result, Suspended)
    assert (rec.result.request.id, rec.result.more) == ("legal-ok", [])
    outcome = recorded_outcome(rec, "1-0")
    assert outcome is not None and outcome.status == "suspended" and outcome.inputs is None
    assert outcome.input is not None and outcome.input["id"] == "legal-ok"


async def test_each_request_keeps_its_own_answerers(store_kind: str) -> None:
    session, _ = await _parked(make_store(store_kind))
    with pytest.raises(ResumeAuthorizationError):
        await session.resume("t1", "legal-ok", True, by="cfo")
    await session.resume("t1", "finance-ok", True, by="cfo")
    with pytest.raises(ResumeAuthorizationError):
        await session.resume("t1", "legal-ok", True, by="cfo")
    parked = session.pending()
    assert parked is not None and [i.request.id for i in parked.inputs()] == ["legal-ok"]


async def test_an_answered_request_cannot_be_answered_again(store_kind: str) -> None:
    session, _ = await _parked(make_store(store_kind))
    await session.resume("t1", "legal-ok", True, by="counsel")
    with pytest.raises(ResumeConflictError, match="finance-ok"):
        await session.resume("t1", "legal-ok", False, by="counsel")
    with pytest.raises(ResumeConflictError):
        await session.resume("t1", "nobody-asked", True, by="counsel")


async def test_an_answer_made_from_an_older_checkpoint_is_refused_by_the_store(store_kind: str) -> None:
    # Two answerers read the park at the same moment; one applies first. The other's commit, made from the
    # checkpoint it read, must not apply over the newer one (it would bring the answered request back).
    from june_worker.engine.resume import check_parked, resume_commit

    store = make_store(store_kind)
    session, _ = await _parked(store)
    stale = store.pending(REF)
    await session.resume("t1", "legal-ok", True, by="counsel")
    commit = resume_commit(check_parked(stale, "t1", "finance-ok"), True, by="cfo")
    with pytest.raises(ResumeConflictError):
        store.commit(REF, commit)
    # read again, the same answer applies
    await session.resume("t1", "finance-ok", True, by="cfo")
    assert (await session.result("t1")).status == "completed"


async def test_a_request_that_expires_is_answered_with_a_timeout_and_the_turn_waits_for_the_other(
    store_kind: str, tmp_path: Path
) -> None:
    import asyncio

    store = make_store(store_kind, tmp_path)
    session, seen = await _parked(store, timeouts={"finance": 0.05})
    parked = session.pending()
    assert parked is not None and parked.request.expires_at is not None and parked.more[0].request.expires_at is None
    while [i.request.id for i in (session.pending() or parked).inputs()] != ["legal-ok"]:
        await asyncio.sleep(0.01)
    assert (await session.result("t1")).status == "suspended"
    with pytest.raises(ResumeConflictError, match="waiting for input 'legal-ok', not 'finance-ok'"):
        await session.resume("t1", "finance-ok", True, by="cfo")  # it expired: the turn went on without it
    await session.resume("t1", "legal-ok", True, by="counsel")
    assert (await session.result("t1")).status == "completed"
    assert _signed(store) == [{"desk": "finance", "signed": None}, {"desk": "legal", "signed": True}]


async def test_a_park_left_by_a_process_that_ended_expires_request_by_request_in_a_new_runtime(tmp_path: Path) -> None:
    import asyncio

    store = make_store("sqlite", tmp_path)
    await _parked_by_a_process_that_ended(store, timeouts={"finance": 0.05, "legal": 0.3})
    await asyncio.sleep(0.1)  # the first request's time passes while no runtime runs
    rt = runtime_with(store, ScriptedModel(SCRIPT), [sign_off_tool(Counter())], parallel_tools=4)
    session = rt.session("ops", "s1")
    with pytest.raises(ResumeConflictError, match="finance-ok"):
        await session.resume("t1", "finance-ok", True, by="cfo")
    parked = session.pending()
    assert parked is not None and [i.request.id for i in parked.inputs()] == ["legal-ok"]
    for _ in range(500):  # the second expires too, by its own time (this runtime's timer)
        if (await session.result("t1")).status == "completed":
            break
        await asyncio.sleep(0.01)
    assert (await session.result("t1")).status == "completed"
    assert _signed(store) == [{"desk": "finance", "signed": None}, {"desk": "legal", "signed": None}]


async def test_a_turn_sent_after_one_request_of_the_park_expired_is_rejected_at_once_while_another_is_open(
    tmp_path: Path,
) -> None:
    import asyncio

    from june_worker.errors import TurnRejectedError

    store = make_store("sqlite", tmp_path)
    await _parked_by_a_process_that_ended(store, timeouts={"finance": 0.05})
    await asyncio.sleep(0.1)  # the finance request's time passes while no runtime runs
    rt = runtime_with(store, ScriptedModel(SCRIPT), [sign_off_tool(Counter())], parallel_tools=4)
    session = rt.session("ops", "s1")

    # When a new turn is sent: the start answers the expired request with a timeout, and the park goes on
    with pytest.raises(TurnRejectedError, match="legal-ok"):
        await session.start("another thing", turn_id="t2")

    # Then it was refused at once, never queued behind a park that is still there
    parked = session.pending()
    assert parked is not None and [i.request.id for i in parked.inputs()] == ["legal-ok"]
    rec = store.get_turn(REF, "t2")
    assert rec is not None and rec.status == "rejected"
    assert store.unfinished_turns(REF) == []


async def test_many_answers_landing_at_once_all_apply_however_often_each_loses_a_race(store_kind: str) -> None:
    import asyncio

    from june_worker import Agent, Runtime
    from june_worker.engine.agent import AnswerRequest

    n = 16

    @tool
    async def desk(ctx: ToolContext, i: int) -> dict[str, Any]:
        """Ask desk i."""
        return {"i": i, "ok": await ctx.request_input(id=f"r{i}", prompt="Sign?", answerers={"policy": "desk"})}

    async def authorize(req: AnswerRequest) -> bool:
        await asyncio.sleep(0)  # every answer reads the park, then they all commit: one wins each round
        return True

    store = make_store(store_kind)
    calls = [{"id": f"c{i}", "name": "desk", "input": {"i": i}} for i in range(n)]
    agent = Agent(
        name="ops",
        model=ScriptedModel([Reply("", calls=calls), "all signed"]),
        tools=[desk],
        parallel_tools=n,
        authorize_answer=authorize,
    )
    session = Runtime([agent], store).session("ops", "s1")
    # Given a turn parked on 16 requests (a parent's 16 children, say)
    await session.start("go", turn_id="t1")
    assert isinstance(await session.result("t1"), Suspended)

    # When all 16 answers land at the same moment: each round, one applies and every other loses the race
    await asyncio.gather(*(session.resume("t1", f"r{i}", True, by="op") for i in range(n)))

    # Then every one of them applied (none got a conflict), and the turn went on once, with all its answers
    assert (await session.result("t1")).status == "completed"
    assert _signed(store) == [{"i": i, "ok": True} for i in range(n)]
    answered = [e for e in store.events(REF) if isinstance(e, InputAnswered)]
    assert len(answered) == n - 1 and sorted(e.open for e in answered) == list(range(1, n))


PARK_CRASHES = [("before-publish", "turn:end")]


@pytest.mark.parametrize(("point", "step"), PARK_CRASHES, ids=[f"{p}@{s}" for p, s in PARK_CRASHES])
async def test_a_crash_at_the_park_replays_to_one_park_on_both_requests(
    store_kind: str, point: str, step: str, tmp_path: Path
) -> None:
    store = make_store(store_kind, tmp_path)
    rt = runtime_with(store, ScriptedModel(SCRIPT), [sign_off_tool(Counter())], parallel_tools=4)
    rt.crash = CrashAt(point, step)
    with pytest.raises(CrashInjected):
        await rt.session("ops", "s1").turn("sign this off", turn_id="t1")
    session, _ = await _parked(store)
    parked = session.pending()
    assert parked is not None and [i.request.id for i in parked.inputs()] == ["finance-ok", "legal-ok"]
    requested = [e for e in store.events(REF) if isinstance(e, InputRequested)]
    assert [e.request.id for e in requested] == ["finance-ok", "legal-ok"]  # once each
    await session.resume("t1", "finance-ok", True, by="cfo")
    await session.resume("t1", "legal-ok", True, by="counsel")
    assert (await session.result("t1")).status == "completed"


async def test_calls_that_ask_the_same_request_share_one_answer(store_kind: str) -> None:
    store = make_store(store_kind)

    @tool
    async def confirm(ctx: ToolContext, what: str) -> dict[str, Any]:
        """Confirm with the user."""
        return {what: await ctx.request_input(id="go-ahead", prompt="Go ahead?")}

    script = [
        Reply("", calls=[{"id": f"c{i}", "name": "confirm", "input": {"what": w}} for i, w in enumerate("ab", 1)]),
        "done",
    ]
    rt = runtime_with(store, ScriptedModel(script), [confirm], parallel_tools=4)
    session = rt.session("ops", "s1")
    await session.start("go", turn_id="t1")
    assert (await session.result("t1")).status == "suspended"
    parked = session.pending()
    assert parked is not None and [i.request.id for i in parked.inputs()] == ["go-ahead"]
    await session.resume("t1", "go-ahead", "yes")
    assert (await session.result("t1")).status == "completed"
    assert _signed(store) == [{"a": "yes"}, {"b": "yes"}]


def test_a_park_on_one_request_and_a_call_run_alone_read_as_they_always_did() -> None:
    # Stored checkpoints, results and events of the single-request, one-call-at-a-time case keep their shape:
    # the fields of several requests and of batches are left out when there are none.
    import json

    from june_worker.engine.events import ActionRequested
    from june_worker.engine.store import OpenInput, SuspendedCheckpoint
    from june_worker.engine.types import InputRequest, ToolCall

    request = InputRequest(id="ok", prompt="OK?")
    one = SuspendedCheckpoint(turn_id="t1", request=request, call_id="c1", opening_text="hi")
    assert {"more", "version"}.isdisjoint(json.loads(one.model_dump_json(by_alias=True)))
    two = one.model_copy(update={"more": [OpenInput(request=InputRequest(id="b", prompt="B?"), call_id="c2")]})
    assert json.loads(two.model_dump_json(by_alias=True))["more"][0]["call_id"] == "c2"
    assert SuspendedCheckpoint.model_validate_json(two.model_dump_json(by_alias=True)) == two
    assert "more" not in Suspended(turn_id="t1", request=request).model_dump()
    alone = ActionRequested(turn_id="t1", step="tool:1:c1", call=ToolCall(id="c1", name="x"))
    assert "batch" not in alone.model_dump() and alone.model_copy(update={"batch": ["c1", "c2"]}).model_dump()["batch"]
