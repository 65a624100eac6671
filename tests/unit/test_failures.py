"""Failures and error reports (scenarios D): turn.failed carries message, cause chain, phase, step, stack."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

from june_worker.engine.events import Failed
from june_worker.engine.model import ModelDelta, ModelRequest
from june_worker.errors import TurnFailedError
from june_worker.models import ScriptedModel
from june_worker.stores import MemoryStore, SQLiteStore

from .kit import FnModel, Recorder, runtime_with


def exploding(message: str, cause: str | None = None) -> FnModel:
    async def gen(_: ModelRequest) -> AsyncIterator[ModelDelta]:
        if cause is None:
            raise RuntimeError(message)
        raise RuntimeError(message) from ConnectionResetError(cause)
        yield  # pragma: no cover - makes this an async generator

    return FnModel(gen)


async def test_s30_turn_failed_carries_stack_cause_chain_and_the_model_step() -> None:
    rt = runtime_with(MemoryStore(), exploding("api down", "ECONNRESET"))
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    with pytest.raises(TurnFailedError, match="api down"):
        await s.turn("hi", turn_id="t1")
    last = rec.events[-1]
    assert last.type == "turn.failed"
    assert last.error.message == "api down"
    assert last.error.cause_chain == ["ECONNRESET"]
    assert (last.phase, last.step) == ("model", "model:1")
    assert "api down" in last.error.stack


async def test_s33_result_reports_a_failed_turn_with_the_full_error() -> None:
    rt = runtime_with(MemoryStore(), exploding("mid-turn crash", "disk full"))
    s = rt.session("ops", "s1")
    turn_id = await s.start("hi")
    result = await s.result(turn_id)
    assert isinstance(result, Failed)
    assert result.error.message == "mid-turn crash" and result.error.cause_chain == ["disk full"]
    assert "mid-turn crash" in (result.error.stack or "")


async def test_a_failed_turn_leaves_the_session_ready_for_the_next_turn() -> None:
    calls = {"n": 0}

    async def gen(_: ModelRequest) -> AsyncIterator[ModelDelta]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("first call fails")
        from june_worker.engine.model import Done
        from june_worker.engine.types import ModelReply

        yield Done(reply=ModelReply(text="recovered"))

    store = SQLiteStore(":memory:")
    rt = runtime_with(store, FnModel(gen))
    s = rt.session("ops", "s1")
    with pytest.raises(TurnFailedError):
        await s.turn("one", turn_id="t1")
    assert store.load(s.ref).status == "done"
    assert await s.turn("two", turn_id="t2") == "recovered"


async def test_s127_a_failure_is_logged_once_with_agent_turn_and_step(caplog: pytest.LogCaptureFixture) -> None:
    rt = runtime_with(MemoryStore(), exploding("model exploded (dependency skew)"))
    with caplog.at_level(logging.ERROR, logger="june_worker.turn"), pytest.raises(TurnFailedError):
        await rt.session("ops", "s1").turn("hi", turn_id="t1")
    lines = [r for r in caplog.records if r.name == "june_worker.turn"]
    assert len(lines) == 1
    assert lines[0].getMessage() == (
        'agent "ops" turn t1 failed at model:1: RuntimeError: model exploded (dependency skew)'
    )
    assert lines[0].exc_info is not None


async def test_s132_a_healthy_turn_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    rt = runtime_with(MemoryStore(), ScriptedModel(["fine"]))
    with caplog.at_level(logging.WARNING):
        await rt.session("ops", "s1").turn("hi")
    assert [r for r in caplog.records if r.name.startswith("june_worker")] == []
