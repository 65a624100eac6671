"""The Anthropic adapter through the engine, on recorded streams served by a local HTTP server.

Each test serves the real wire format (SSE) from :mod:`tests._anthropic_api` to the real SDK
client and runs a turn on SQLite: what the tools did, what was committed, what the SDK sent.
"""

from __future__ import annotations

from typing import Any

import pytest

from june_worker import Agent, Runtime, tool
from june_worker.engine.events import Completed, Failed, TurnEvent
from june_worker.engine.model import Done, ModelRequest
from june_worker.engine.store import SessionRef
from june_worker.engine.types import AssistantMessage, UserMessage
from june_worker.errors import ConfigError
from june_worker.models._anthropic_mapping import EMPTY_MESSAGE_NOTE
from june_worker.models.anthropic import AnthropicModel
from june_worker.stores import SQLiteStore

from .._anthropic_api import AnthropicAPI, api_error, sse


def order_agent(model: AnthropicModel, runs: list[dict[str, Any]]) -> Agent:
    @tool
    def create_order(item: str, qty: int = 1) -> dict[str, Any]:
        """Place an order for an item."""
        runs.append({"item": item, "qty": qty})
        return {"orderId": len(runs), "item": item, "qty": qty}

    return Agent(name="ops", model=model, instructions="You take orders.", tools=[create_order])


# --- a reply that stopped on max_tokens: whole tool calls run, cut ones are dropped ---------------------------


async def test_a_tool_call_cut_off_by_max_tokens_is_dropped_and_never_runs(api: AnthropicAPI, make_model: Any) -> None:
    # Given a reply that ran out of tokens inside a tool call's JSON ({"item": "widget", "qty": 1 ... of 12)
    api.serve(sse("tool_use_max_tokens.sse"))
    store = SQLiteStore(":memory:")
    runs: list[dict[str, Any]] = []
    session = Runtime([order_agent(make_model(), runs)], store).session("ops", "s1")
    events: list[TurnEvent] = []
    session.observe(events.append)
    # When the turn runs
    result = await session.result(await session.start("Order 12 widgets", turn_id="t1"))
    # Then the call never ran and was not committed: the reply's text is what the turn ends with
    assert runs == []
    assert isinstance(result, Completed) and result.text == "Ordering twelve."
    (reply,) = [m for m in store.load(SessionRef("ops", "s1")).messages if isinstance(m, AssistantMessage)]
    assert reply.tool_calls == []
    assert [e.type for e in events if e.type.startswith("action.")] == []
    store.close()


