"""The context policy: a session's requests stay inside the model's window, and its history goes on growing.

Every test runs the engine in process (memory and SQLite stores) with :class:`~tests.unit.kit.WindowModel`:
a model with a 2,000-token window that reports a request's tokens (characters / 3) and refuses one past
its limit as the Anthropic API does.
"""

from __future__ import annotations

from typing import Any

import pytest

from june_worker import Agent, Runtime
from june_worker.engine.context import ContextPolicy, plan_compaction, request_view
from june_worker.engine.crash import CrashAt
from june_worker.engine.events import ContextCompacted, TurnEvent
from june_worker.engine.signals import CrashInjected
from june_worker.engine.store import SessionRef, SessionStore
from june_worker.engine.types import AssistantMessage, Message, SummaryMessage, ToolCall, ToolMessage, UserMessage
from june_worker.errors import AgentDefinitionError

from .kit import WindowModel, make_store

REF = SessionRef("ops", "s1")


def _runtime(store: SessionStore, model: WindowModel, **agent: Any) -> Runtime:
    return Runtime([Agent(name="ops", model=model, **agent)], store)


def _compactions(store: SessionStore) -> list[ContextCompacted]:
    return [e for e in store.events(REF) if isinstance(e, ContextCompacted)]


def _summaries(store: SessionStore) -> list[SummaryMessage]:
    return [m for m in store.load(REF).messages if isinstance(m, SummaryMessage)]


async def _turn(runtime: Runtime, text: str) -> Any:
    session = runtime.session("ops", "s1")
    return await session.result(await session.start(text))


# --- when a turn compacts ----------------------------------------------------------------------------------


async def test_reported_usage_past_the_threshold_makes_the_next_turn_compact_before_its_request(
    store_kind: str,
) -> None:
    # Given a model whose requests carry 1,500 tokens the transcript does not show (tool schemas, say)
    store = make_store(store_kind)
    model = WindowModel(2000, extra_tokens=1500)
    runtime = _runtime(store, model)
    assert (await _turn(runtime, "hello")).status == "completed"
    assert _compactions(store) == []  # ~1,520 tokens reported: under 80 % of the window
    # When the next turn would pass 1,600 tokens by that report (its text alone is ~100 tokens)
    result = await _turn(runtime, "x" * 300)
    # Then it first summarised the older part, and its request started with the summary
    assert result.status == "completed"
    (compacted,) = _compactions(store)
    assert (compacted.reason, compacted.step, compacted.at, compacted.kept_from) == ("threshold", "compact:3", 3, 1)
    assert compacted.tokens_before > 1600 and compacted.summarized == 1
    messages = store.load(REF).messages
    assert [m.role for m in messages] == ["user", "assistant", "user", "summary", "assistant"]
    assert messages[0] == UserMessage(turn_id=messages[0].turn_id, text="hello")  # the replaced message stays
    compact, answer = model.requests[-2:]
    assert compact.step == "compact:3" and "User: hello" in compact.messages[0].text  # type: ignore[union-attr]
    assert answer.step == "model:4" and answer.messages == [messages[3], messages[1], messages[2]]
    assert store.load(REF).compacted_at == 3


async def test_a_model_that_reports_no_usage_is_measured_by_the_characters_it_is_sent() -> None:
    store = make_store("sqlite")
    model = WindowModel(2000, report_usage=False)
    runtime = _runtime(store, model)
    for i in range(6):  # ~310 tokens a turn: the sixth passes 1,600
        assert (await _turn(runtime, f"{i} " + "y" * 900)).status == "completed"
    assert len(_compactions(store)) == 1 and model.refused == 0


async def test_a_session_far_past_the_window_keeps_working(store_kind: str) -> None:
    # Given a session whose turns add ~310 tokens each to a model with a 2,000-token window
    store = make_store(store_kind)
    model = WindowModel(2000)
    runtime = _runtime(store, model)
    # When it runs forty turns (six windows' worth)
    results = [await _turn(runtime, f"turn {i}: " + "z" * 900) for i in range(40)]
    # Then every turn completed, no request was refused, and each one after a compaction began with a summary
    assert [r.status for r in results] == ["completed"] * 40 and model.refused == 0
    transcript = store.load(REF).messages
    assert sum(len(m.model_dump_json()) for m in transcript) // 3 > 6 * 2000
    assert len(_summaries(store)) >= 6 and len(_compactions(store)) == len(_summaries(store))
    asked = [r for r in model.requests if r.step.startswith("model:")]
    assert all(model.tokens(r) <= 2000 for r in asked)
    assert all(isinstance(r.messages[0], SummaryMessage) for r in asked[asked.index(asked[-1]) - 20 :])


