"""The engine's TurnHooks seam and the worker's observer, without services: what a host sees of a turn, and how."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from june_worker import Agent, FatalToolError, ToolContext, tool
from june_worker.engine.hooks import StepKind
from june_worker.engine.loop import TurnRunner
from june_worker.engine.sink import NullSink
from june_worker.engine.store import Commit, SessionRef, TurnPayload
from june_worker.engine.types import Usage
from june_worker.models import Reply, ScriptedModel
from june_worker.observe.logs import JsonFormatter, transition
from june_worker.observe.metrics import Metrics
from june_worker.observe.turns import TurnObserver, gen_ai_model, gen_ai_system
from june_worker.stores import MemoryStore


class Recording:
    """TurnHooks that write down what the runner told them."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    @contextlib.contextmanager
    def step(self, kind: StepKind, step: str, tool: str | None = None) -> Iterator[None]:
        self.seen.append(("enter", kind, step, tool))
        try:
            yield
        except BaseException as exc:
            self.seen.append(("raised", step, type(exc).__name__))
            raise
        self.seen.append(("left", step))

    def committed(self, commit: Commit) -> None:
        self.seen.append(("commit", commit.turn_status, [e.type for e in commit.events]))


@tool
def lookup(ctx: ToolContext, what: str) -> dict[str, Any]:
    """Look it up."""
    return {"found": what}


@tool
def give_up(ctx: ToolContext) -> dict[str, Any]:
    """Fail the turn."""
    raise FatalToolError("no")


async def _run(script: list[Reply], hooks: Any) -> Any:
    store = MemoryStore()
    ref = SessionRef("ops", "s1")
    rec, _ = store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    agent = Agent(name="ops", model=ScriptedModel(script), tools=[lookup, give_up])
    return await TurnRunner(agent, store, NullSink(), ref, rec, hooks=hooks).run()


async def test_the_runner_wraps_each_step_and_reports_each_accepted_commit_to_its_hooks() -> None:
    hooks = Recording()
    script = [Reply("looking", calls=[{"id": "c1", "name": "lookup", "input": {"what": "x"}}]), Reply("done")]
    result = await _run(script, hooks)
    assert result.status == "completed"
    assert hooks.seen == [
        ("commit", "running", ["turn.started"]),
        ("enter", "model", "model:1", None),
        ("commit", None, ["message.completed", "action.requested"]),
        ("left", "model:1"),
        ("enter", "tool", "tool:1:c1", "lookup"),
        ("commit", None, ["action.completed"]),
        ("left", "tool:1:c1"),
        ("enter", "model", "model:3", None),
        ("commit", "completed", ["message.completed", "turn.completed"]),
        ("left", "model:3"),
    ]


async def test_a_step_that_fails_the_turn_leaves_its_hook_with_the_exception_then_the_ending_commits() -> None:
    hooks = Recording()
    result = await _run([Reply("trying", calls=[{"id": "c1", "name": "give_up", "input": {}}])], hooks)
    assert result.status == "failed"
    assert hooks.seen[-2:] == [("raised", "tool:1:c1", "_StepFailure"), ("commit", "failed", ["turn.failed"])]


def test_metric_labels_are_bounded_and_the_sweepers_summary_is_counted_by_action() -> None:
    m = Metrics(enabled=True, agents=["ops"])
    assert (m.agent("ops"), m.agent("t_01ANYTHING"), m.agent("s-123")) == ("ops", "_other", "_other")
    m.turn_ended("a-session-id", "completed")
    assert m.turns.labels("_other", "completed")._value.get() == 1
    summary = {"redispatched": 2, "expired_parks": 0, "resets": 1, "relayed": 5, "rebuilt": 4, "pruned": {"events": 7}}
    m.sweep(summary)
    actions = ("redispatched", "resets", "relayed", "rebuilt", "pruned_events")
    counted = {a: m.sweeps.labels(a)._value.get() for a in actions}
    assert counted == {"redispatched": 2, "resets": 1, "relayed": 5, "rebuilt": 4, "pruned_events": 7}
    m.message_rejected("not-a-task-name\n")
    assert m.rejected_messages.labels("_other")._value.get() == 1


