"""Rows stored by version 1 still load, and a turn parked by version 1 resumes to completion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from june_worker import Agent, Runtime, ToolContext, tool
from june_worker.engine.events import Completed, TurnEventAdapter, TurnResultAdapter
from june_worker.engine.store import Commit, SessionRef, StepRecord, SuspendedCheckpoint, TurnRecord
from june_worker.engine.types import MessageAdapter
from june_worker.models import Reply, ScriptedModel

from .kit import make_store

GOLDEN = Path(__file__).parent.parent / "golden"


def _load(name: str) -> dict[str, Any]:
    return json.loads((GOLDEN / name).read_text())


def _keeps(dumped: Any, raw: Any) -> bool:
    """Everything stored is still there after a load; fields added since (with defaults) may appear."""
    if isinstance(raw, dict):
        return isinstance(dumped, dict) and all(k in dumped and _keeps(dumped[k], v) for k, v in raw.items())
    if isinstance(raw, list):
        return isinstance(dumped, list) and len(dumped) == len(raw) and all(map(_keeps, dumped, raw))
    return bool(dumped == raw)


@pytest.mark.parametrize("name", ["v1_parked_session.json", "v1_completed_turn.json", "v2_compacted_session.json"])
def test_stored_rows_of_older_versions_still_load_and_keep_every_field(name: str) -> None:
    data = _load(name)
    for raw in data.get("messages", []):
        assert _keeps(MessageAdapter.validate_python(raw).model_dump(mode="json"), raw)
    for raw in data.get("steps", []):
        assert _keeps(StepRecord.model_validate(raw).model_dump(mode="json"), raw)
    for raw in data["events"]:
        assert _keeps(TurnEventAdapter.validate_python(raw).model_dump(mode="json", by_alias=True), raw)
    turn = TurnRecord.model_validate(data["turn"])
    assert _keeps(turn.model_dump(mode="json", by_alias=True), data["turn"])
    if data.get("suspended"):
        checkpoint = SuspendedCheckpoint.model_validate(data["suspended"])
        assert _keeps(checkpoint.model_dump(mode="json", by_alias=True), data["suspended"])


def test_the_golden_check_notices_a_lost_field() -> None:
    assert not _keeps({"a": 1}, {"a": 1, "b": 2})
    assert not _keeps({"a": [1]}, {"a": [1, 2]})


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_turn_parked_by_version_1_resumes_to_completion(kind: str) -> None:
    data = _load("v1_parked_session.json")
    store = make_store(kind)
    ref = SessionRef("ops", "s1")
    turn = TurnRecord.model_validate(data["turn"])
    store.enqueue_turn(ref, turn.turn_id, turn.payload)
    messages = [MessageAdapter.validate_python(m) for m in data["messages"]]
    store.commit(
        ref,
        Commit(
            messages=list(enumerate(messages)),
            steps=[StepRecord.model_validate(s) for s in data["steps"]],
            status="suspended",
            suspended=SuspendedCheckpoint.model_validate(data["suspended"]),
            turn_id=turn.turn_id,
            turn_status="suspended",
            turn_result=turn.result,
        ),
    )

    @tool
    async def issue_refund(ctx: ToolContext, order_id: str, amount: float) -> dict[str, Any]:
        """Refund an order once a human approves it."""
        ok = await ctx.request_input(id="approve-refund", prompt="?", schema={"type": "boolean"})
        return {"refunded": ok is True}

    model = ScriptedModel([Reply("unused"), Reply("unused"), Reply("Refund sent.")])
    rt = Runtime([Agent(name="ops", model=model, tools=[issue_refund])], store)
    s = rt.session("ops", "s1")
    await s.resume("t1", "approve-refund", True, by="U1")
    result = await s.result("t1")
    assert isinstance(result, Completed) and result.text == "Refund sent."
    assert model.calls == 1


def test_results_of_version_1_load() -> None:
    data = _load("v1_completed_turn.json")
    assert TurnResultAdapter.validate_python(data["turn"]["result"]).status == "completed"


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_session_compacted_by_version_2_goes_on_from_its_summary(kind: str) -> None:
    from .kit import WindowModel

    data = _load("v2_compacted_session.json")
    store = make_store(kind)
    ref = SessionRef("ops", "s1")
    messages = [MessageAdapter.validate_python(m) for m in data["messages"]]
    store.commit(ref, Commit(messages=list(enumerate(messages)), status="done"))
    model = WindowModel(20_000)  # room to spare: the next request is the summary and the messages it kept
    runtime = Runtime([Agent(name="ops", model=model)], store)
    assert (await runtime.session("ops", "s1").result(await runtime.session("ops", "s1").start("again"))).status == (
        "completed"
    )
    assert model.requests[-1].messages[0] == messages[3] and messages[3].role == "summary"