async def test_a_request_refused_as_too_long_compacts_and_is_asked_again() -> None:
    # Given a model that refuses past 1,000 tokens while the policy believes it has 2,000
    store = make_store("sqlite")
    model = WindowModel(2000, refuse_over=1000)
    runtime = _runtime(store, model)
    results = [await _turn(runtime, f"{i} " + "w" * 900) for i in range(4)]
    # Then the turn that was refused compacted (reason "refused") and completed on its second request
    assert [r.status for r in results] == ["completed"] * 4
    (compacted,) = _compactions(store)
    assert compacted.reason == "refused" and model.refused == 1
    first = next(i for i, r in enumerate(model.requests) if model.tokens(r) > 1000)
    refused, compact, again = model.requests[first : first + 3]
    assert (refused.step, compact.step, again.step) == (
        f"model:{compacted.at}",
        compacted.step,
        f"model:{compacted.at + 1}",
    )
    assert isinstance(again.messages[0], SummaryMessage)


async def test_a_request_still_too_long_after_compacting_fails_the_turn_once_and_the_session_goes_on(
    store_kind: str,
) -> None:
    store = make_store(store_kind)
    model = WindowModel(2000)
    runtime = _runtime(store, model)
    assert (await _turn(runtime, "hello")).status == "completed"
    # When a turn opens with a message that alone is past the window
    calls = len(model.requests)
    failed = await _turn(runtime, "g" * 7000)
    # Then it fails once, in the model phase, saying why, after one compaction and one more request
    assert failed.status == "failed" and failed.phase == "model"
    assert "longer than the model's context window" in failed.error.message
    assert "did not make it short enough" in failed.error.message
    assert [r.step.split(":")[0] for r in model.requests[calls:]] == ["compact", "model"]
    # And the next turn summarises that message away and answers
    assert (await _turn(runtime, "small again")).status == "completed"
    last = model.requests[-1]
    assert isinstance(last.messages[0], SummaryMessage) and model.tokens(last) <= 2000


async def test_without_a_context_policy_a_refused_request_fails_the_turn_with_the_reason() -> None:
    store = make_store("memory")
    model = WindowModel(2000, refuse_over=500)
    runtime = _runtime(store, model, context=None)
    failed = await _turn(runtime, "g" * 3000)
    assert failed.status == "failed" and "is not configured" in failed.error.message
    assert len(model.requests) == 1 and _compactions(store) == []
    assert (await _turn(runtime, "hi")).status == "failed"  # the session serves its next turn (still too long)


# --- replay after a crash --------------------------------------------------------------------------------

CRASHES = [
    ("before-compact-commit", "compact:3", 2),  # nothing was stored: the summary is written again
    ("after-compact-commit", "compact:3", 1),
    ("before-publish", "compact:3", 1),
    ("before-model-commit", "model:4", 1),
    ("after-model-commit", "model:4", 1),
]


@pytest.mark.parametrize(("point", "step", "calls"), CRASHES, ids=[f"{p}@{s}" for p, s, _ in CRASHES])
async def test_a_turn_replayed_after_a_crash_at_any_point_of_its_compaction_stores_one_summary(
    store_kind: str, tmp_path: Any, point: str, step: str, calls: int
) -> None:
    # Given a session whose next turn compacts, and a process that dies at `point`
    store = make_store(store_kind, tmp_path)
    model = WindowModel(2000, extra_tokens=1500)
    assert (await _turn(_runtime(store, model), "hello")).status == "completed"
    crashing = Runtime([Agent(name="ops", model=model)], store, crash=CrashAt(point, step))
    session = crashing.session("ops", "s1")
    turn_id = await session.start("x" * 300)
    with pytest.raises(CrashInjected):
        await session.result(turn_id)
    # When another runtime replays the turn
    replayed = await _runtime(store, model).session("ops", "s1").result(turn_id)
    # Then it completes with one summary stored and announced, made by `calls` summary requests in all
    assert replayed.status == "completed"
    assert len(_summaries(store)) == 1 and len(_compactions(store)) == 1 and model.summaries == calls
    answer = [r for r in model.requests if r.step == "model:4"][-1]
    assert isinstance(answer.messages[0], SummaryMessage)
    assert [m.role for m in store.load(REF).messages] == ["user", "assistant", "user", "summary", "assistant"]