def test_a_disabled_metrics_object_records_nothing_and_the_observer_still_runs() -> None:
    agent = Agent(name="ops", model=ScriptedModel(["hi"]))
    observer = TurnObserver({"ops": agent})
    assert observer.metrics.enabled is False  # no PROMETHEUS_MULTIPROC_DIR in this process
    assert (gen_ai_system(agent.model), gen_ai_model(agent.model)) == ("scripted", "scripted")


def test_a_transition_is_one_json_object_with_its_fields_and_an_error_only_by_type(caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="june_worker.turns")
    transition("turn.failed", turn_id="t1", agent="ops", session="s1", step="tool:1:c1", attempt=2,
               phase="tool", error_type="FatalToolError")  # fmt: skip
    (record,) = caplog.records
    line = JsonFormatter().format(record)
    assert "\n" not in line
    assert json.loads(line) | {"ts": None} == {
        "ts": None, "level": "INFO", "logger": "june_worker.turns", "message": "turn.failed", "event": "turn.failed",
        "turn_id": "t1", "agent": "ops", "session": "s1", "step": "tool:1:c1", "attempt": 2, "phase": "tool",
        "error_type": "FatalToolError",
    }  # fmt: skip


async def test_model_usage_reaches_the_counters_by_type() -> None:
    agent = Agent(name="ops", model=ScriptedModel([Reply("hi", usage=Usage(input_tokens=4, output_tokens=2))]))
    observer = TurnObserver({"ops": agent})
    observer.metrics = Metrics(enabled=True, agents=["ops"])
    store = MemoryStore()
    ref = SessionRef("ops", "s1")
    rec, _ = store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    with observer.run(agent, ref, rec) as watch:
        result = await TurnRunner(agent, store, NullSink(), ref, rec, hooks=watch).run()
        watch.finished(result)
    m = observer.metrics
    tokens = {t: m.tokens.labels("ops", "scripted", t)._value.get() for t in ("input", "output")}
    assert tokens == {"input": 4, "output": 2}
    assert m.turns.labels("ops", "completed")._value.get() == 1
    assert m.in_progress.labels("ops")._value.get() == 0


async def test_calls_run_in_parallel_each_count_their_own_outcome() -> None:
    # Three async calls run together (parallel_tools): one errs at once (the model reads it), one returns, one
    # parks last (it commits nothing). Each step's outcome is its own call's, not the last commit's.
    import asyncio

    @tool
    async def slow(ctx: ToolContext, ms: int, then: str = "answer") -> dict[str, Any]:
        """Wait, then answer, fail or ask a person."""
        await asyncio.sleep(ms / 1000)
        if then == "fail":
            raise ValueError("the service said no")
        if then == "ask":
            return {"ok": await ctx.request_input(id="ok", prompt="OK?")}
        return {"ms": ms}

    calls = [
        {"id": "c1", "name": "slow", "input": {"ms": 30, "then": "ask"}},
        {"id": "c2", "name": "slow", "input": {"ms": 1, "then": "fail"}},
        {"id": "c3", "name": "slow", "input": {"ms": 10}},
    ]
    agent = Agent(name="ops", model=ScriptedModel([Reply("", calls=calls), "done"]), tools=[slow], parallel_tools=3)
    observer = TurnObserver({"ops": agent})
    observer.metrics = Metrics(enabled=True, agents=["ops"])
    store = MemoryStore()
    ref = SessionRef("ops", "s1")
    rec, _ = store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    with observer.run(agent, ref, rec) as watch:
        watch.finished(await TurnRunner(agent, store, NullSink(), ref, rec, hooks=watch).run())
    counted = {o: observer.metrics.tool_calls.labels("ops", "slow", o)._value.get() for o in ("ok", "error", "parked")}
    assert counted == {"ok": 1, "error": 1, "parked": 1}