async def test_a_tool_call_written_whole_before_max_tokens_runs_and_the_turn_goes_on(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given a reply that stopped on max_tokens right after a whole tool call ({"item": "widget", "qty": 12})
    api.serve(sse("tool_use_whole_max_tokens.sse"), sse("final_answer.sse"))
    store = SQLiteStore(":memory:")
    runs: list[dict[str, Any]] = []
    session = Runtime([order_agent(make_model(), runs)], store).session("ops", "s1")
    # When the turn runs
    result = await session.result(await session.start("Order 12 widgets", turn_id="t1"))
    # Then the call ran with its input, and the model went on from its result
    assert runs == [{"item": "widget", "qty": 12}]
    assert isinstance(result, Completed) and result.text == "Done — order placed."
    store.close()


async def test_after_max_tokens_only_calls_of_complete_json_valid_for_their_tool_run(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given a reply that stopped on max_tokens after three calls: one whole, one whole JSON that its tool's schema
    # refuses (no item), and one cut off inside its JSON
    api.serve(sse("tool_use_whole_invalid_cut_max_tokens.sse"), sse("final_answer.sse"))
    store = SQLiteStore(":memory:")
    runs: list[dict[str, Any]] = []
    session = Runtime([order_agent(make_model(), runs)], store).session("ops", "s1")
    events: list[TurnEvent] = []
    session.observe(events.append)
    # When the turn runs
    result = await session.result(await session.start("Order widgets, and gadgets", turn_id="t1"))
    # Then only the whole, valid call was committed and ran; the turn went on without the other two
    assert runs == [{"item": "widget", "qty": 3}]
    assert isinstance(result, Completed) and result.text == "Done — order placed."
    reply = next(m for m in store.load(SessionRef("ops", "s1")).messages if isinstance(m, AssistantMessage))
    assert [c.id for c in reply.tool_calls] == ["toolu_01Whole3"]
    assert [e.call.id for e in events if e.type == "action.requested"] == ["toolu_01Whole3"]
    store.close()


# --- one retry budget per model call --------------------------------------------------------------------------


async def test_a_turn_against_an_overloaded_api_sends_its_model_call_max_retries_plus_one_times_then_fails(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given an API that answers every request with a 529 (and a retry-after), and a model allowed two retries
    api.serve(*[api_error(529, "overloaded_529.json") for _ in range(60)])
    store = SQLiteStore(":memory:")
    session = Runtime([order_agent(make_model(max_retries=2), [])], store).session("ops", "s1")
    # When a turn runs
    result = await session.result(await session.start("Order 3 widgets", turn_id="t1"))
    # Then its model call was sent three times in all (no step retry, no further attempt stacked on them), and
    # the turn failed in its model step saying the retries were spent; the session serves its next turn
    assert len(api.requests) == 3
    assert isinstance(result, Failed) and (result.phase, result.step) == ("model", "model:1")
    assert "529 overloaded_error" in result.error.message and "gave up after 2 of 2 retries" in result.error.message
    rec = store.get_turn(SessionRef("ops", "s1"), "t1")
    assert rec is not None and rec.status == "failed" and rec.attempts == 1
    store.close()


# --- whitespace-only text -------------------------------------------------------------------------------


async def test_a_whitespace_only_text_block_is_never_sent_back_so_the_session_goes_on(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given a reply of "\n\n" then a tool call (ordinary model output), and an API that refuses
    # whitespace-only text blocks, as the real one does
    api.serve(sse("whitespace_then_tool_use.sse"), sse("final_answer.sse"), sse("text_only.sse"))
    store = SQLiteStore(":memory:")
    runs: list[dict[str, Any]] = []
    session = Runtime([order_agent(make_model(), runs)], store).session("ops", "s1")
    # When the turn runs, and a later turn of the session too
    assert await session.turn("Order 3 widgets", turn_id="t1") == "Done — order placed."
    assert await session.turn("Thanks", turn_id="t2") == "Hello there!"
    # Then the tool ran once, the model's own "\n\n" is kept in the transcript, and no request carried it
    assert runs == [{"item": "widget", "qty": 3}]
    stored = store.load(SessionRef("ops", "s1")).messages[1]
    assert isinstance(stored, AssistantMessage) and stored.text == "\n\n"
    sent = [b for body in api.bodies for m in body["messages"] for b in m["content"] if b["type"] == "text"]
    assert sent and all(b["text"].strip() for b in sent)
    assert [b["type"] for b in api.bodies[1]["messages"][1]["content"]] == ["tool_use"]
    store.close()


async def test_a_user_turn_of_only_whitespace_is_sent_as_a_note_so_no_request_ends_on_the_assistant(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given thinking on (the API refuses a request that ends on an assistant message: a prefill), and an API
    # that refuses whitespace-only text blocks
    api.serve(sse("text_only.sse"), sse("text_only.sse"), sse("text_only.sse"))
    store = SQLiteStore(":memory:")
    runtime = Runtime([Agent(name="ops", model=make_model(thinking=True))], store)
    # When a session's first turn is only whitespace, and another session's second one is
    assert await runtime.session("ops", "s1").turn(" \n", turn_id="t1") == "Hello there!"
    session = runtime.session("ops", "s2")
    assert await session.turn("Hi", turn_id="t2") == "Hello there!"
    assert await session.turn("\n\n", turn_id="t3") == "Hello there!"
    # Then each request ended on the user's turn, sent as the note that it had no text
    note = {"type": "text", "text": EMPTY_MESSAGE_NOTE}
    assert [body["messages"][-1]["role"] for body in api.bodies] == ["user", "user", "user"]
    assert [{k: v for k, v in b.items() if k != "cache_control"} for b in api.bodies[0]["messages"][-1]["content"]] == [
        note
    ]
    assert [m["role"] for m in api.bodies[2]["messages"]] == ["user", "assistant", "user"]
    assert api.bodies[2]["messages"][-1]["content"][0]["text"] == EMPTY_MESSAGE_NOTE
    store.close()


# --- B39: an abnormal stop with only whitespace ---------------------------------------------------------


async def test_b39_a_refusal_of_only_whitespace_fails_the_turn_instead_of_answering_it(
    api: AnthropicAPI, make_model: Any
) -> None:
    api.serve(sse("refusal_whitespace.sse"))
    store = SQLiteStore(":memory:")
    session = Runtime([order_agent(make_model(), [])], store).session("ops", "s1")
    result = await session.result(await session.start("Order 3 widgets", turn_id="t1"))
    assert isinstance(result, Failed) and (result.phase, result.step) == ("model", "model:1")
    assert "stopped abnormally — refusal" in result.error.message
    assert not any(isinstance(m, AssistantMessage) for m in store.load(SessionRef("ops", "s1")).messages)
    store.close()


# --- S43: a tool call's provider state ------------------------------------------------------------------


async def test_s43_what_the_api_attached_to_a_tool_call_is_stored_and_sent_back_with_it(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given a tool call the API attached its caller to
    api.serve(sse("tool_use_with_caller.sse"), sse("final_answer.sse"))
    store = SQLiteStore(":memory:")
    session = Runtime([order_agent(make_model(cache=False), [])], store).session("ops", "s1")
    # When the turn runs
    assert await session.turn("Order 3 widgets", turn_id="t1") == "Done — order placed."
    # Then the stored call keeps it, and the next request sent the tool_use block back with it
    caller = {"type": "code_execution_20250825", "tool_id": "srvtoolu_01Exec4"}
    stored = store.load(SessionRef("ops", "s1")).messages[1]
    assert isinstance(stored, AssistantMessage) and stored.tool_calls[0].provider_state == {"caller": caller}
    assert api.bodies[1]["messages"][1]["content"] == [
        {
            "type": "tool_use",
            "id": "toolu_01Caller9",
            "name": "create_order",
            "input": {"item": "widget", "qty": 3},
            "caller": caller,
        }
    ]
    store.close()


# --- pause_turn ------------------------------------------------------------------------------------------


async def test_a_paused_turn_is_continued_by_sending_its_content_back_within_one_model_step(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given a reply paused mid-search (pause_turn), then its continuation
    api.serve(sse("pause_turn_search.sse"), sse("pause_turn_resumed.sse"))
    store = SQLiteStore(":memory:")
    session = Runtime([Agent(name="ops", model=make_model())], store).session("ops", "s1")
    events: list[TurnEvent] = []
    session.observe(events.append)
    # When the turn runs
    answer = await session.turn("When does the store open?", turn_id="t1")
    # Then the paused content went back as the assistant's message, as it came, and the model went on
    assert len(api.requests) == 2
    first, second = api.bodies
    paused = {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look that up. "},
            {
                "type": "server_tool_use",
                "id": "srvtoolu_01Srch8",
                "name": "web_search",
                "input": {"query": "store opening hours"},
            },
            {
                "type": "web_search_tool_result",
                "tool_use_id": "srvtoolu_01Srch8",
                "content": [
                    {
                        "type": "web_search_result",
                        "url": "https://example.com/hours",
                        "title": "Opening hours",
                        "encrypted_content": "EqgfCioIARgBIiQ3YTAw",
                        "page_age": "2 days ago",
                    }
                ],
            },
        ],
    }
    assert second == {**first, "messages": [*first["messages"], paused]}
    # and the turn's answer is the whole reply, committed once as one model step, its deltas all live
    assert answer == "Let me look that up. The store opens at 9."
    stored = store.load(SessionRef("ops", "s1"))
    assert [m.role for m in stored.messages] == ["user", "assistant"]
    assert [s for s in stored.steps if s.startswith("model:")] == ["model:1"]
    model_step = stored.steps["model:1"].data
    assert model_step["finish"] == {"reason": "stop", "raw": "end_turn"}
    assert model_step["usage"] == {
        "input_tokens": 520 + 610,
        "output_tokens": 42 + 9,
        "cache_read_tokens": 480,
        "cache_write_tokens": 0,
    }
    deltas = [e for e in events if e.type == "message.delta"]
    assert "".join(e.text for e in deltas) == answer and {e.step for e in deltas} == {"model:1"}
    assert [e.type for e in events].count("message.completed") == 1
    store.close()


async def test_pause_turn_continuations_are_bounded_and_the_last_pause_is_reported(
    api: AnthropicAPI, make_model: Any
) -> None:
    api.serve(*[sse("pause_turn_search.sse") for _ in range(3)], sse("pause_turn_resumed.sse"))
    model = make_model(max_pause_continuations=1)
    deltas = [d async for d in model.stream(ModelRequest(system="", messages=[UserMessage(turn_id="t1", text="hi")]))]
    done = deltas[-1]
    assert isinstance(done, Done) and done.finish is not None
    assert (done.finish.reason, done.finish.raw) == ("other", "pause_turn")
    assert len(api.requests) == 2  # the first request and one continuation
    assert done.reply.text == "Let me look that up. Let me look that up. "


def test_a_negative_continuation_bound_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_pause_continuations"):
        AnthropicModel(max_pause_continuations=-1, api_key="sk-ant-test-unused")