async def test_a_compaction_step_streams_no_deltas_and_its_tokens_count_in_the_turns_usage() -> None:
    store = make_store("memory")
    model = WindowModel(2000, extra_tokens=1500)
    runtime = _runtime(store, model)
    await _turn(runtime, "hello")
    seen: list[TurnEvent] = []
    runtime.session("ops", "s1").observe(seen.append)
    result = await _turn(runtime, "x" * 300)
    assert {e.step for e in seen if e.type == "message.delta"} == {"model:4"}  # type: ignore[union-attr]
    compact, answer = model.requests[-2:]
    assert result.usage is not None and result.usage.input_tokens == model.tokens(compact) + model.tokens(answer)


# --- where a transcript is cut -----------------------------------------------------------------------------


def _batchy_transcript() -> list[Message]:
    """Turns of a user message, an assistant with two calls, their results, and an answer."""
    out: list[Message] = []
    for t in range(6):
        turn = f"t{t}"
        calls = [ToolCall(id=f"c{t}a", name="look", input={"q": "a" * 40}), ToolCall(id=f"c{t}b", name="look")]
        out += [
            UserMessage(turn_id=turn, text=f"question {t} " + "q" * 60),
            AssistantMessage(turn_id=turn, text="looking", tool_calls=calls),
            ToolMessage(turn_id=turn, call_id=f"c{t}a", name="look", result={"r": "x" * 80}),
            ToolMessage(turn_id=turn, call_id=f"c{t}b", name="look", result={"r": "y" * 80}),
            AssistantMessage(turn_id=turn, text="answer " + "a" * 50),
        ]
    return out


@pytest.mark.parametrize("keep_tokens", [1, 20, 60, 100, 150, 250, 400])
def test_a_cut_never_separates_a_tool_call_from_its_results(keep_tokens: int) -> None:
    messages = _batchy_transcript()
    plan = plan_compaction(messages, None, keep_tokens=keep_tokens, chars_per_token=3)
    assert plan is not None and 0 < plan.kept_from < len(messages)
    kept = messages[plan.kept_from :]
    assert not isinstance(kept[0], ToolMessage)
    asked = {c.id for m in kept if isinstance(m, AssistantMessage) for c in m.tool_calls}
    answered = {m.call_id for m in kept if isinstance(m, ToolMessage)}
    assert asked == answered  # every call kept has its results kept, and no result lost its call
    # and a summary on top of it cuts later still, never through a batch either
    messages.append(SummaryMessage(turn_id="t9", text="so far", kept_from=plan.kept_from))
    view = request_view(messages, len(messages) - 1)
    assert view[0] == messages[-1] and view[1:] == kept
    later = plan_compaction(messages, len(messages) - 1, keep_tokens=1, chars_per_token=3)
    assert later is None or (
        later.kept_from > plan.kept_from and not isinstance(messages[later.kept_from], ToolMessage)
    )


def test_a_policy_with_shares_out_of_order_is_refused() -> None:
    with pytest.raises(AgentDefinitionError, match="keep < compact_at"):
        ContextPolicy(keep=0.9, compact_at=0.8)
    assert ContextPolicy().window(WindowModel(1234)) == 1234 and ContextPolicy(window_tokens=99).window(None) == 99


def test_an_agent_directory_sets_its_context_policy_in_agent_toml(tmp_path: Any) -> None:
    (tmp_path / "agent.toml").write_text("[context]\nwindow_tokens = 50000\ncompact_at = 0.7\nkeep = 0.2\n")
    agent = Agent.from_dir(tmp_path, model=WindowModel(), tools=[])
    assert agent.context == ContextPolicy(window_tokens=50000, compact_at=0.7, keep=0.2)
    (tmp_path / "agent.toml").write_text("[context]\nenabled = false\n")
    assert Agent.from_dir(tmp_path, model=WindowModel(), tools=[]).context is None
    (tmp_path / "agent.toml").write_text("[context]\nwindow = 5\n")
    with pytest.raises(AgentDefinitionError, match=r"unknown settings \['window'\]"):
        Agent.from_dir(tmp_path, model=WindowModel(), tools=[])


async def test_a_compaction_request_the_model_refuses_as_too_long_fails_the_turn_saying_so() -> None:
    store = make_store("memory")
    model = WindowModel(2000, refuse_over=400)  # the summary's instructions and one old turn are past that
    runtime = _runtime(store, model)
    assert (await _turn(runtime, "a" * 900)).status == "completed"
    failed = await _turn(runtime, "b" * 900)
    assert failed.status == "failed" and failed.step is not None and failed.step.startswith("compact:")
    assert "the compaction step's own request was too long" in failed.error.message
    assert _summaries(store) == [] and model.summaries == 1