async def test_a_compaction_is_a_step_and_a_span_of_its_own_and_its_tokens_count_under_the_policys_model() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from june_worker.engine.context import ContextPolicy

    from .kit import WindowModel

    # Given an agent whose second turn compacts first (its first request reported ~1,500 tokens of 2,000),
    # the summary written by the policy's own model
    summariser = WindowModel(2000)
    summariser.model = "summariser-1"  # type: ignore[attr-defined]  # its name, as a real model says it
    agent = Agent(name="ops", model=WindowModel(2000, extra_tokens=1500), context=ContextPolicy(model=summariser))
    observer = TurnObserver({"ops": agent})
    observer.metrics = Metrics(enabled=True, agents=["ops"])
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer.tracer = provider.get_tracer("test")
    store = MemoryStore()
    ref = SessionRef("ops", "s1")
    seen: list[Any] = []
    for turn_id, text in (("t1", "hello"), ("t2", "x" * 300)):
        rec, _ = store.enqueue_turn(ref, turn_id, TurnPayload(text=text))
        with observer.run(agent, ref, rec) as watch:
            recording = Recording()
            hooks = _Both(watch, recording)
            assert (await TurnRunner(agent, store, NullSink(), ref, rec, hooks=hooks).run()).status == "completed"
        seen = recording.seen
    # When the second turn ran: Then its compaction was a step of its own, before the model step, not in it
    assert [s[1:3] for s in seen if s[0] == "enter"] == [("compact", "compact:3"), ("model", "model:4")]
    assert seen.index(("left", "compact:3")) < seen.index(("enter", "model", "model:4", None))
    # and its span is a child of the turn's, named for the policy's model, with the tokens it reported
    spans = exporter.get_finished_spans()
    (compact,) = [s for s in spans if (s.attributes or {}).get("june.step.kind") == "compact"]
    turn = next(s for s in spans if s.name == "june.turn" and (s.attributes or {}).get("june.turn_id") == "t2")
    assert compact.name == "chat summariser-1" and compact.parent is not None
    assert compact.parent.span_id == turn.context.span_id
    reported = summariser.tokens(summariser.requests[-1])
    assert (compact.attributes or {}).get("gen_ai.usage.input_tokens") == reported
    # and the counters hold its tokens under that model, and its duration under kind compact
    m = observer.metrics
    assert m.tokens.labels("ops", "summariser-1", "input")._value.get() == reported
    assert m.tokens.labels("ops", "summariser-1", "output")._value.get() == 8
    counts = {
        s.labels["kind"]: s.value for f in m.step_seconds.collect() for s in f.samples if s.name.endswith("_count")
    }
    assert counts == {"model": 2, "compact": 1}


class _Both:
    """Two TurnHooks at once."""

    def __init__(self, *hooks: Any) -> None:
        self.hooks = hooks

    @contextlib.contextmanager
    def step(self, kind: StepKind, step: str, tool: str | None = None) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for h in self.hooks:
                stack.enter_context(h.step(kind, step, tool))
            yield

    def committed(self, commit: Commit) -> None:
        for h in self.hooks:
            h.committed(commit)


def test_a_fault_of_the_metrics_when_a_run_finishes_never_reaches_the_turn(
    monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from june_worker.engine.events import Rejected
    from june_worker.observe import turns

    # Given metrics that fail (a metrics file that cannot be written)
    agent = Agent(name="ops", model=ScriptedModel(["hi"]))
    observer = TurnObserver({"ops": agent})

    def broken(agent: str, status: str) -> None:
        raise OSError("no space left on device")

    monkeypatch.setattr(observer.metrics, "turn_ended", broken)
    monkeypatch.setattr(turns, "_warned", False)
    store = MemoryStore()
    ref = SessionRef("ops", "s1")
    rec, _ = store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    # When a run is told how it finished (rejected: no commit of its own said so)
    with caplog.at_level(logging.WARNING, logger="june_worker.observe"), observer.run(agent, ref, rec) as watch:
        watch.finished(Rejected(turn_id="t1", reason="no"))
    # Then the fault is logged, never raised
    assert "observing a turn failed (turn finished)" in caplog.text
