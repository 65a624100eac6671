"""The context policy through the Anthropic adapter, against recorded streams served locally to the real SDK.

The stand-in server refuses what the Messages API refuses (:func:`tests._anthropic_api.request_problems`),
so a turn that completes here sent only valid requests; each test also checks the requests it cares about.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest

from june_worker import Agent, Runtime, tool
from june_worker.engine.context import ContextPolicy, estimate_tokens
from june_worker.engine.events import ContextCompacted, Failed
from june_worker.engine.store import SessionRef
from june_worker.engine.types import AssistantMessage, SummaryMessage, Usage
from june_worker.errors import ContextWindowExceededError
from june_worker.models._anthropic_mapping import SUMMARY_NOTE
from june_worker.stores import SQLiteStore

from .._anthropic_api import AnthropicAPI, api_error, request_problems, sse

REF = SessionRef("ops", "s1")


def _agent(model: Any, context: ContextPolicy | None = None) -> Agent:
    @tool
    def create_order(item: str, qty: int = 1) -> dict[str, Any]:
        """Place an order for an item."""
        return {"orderId": 1, "item": item, "qty": qty}

    return Agent(
        name="ops",
        model=model,
        instructions="You take orders.",
        tools=[create_order],
        context=context or ContextPolicy(),
    )


@pytest.mark.parametrize("keep", [0.25, 0.01], ids=["keep-a-quarter", "keep-almost-nothing"])
async def test_requests_after_a_compaction_in_the_middle_of_a_thinking_tool_loop_are_valid(
    api: AnthropicAPI, make_model: Any, keep: float
) -> None:
    # Given a 3,000-token window, and a first reply (thinking, then a tool call) that reports 2,571 tokens
    api.serve(sse("thinking_tool_use.sse"), sse("compaction_summary.sse"), sse("final_answer.sse"))
    store = SQLiteStore(":memory:")
    model = make_model(thinking=True, max_tokens=1000, context_window_tokens=3000)
    runtime = Runtime([_agent(model, ContextPolicy(keep=keep))], store)
    session = runtime.session("ops", "s1")
    # When the turn goes on after the tool result (past 80 % of the window)
    assert await session.turn("Order 3 widgets", turn_id="t1") == "Done — order placed."
    # Then it summarised the opening, and asked again with the tool call and its result kept as they were
    _, compact, after = api.bodies
    assert "tools" not in compact and compact["system"][0]["text"].startswith("You compact the history")
    assert [m["role"] for m in compact["messages"]] == ["user"]
    assert "User: Order 3 widgets" in compact["messages"][0]["content"][0]["text"]
    assert [m["role"] for m in after["messages"]] == ["user", "assistant", "user"]
    assert [b["text"] for b in after["messages"][0]["content"]] == [
        SUMMARY_NOTE,
        "- The user asked to order 3 widgets; the assistant is placing the order with create_order.",
    ]
    assert after["messages"][1]["content"][0]["signature"] == "EqQBCkYIBxgCKkBsig1/e2xq8Vn0fRmP4Ft1Zq=="
    assert [b["type"] for b in after["messages"][1]["content"]] == ["thinking", "redacted_thinking", "text", "tool_use"]
    assert after["messages"][2]["content"][0]["type"] == "tool_result"
    assert request_problems(after) == []
    # And the next turn's request is valid too, summary first
    api.serve(sse("text_only.sse"))
    assert await session.turn("Thanks", turn_id="t2") == "Hello there!"
    last = api.bodies[-1]
    assert request_problems(last) == [] and last["messages"][0]["content"][0]["text"] == SUMMARY_NOTE
    assert [m["role"] for m in last["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    messages = store.load(REF).messages
    assert [m.role for m in messages] == ["user", "assistant", "tool", "summary", "assistant", "user", "assistant"]
    assert messages[3] == SummaryMessage(turn_id="t1", text=messages[3].text, kept_from=1)  # type: ignore[union-attr]
    store.close()


async def test_a_request_the_api_refuses_as_too_long_is_compacted_and_sent_again(
    api: AnthropicAPI, make_model: Any
) -> None:
    api.serve(sse("text_only.sse"))
    store = SQLiteStore(":memory:")
    session = Runtime([_agent(make_model())], store).session("ops", "s1")
    assert await session.turn("hello", turn_id="t1") == "Hello there!"
    # When the API answers the next request with "prompt is too long"
    api.serve(api_error(400, "prompt_too_long_400.json"), sse("compaction_summary.sse"), sse("final_answer.sse"))
    assert await session.turn("and more", turn_id="t2") == "Done — order placed."
    # Then the turn compacted (reason "refused") and its second request began with the summary
    refused, compact, again = api.bodies[1:]
    assert refused["messages"][0]["content"][0]["text"] == "hello"
    assert "User: hello" in compact["messages"][0]["content"][0]["text"]
    assert again["messages"][0]["content"][0]["text"] == SUMMARY_NOTE and request_problems(again) == []
    (compacted,) = [e for e in store.events(REF) if isinstance(e, ContextCompacted)]
    assert (compacted.reason, compacted.kept_from) == ("refused", 1)
    store.close()


async def test_a_request_refused_again_after_compacting_fails_the_turn_once_and_the_next_turn_runs(
    api: AnthropicAPI, make_model: Any
) -> None:
    api.serve(sse("text_only.sse"))
    store = SQLiteStore(":memory:")
    session = Runtime([_agent(make_model())], store).session("ops", "s1")
    await session.turn("hello", turn_id="t1")
    too_long = api_error(400, "prompt_too_long_400.json")
    api.serve(too_long, sse("compaction_summary.sse"), too_long)
    result = await session.result(await session.start("and more", turn_id="t2"))
    assert isinstance(result, Failed) and result.phase == "model" and result.error.type == "ContextWindowExceededError"
    assert "did not make it short enough" in result.error.message and "prompt is too long" in result.error.message
    assert len(api.requests) == 4  # hello; refused, summary, refused: nothing more
    api.serve(sse("text_only.sse"))
    assert await session.turn("still there?", turn_id="t3") == "Hello there!"
    store.close()


async def test_the_adapter_says_too_long_with_its_own_error_class(api: AnthropicAPI, make_model: Any) -> None:
    api.serve(api_error(400, "prompt_too_long_400.json"))
    model = make_model()
    from june_worker.engine.model import ModelRequest
    from june_worker.engine.types import UserMessage

    with pytest.raises(ContextWindowExceededError, match="prompt is too long") as raised:
        async for _ in model.stream(ModelRequest(system="", messages=[UserMessage(turn_id="t", text="hi")])):
            pass
    assert not raised.value.retryable and raised.value.status_code == 400
    copy = pickle.loads(pickle.dumps(raised.value))  # it may cross a process (a Celery result)
    assert isinstance(copy, ContextWindowExceededError) and str(copy) == str(raised.value)
    assert model.context_window_tokens == 200_000


def test_the_stand_in_refuses_a_transcript_the_api_refuses() -> None:
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "f", "input": {}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "{}"}]}
    user = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    assert request_problems({"messages": [user, call, result], "tools": tools}) == []
    assert request_problems({"messages": [result], "tools": tools})  # a result whose call was cut away
    assert request_problems({"messages": [user, call, user], "tools": tools})  # a call without its result
    assert request_problems({"messages": [call, result], "tools": tools})  # not the user's first
    assert request_problems({"messages": [user, call, result]})  # tool blocks but no tools
    thinking = {"type": "adaptive"}
    assert request_problems({"messages": [user, call, result], "tools": tools, "thinking": thinking})


async def test_a_reply_continued_after_pause_turn_estimates_the_window_from_its_last_request_not_the_sum(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given a 2,000-token window (compacting past 1,600) and a reply paused once and continued: its first
    # request took 520 tokens in and wrote 42, its continuation took 1,090 in (the transcript and what the
    # first wrote) and wrote 9
    api.serve(sse("pause_turn_search.sse"), sse("pause_turn_resumed.sse"), sse("text_only.sse"))
    store = SQLiteStore(":memory:")
    model = make_model(max_tokens=256, context_window_tokens=2000)
    runtime = Runtime([Agent(name="ops", model=model, context=ContextPolicy())], store)
    session = runtime.session("ops", "s1")
    await session.turn("What is the weather in Paris?", turn_id="t1")
    # Then the reply's cost is the sum of both requests, and the window it fills the last one's (1,099)
    (reply,) = [m for m in store.load(REF).messages if isinstance(m, AssistantMessage)]
    assert reply.usage == Usage(input_tokens=1130, output_tokens=51, cache_read_tokens=480)
    assert reply.window_tokens == 1090 + 9
    assert estimate_tokens(store.load(REF).messages, None, system="", chars_per_token=3.0) == 1099
    # And the next turn asks at once: by the sum (1,661 tokens) it would have compacted first
    assert await session.turn("Thanks", turn_id="t2") == "Hello there!"
    assert len(api.requests) == 3 and "You compact the history" not in json.dumps(api.bodies[2])
    assert not [e for e in store.events(REF) if isinstance(e, ContextCompacted)]
    store.close()
