"""AnthropicModel against recorded Messages API streams, served locally to the real SDK client.

No test reaches the network: a small HTTP server on 127.0.0.1 (:mod:`tests._anthropic_api`)
serves files from ``tests/fixtures/anthropic`` the way the API sends them (chunked SSE), and the
real ``anthropic`` client talks to it through ``base_url``: its HTTP stack, SSE decoder and
retries all run. The server records what the SDK sent.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import anthropic
import pytest

from june_worker import Agent, Runtime, tool
from june_worker.engine.crash import CrashAt
from june_worker.engine.events import Failed, TurnEvent
from june_worker.engine.model import Done, ModelDelta, ModelRequest, ReasoningChunk, TextChunk, ToolSpec
from june_worker.engine.signals import CrashInjected
from june_worker.engine.store import SessionRef
from june_worker.engine.types import (
    AssistantMessage,
    Message,
    ReasoningBlock,
    ToolCall,
    ToolMessage,
    TriggerMessage,
    Usage,
    UserMessage,
)
from june_worker.errors import ConfigError, ModelStreamError
from june_worker.models._anthropic_retries import RetryBudget
from june_worker.models.anthropic import INSTALL_HINT, AnthropicModel, ModelProviderError
from june_worker.stores import SQLiteStore

from .._anthropic_api import HANG_UP, KEY, SSE_HEADERS, AnthropicAPI, Recorded, api_error, closed_port, recorded, sse


def ask(*messages: Message, system: str = "", tools: list[ToolSpec] | None = None) -> ModelRequest:
    return ModelRequest(
        system=system, messages=list(messages) or [UserMessage(turn_id="t1", text="hi")], tools=tools or []
    )


async def collect(model: AnthropicModel, request: ModelRequest | None = None) -> list[ModelDelta]:
    return [d async for d in model.stream(request or ask())]


ORDER_SPEC = ToolSpec(
    name="create_order",
    description="Place an order for an item.",
    input_schema={"type": "object", "properties": {"item": {"type": "string"}, "qty": {"type": "integer"}}},
)

# --- streaming and the final reply -------------------------------------------------------------------


async def test_text_stream_forwards_each_text_delta_then_one_done_with_usage(
    api: AnthropicAPI, make_model: Any
) -> None:
    api.serve(sse("text_only.sse"))
    deltas = await collect(make_model())
    assert deltas[:-1] == [TextChunk(text="Hello"), TextChunk(text=" there"), TextChunk(text="!")]
    done = deltas[-1]
    assert isinstance(done, Done)
    assert done.reply.text == "Hello there!" and done.reply.tool_calls == [] and done.reply.reasoning == []
    assert done.finish is not None and (done.finish.reason, done.finish.raw) == ("stop", "end_turn")
    assert done.usage == Usage(input_tokens=12, output_tokens=9, cache_read_tokens=0, cache_write_tokens=1830)


async def test_several_tool_calls_come_back_with_their_ids_and_assembled_inputs(
    api: AnthropicAPI, make_model: Any
) -> None:
    api.serve(sse("tool_use_multi.sse"))
    deltas = await collect(make_model())
    assert [d for d in deltas if isinstance(d, TextChunk)] == [
        TextChunk(text="Placing both"),
        TextChunk(text=" orders."),
    ]
    done = deltas[-1]
    assert isinstance(done, Done) and done.finish is not None
    assert done.reply.text == "Placing both orders."
    assert done.reply.tool_calls == [
        ToolCall(id="toolu_01A9wBz", name="create_order", input={"item": "widget", "qty": 3}),
        ToolCall(id="toolu_01B7xQm", name="create_order", input={"item": "gadget", "qty": 1}),
    ]
    assert (done.finish.reason, done.finish.raw) == ("tool_calls", "tool_use")


async def test_thinking_deltas_are_forwarded_and_blocks_kept_with_signature_and_redacted_data(
    api: AnthropicAPI, make_model: Any
) -> None:
    api.serve(sse("thinking_tool_use.sse"))
    deltas = await collect(make_model(thinking=True))
    assert deltas[:3] == [
        ReasoningChunk(text="The user wants 3 widgets."),
        ReasoningChunk(text=" I should call create_order."),
        TextChunk(text="Placing your order."),
    ]
    done = deltas[-1]
    assert isinstance(done, Done) and len(deltas) == 4
    assert done.reply.reasoning == [
        ReasoningBlock(
            text="The user wants 3 widgets. I should call create_order.",
            signature="EqQBCkYIBxgCKkBsig1/e2xq8Vn0fRmP4Ft1Zq==",
        ),
        ReasoningBlock(redacted="EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP"),
    ]
    assert done.reply.tool_calls == [
        ToolCall(id="toolu_01C3kThk", name="create_order", input={"item": "widget", "qty": 3})
    ]


STOP_REASONS = [
    ("end_turn", "stop"),
    ("stop_sequence", "stop"),
    ("tool_use", "tool_calls"),
    ("max_tokens", "max_tokens"),
    ("model_context_window_exceeded", "max_tokens"),
    ("refusal", "refusal"),
    ("pause_turn", "other"),
    ("brand_new_reason", "other"),
]


@pytest.mark.parametrize(("raw", "reason"), STOP_REASONS)
async def test_every_stop_reason_maps_to_a_finish_that_keeps_the_raw_value(
    api: AnthropicAPI, make_model: Any, raw: str, reason: str
) -> None:
    api.serve(sse("text_only.sse", **{'"stop_reason":"end_turn"': f'"stop_reason":"{raw}"'}))
    done = (await collect(make_model(max_pause_continuations=0)))[-1]  # a pause_turn is reported, not continued
    assert isinstance(done, Done) and done.finish is not None
    assert (done.finish.reason, done.finish.raw) == (reason, raw)


# --- the request body ----------------------------------------------------------------------------------


async def test_request_carries_model_system_tools_and_cache_breakpoints(api: AnthropicAPI, make_model: Any) -> None:
    api.serve(sse("text_only.sse"))
    await collect(
        make_model(max_tokens=1000), ask(UserMessage(turn_id="t1", text="hi"), system="Be brief.", tools=[ORDER_SPEC])
    )
    (body,) = api.bodies
    ephemeral = {"type": "ephemeral"}
    assert body["model"] == "claude-sonnet-4-6" and body["max_tokens"] == 1000 and body["stream"] is True
    assert body["system"] == [{"type": "text", "text": "Be brief.", "cache_control": ephemeral}]
    assert body["tools"] == [
        {
            **ORDER_SPEC.model_dump(exclude={"input_schema"}),
            "input_schema": ORDER_SPEC.input_schema,
            "cache_control": ephemeral,
        }
    ]
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": ephemeral}]}
    ]
    assert "thinking" not in body and "temperature" not in body  # thinking is off by default


async def test_cache_false_sends_no_cache_control_anywhere(api: AnthropicAPI, make_model: Any) -> None:
    api.serve(sse("text_only.sse"))
    await collect(make_model(cache=False), ask(system="Be brief.", tools=[ORDER_SPEC]))
    assert "cache_control" not in json.dumps(api.bodies[0])


@pytest.mark.parametrize(
    ("thinking", "expected"),
    [(True, {"type": "adaptive"}), (2048, {"type": "enabled", "budget_tokens": 2048})],
)
async def test_thinking_true_asks_adaptive_and_an_int_sets_the_budget(
    api: AnthropicAPI, make_model: Any, thinking: bool | int, expected: dict[str, Any]
) -> None:
    api.serve(sse("text_only.sse"))
    await collect(make_model(thinking=thinking))
    assert api.bodies[0]["thinking"] == expected


async def test_temperature_is_sent_only_when_set(api: AnthropicAPI, make_model: Any) -> None:
    api.serve(sse("text_only.sse"))
    await collect(make_model(temperature=0.2))
    assert api.bodies[0]["temperature"] == 0.2


@pytest.mark.parametrize("budget", [512, 8192])
def test_a_thinking_budget_outside_1024_to_max_tokens_is_a_config_error(budget: int) -> None:
    with pytest.raises(ConfigError, match="thinking budget"):
        AnthropicModel(max_tokens=8192, thinking=budget, client=SimpleNamespace())


# --- transcript mapping (S45-S48) ------------------------------------------------------------------------


def mapped(*messages: Message, **kwargs: Any) -> list[dict[str, Any]]:
    model = AnthropicModel(client=SimpleNamespace(), cache=False, **kwargs)
    return list(model.build_params(ask(*messages))["messages"])


def test_s45_a_trigger_is_a_user_message_attributed_so_the_model_knows_no_human_sent_it() -> None:
    # The issue wins over S45: the trigger's `by` is named, in a note block before its text.
    trigger = TriggerMessage(turn_id="t1", text="Summarize today's open threads.", by="cron:daily")
    assert mapped(trigger) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "[Automated message from cron:daily. No human sent it.]"},
                {"type": "text", "text": "Summarize today's open threads."},
            ],
        }
    ]


def test_s45_with_trigger_note_none_a_trigger_is_a_plain_user_message_without_by() -> None:
    trigger = TriggerMessage(turn_id="t1", text="Summarize today's open threads.", by="cron:daily")
    assert mapped(trigger, trigger_note=None) == [
        {"role": "user", "content": [{"type": "text", "text": "Summarize today's open threads."}]}
    ]


def test_s46_an_assistant_message_maps_to_text_then_tool_use_blocks() -> None:
    call = ToolCall(id="c1", name="create_order", input={"item": "widget"})
    assistant = AssistantMessage(turn_id="t1", text="Placing it.", tool_calls=[call])
    assert mapped(assistant) == [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Placing it."},
                {"type": "tool_use", "id": "c1", "name": "create_order", "input": {"item": "widget"}},
            ],
        }
    ]


def test_s47_consecutive_tool_results_fold_into_one_user_message_of_json_text() -> None:
    calls = [ToolCall(id="c1", name="a"), ToolCall(id="c2", name="b")]
    out = mapped(
        AssistantMessage(turn_id="t1", text="", tool_calls=calls),
        ToolMessage(turn_id="t1", call_id="c1", name="a", result={"ok": 1}),
        ToolMessage(turn_id="t1", call_id="c2", name="b", result={"ok": 2}),
    )
    assert len(out) == 2
    assert [b["type"] for b in out[0]["content"]] == ["tool_use", "tool_use"]  # no empty text block
    assert out[1] == {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "c1", "content": '{"ok":1}'},
            {"type": "tool_result", "tool_use_id": "c2", "content": '{"ok":2}'},
        ],
    }


def test_whitespace_only_text_is_sent_as_no_block_at_all() -> None:
    out = mapped(
        UserMessage(turn_id="t1", text="order"),
        AssistantMessage(turn_id="t1", text="\n\n", tool_calls=[ToolCall(id="c1", name="a")]),
        ToolMessage(turn_id="t1", call_id="c1", name="a", result=1),
        AssistantMessage(turn_id="t1", text=" \t\n"),
        UserMessage(turn_id="t2", text="  "),
    )
    assert out[1] == {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "a", "input": {}}]}
    assert [m["role"] for m in out] == ["user", "assistant", "user"]


def test_a_tool_error_result_is_sent_with_is_error_true() -> None:
    out = mapped(
        AssistantMessage(turn_id="t1", tool_calls=[ToolCall(id="c1", name="a")]),
        ToolMessage(
            turn_id="t1", call_id="c1", name="a", result={"error": "QuotaError: quota exceeded"}, is_error=True
        ),
    )
    assert out[1]["content"] == [
        {
            "type": "tool_result",
            "tool_use_id": "c1",
            "content": '{"error":"QuotaError: quota exceeded"}',
            "is_error": True,
        }
    ]


def test_s48_a_full_order_flow_keeps_the_role_alternation() -> None:
    out = mapped(
        UserMessage(turn_id="t1", text="order 3 widgets"),
        AssistantMessage(turn_id="t1", tool_calls=[ToolCall(id="c1", name="create_order")]),
        ToolMessage(turn_id="t1", call_id="c1", name="create_order", result={"orderId": 1}),
        AssistantMessage(turn_id="t1", text="Done."),
    )
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant"]


def test_stored_reasoning_is_replayed_first_in_order_and_unsigned_reasoning_is_dropped() -> None:
    assistant = AssistantMessage(
        turn_id="t1",
        text="Placing it.",
        tool_calls=[ToolCall(id="c1", name="create_order")],
        reasoning=[
            ReasoningBlock(text="step one", signature="sig-1"),
            ReasoningBlock(redacted="opaque"),
            ReasoningBlock(text="from a scripted model"),
        ],
    )
    assert [b["type"] for b in mapped(assistant)[0]["content"]] == ["thinking", "redacted_thinking", "text", "tool_use"]
    assert mapped(assistant)[0]["content"][:2] == [
        {"type": "thinking", "thinking": "step one", "signature": "sig-1"},
        {"type": "redacted_thinking", "data": "opaque"},
    ]


def test_an_empty_assistant_reply_is_left_out_and_the_user_messages_around_it_fold() -> None:
    out = mapped(
        UserMessage(turn_id="t1", text="hello"),
        AssistantMessage(turn_id="t1", text=""),
        UserMessage(turn_id="t2", text="anyone?"),
    )
    assert out == [
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "anyone?"}]}
    ]


def test_the_cache_breakpoint_sits_on_the_last_block_of_the_last_message_only() -> None:
    model = AnthropicModel(client=SimpleNamespace())
    messages = model.build_params(
        ask(
            UserMessage(turn_id="t1", text="order"),
            AssistantMessage(turn_id="t1", tool_calls=[ToolCall(id="c1", name="a"), ToolCall(id="c2", name="b")]),
            ToolMessage(turn_id="t1", call_id="c1", name="a", result=1),
            ToolMessage(turn_id="t1", call_id="c2", name="b", result=2),
        )
    )["messages"]
    marked = [(i, j) for i, m in enumerate(messages) for j, b in enumerate(m["content"]) if "cache_control" in b]
    assert marked == [(2, 1)]


# --- S52 / S53 ---------------------------------------------------------------------------------------------


class _FakeStream:
    def __init__(self, final: Any) -> None:
        self.final = final

    async def __aenter__(self) -> _FakeStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def __aiter__(self) -> _FakeStream:
        return self

    async def __anext__(self) -> Any:
        raise StopAsyncIteration

    async def get_final_message(self) -> Any:
        return self.final


async def test_s52_the_done_delta_carries_the_final_messages_stop_reason() -> None:
    final = SimpleNamespace(content=[], stop_reason="max_tokens")
    client = SimpleNamespace(messages=SimpleNamespace(stream=lambda **_: _FakeStream(final)))
    deltas = await collect(AnthropicModel(client=client))
    assert len(deltas) == 1
    (done,) = deltas
    assert isinstance(done, Done) and done.reply.text == "" and done.reply.tool_calls == []
    assert done.finish is not None and (done.finish.reason, done.finish.raw) == ("max_tokens", "max_tokens")


@pytest.fixture
def no_sdk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    def hide() -> None:
        monkeypatch.setitem(sys.modules, "anthropic", None)  # `import anthropic` now raises ImportError

    yield hide


def test_s53_building_the_model_without_the_sdk_says_to_install_the_extra(no_sdk: Callable[[], None]) -> None:
    no_sdk()
    with pytest.raises(ConfigError, match=re.escape(f"not installed: {INSTALL_HINT}")):
        AnthropicModel()


async def test_s53_iterating_without_the_sdk_says_to_install_the_extra(no_sdk: Callable[[], None]) -> None:
    model = AnthropicModel(api_key=KEY)  # built while the SDK was importable; the client is made lazily
    no_sdk()
    with pytest.raises(ConfigError, match="june-worker\\[anthropic\\]"):
        await collect(model)


# --- retries and errors -------------------------------------------------------------------------------------


async def test_an_overloaded_529_is_retried_and_the_reply_is_yielded_once(api: AnthropicAPI, make_model: Any) -> None:
    api.serve(api_error(529, "overloaded_529.json"), sse("text_only.sse"))
    deltas = await collect(make_model())
    assert [type(d).__name__ for d in deltas] == ["TextChunk", "TextChunk", "TextChunk", "Done"]
    assert len(api.requests) == 2 and api.bodies[0] == api.bodies[1]


async def test_a_529_after_the_last_retry_raises_a_provider_error_nobody_retries_again(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given an API that stays overloaded, and a model allowed one retry
    api.serve(*[api_error(529, "overloaded_529.json") for _ in range(5)])
    # When the model is called, Then it sends two requests and raises an error marked not retryable, saying so
    with pytest.raises(ModelProviderError) as raised:
        await collect(make_model(max_retries=1))
    assert len(api.requests) == 2
    err = raised.value
    assert (err.status_code, err.error_type, err.retryable) == (529, "overloaded_error", False)
    assert re.fullmatch(
        r"Anthropic API error 529 overloaded_error: Overloaded \(request req_test\); "
        r"gave up after 1 of 1 retries in \d+\.\ds",
        str(err),
    )


async def test_the_sdks_own_retries_are_off_so_each_request_is_one_of_the_budget(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given an injected SDK client (its default: two retries of its own) and an API that stays overloaded
    api.serve(*[api_error(529, "overloaded_529.json") for _ in range(10)])
    # When a model with no retries of its own is called, Then exactly one request was sent
    with pytest.raises(ModelProviderError):
        await collect(make_model(max_retries=0))
    assert len(api.requests) == 1


async def test_a_529_is_retried_after_the_servers_retry_after(api: AnthropicAPI, make_model: Any) -> None:
    # Given a 529 that says how soon to come back (retry-after-ms, then retry-after in seconds)
    for headers, expected in (({"retry-after-ms": "250"}, 0.25), ({"retry-after": "3"}, 3.0)):
        overloaded = api_error(529, "overloaded_529.json")
        api.serve(Recorded(529, overloaded.body, {**overloaded.headers, "retry-after-ms": "", **headers}))
        with pytest.raises(ModelProviderError) as raised:
            await collect(make_model(max_retries=0))
        # When the budget asks how long to wait before sending it again, Then it is the server's wait
        cause = raised.value.__cause__
        assert isinstance(cause, anthropic.APIStatusError)
        assert RetryBudget(1, delay_s=0.0, max_wait_s=60.0).next_wait(cause) == expected


async def test_a_retry_after_longer_than_the_budget_allows_ends_the_retries_at_once(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given a 529 asking to come back in two minutes, and a budget that waits at most a minute
    overloaded = api_error(529, "overloaded_529.json")
    api.serve(*[Recorded(529, overloaded.body, {**overloaded.headers, "retry-after-ms": "120000"})] * 3)
    # When the model is called, Then one request was sent, and the error says why no other was
    with pytest.raises(ModelProviderError, match="asked to wait 120s, longer than max_retry_wait_s=60") as raised:
        await collect(make_model(max_retries=3, max_retry_wait_s=60))
    assert len(api.requests) == 1 and not raised.value.retryable


async def test_an_in_stream_overloaded_error_before_any_output_restarts_the_request(
    api: AnthropicAPI, make_model: Any
) -> None:
    api.serve(sse("overloaded_in_stream.sse"), sse("text_only.sse"))
    deltas = await collect(make_model())
    assert [d.text for d in deltas if isinstance(d, TextChunk)] == ["Hello", " there", "!"]
    assert sum(isinstance(d, Done) for d in deltas) == 1
    assert len(api.requests) == 2 and api.bodies[0] == api.bodies[1]


async def test_in_stream_restarts_use_the_same_budget(api: AnthropicAPI, make_model: Any) -> None:
    api.serve(api_error(529, "overloaded_529.json"), *[sse("overloaded_in_stream.sse") for _ in range(3)])
    with pytest.raises(ModelProviderError, match="stream error overloaded_error: Overloaded") as raised:
        await collect(make_model(max_retries=2))
    assert len(api.requests) == 3 and not raised.value.retryable


async def test_an_in_stream_error_after_text_was_forwarded_is_not_retried(api: AnthropicAPI, make_model: Any) -> None:
    api.serve(sse("error_after_text.sse"), sse("text_only.sse"))
    seen: list[ModelDelta] = []
    with pytest.raises(ModelProviderError, match="overloaded_error") as raised:
        async for delta in make_model().stream(ask()):
            seen.append(delta)
    assert seen == [TextChunk(text="Partial")] and len(api.requests) == 1
    assert raised.value.retryable  # its budget untouched: the engine may run the step again (a new attempt)


async def test_a_connection_dropped_mid_stream_before_any_output_restarts(api: AnthropicAPI, make_model: Any) -> None:
    head = recorded("overloaded_in_stream.sse").split(b"event: ping")[0]
    api.serve(Recorded(200, head, dict(SSE_HEADERS), cut=True), sse("text_only.sse"))
    deltas = await collect(make_model())
    assert isinstance(deltas[-1], Done) and deltas[-1].reply.text == "Hello there!" and len(api.requests) == 2


async def test_a_connection_that_never_answers_is_sent_again_within_the_budget(
    api: AnthropicAPI, make_model: Any
) -> None:
    api.serve(HANG_UP, sse("text_only.sse"))
    deltas = await collect(make_model(max_retries=1))
    assert isinstance(deltas[-1], Done) and deltas[-1].reply.text == "Hello there!" and len(api.requests) == 2


async def test_a_connection_that_never_opens_raises_a_provider_error_once_the_budget_is_spent() -> None:
    client = anthropic.AsyncAnthropic(api_key=KEY, base_url=f"http://127.0.0.1:{closed_port()}")
    try:
        with pytest.raises(ModelProviderError, match="Anthropic connection failed.*gave up after 1 of 1") as raised:
            await collect(AnthropicModel(client=client, max_retries=1, retry_delay_s=0.0))
    finally:
        await client.close()
    assert not raised.value.retryable


async def test_a_non_retryable_error_raises_with_the_providers_message(api: AnthropicAPI, make_model: Any) -> None:
    api.serve(api_error(400, "invalid_request_400.json"))
    with pytest.raises(ModelProviderError, match="Expected `thinking` or `redacted_thinking`") as raised:
        await collect(make_model())
    assert len(api.requests) == 1
    assert (raised.value.status_code, raised.value.error_type, raised.value.retryable) == (
        400,
        "invalid_request_error",
        False,
    )


@pytest.mark.parametrize("name", ["malformed_truncated.sse", "malformed_json.sse"])
async def test_a_malformed_stream_raises_model_stream_error_and_is_not_retried(
    api: AnthropicAPI, make_model: Any, name: str
) -> None:
    api.serve(sse(name), sse("text_only.sse"))
    with pytest.raises(ModelStreamError, match="Anthropic stream"):
        await collect(make_model())
    assert len(api.requests) == 1


def test_provider_errors_survive_pickling() -> None:
    err = ModelProviderError(
        "Anthropic API error 529 overloaded_error: Overloaded", 529, "overloaded_error", "req_1", True
    )
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.status_code, back.error_type, back.request_id, back.retryable) == (
        str(err),
        529,
        "overloaded_error",
        "req_1",
        True,
    )


# --- the key ---------------------------------------------------------------------------------------------------


def test_repr_never_shows_the_api_key() -> None:
    assert KEY not in repr(AnthropicModel(api_key=KEY))
    assert "api_key=<set>" in repr(AnthropicModel(api_key=KEY))


async def test_the_api_key_never_reaches_a_log_line_or_an_error_message(
    api: AnthropicAPI, caplog: pytest.LogCaptureFixture
) -> None:
    echo = {"type": "error", "error": {"type": "authentication_error", "message": f"invalid x-api-key {KEY}"}}
    api.serve(api_error(401, echo))
    client = anthropic.AsyncAnthropic(api_key=KEY, base_url=api.url)
    model = AnthropicModel(client=client)  # the key to keep out is read off the injected client
    caplog.set_level(logging.DEBUG)
    try:
        with pytest.raises(ModelProviderError) as raised:
            await collect(model)
    finally:
        await client.close()
    assert KEY not in str(raised.value) and "<redacted>" in str(raised.value)
    assert raised.value.__cause__ is None  # the SDK's own message held the key, so it is not chained
    assert all(KEY not in r.getMessage() for r in caplog.records)


def test_from_env_reads_the_key_and_model_and_requires_the_key() -> None:
    model = AnthropicModel.from_env({"ANTHROPIC_API_KEY": KEY, "ANTHROPIC_MODEL": "claude-haiku-4-5"}, max_tokens=512)
    assert (model.model, model.max_tokens) == ("claude-haiku-4-5", 512) and KEY not in repr(model)
    with pytest.raises(ConfigError, match="ANTHROPIC_API_KEY is not set"):
        AnthropicModel.from_env({})


# --- through the engine -------------------------------------------------------------------------------------------


def order_agent(model: AnthropicModel, runs: list[dict[str, Any]]) -> Agent:
    @tool
    def create_order(item: str, qty: int = 1) -> dict[str, Any]:
        """Place an order for an item."""
        runs.append({"item": item, "qty": qty})
        return {"orderId": len(runs), "item": item, "qty": qty}

    return Agent(name="ops", model=model, instructions="You take orders.", tools=[create_order])


async def test_a_thinking_tool_turn_commits_reasoning_and_echoes_it_with_the_tool_result(
    api: AnthropicAPI, make_model: Any
) -> None:
    api.serve(sse("thinking_tool_use.sse"), sse("final_answer.sse"))
    store = SQLiteStore(":memory:")
    runtime = Runtime([order_agent(make_model(thinking=True), [])], store)
    assert await runtime.session("ops", "s1").turn("Order 3 widgets", turn_id="t1") == "Done — order placed."
    stored = store.load(SessionRef("ops", "s1")).messages
    first = stored[1]
    assert (
        isinstance(first, AssistantMessage)
        and first.reasoning[0].signature == "EqQBCkYIBxgCKkBsig1/e2xq8Vn0fRmP4Ft1Zq=="
    )
    second = api.bodies[1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert [b["type"] for b in second[1]["content"]] == ["thinking", "redacted_thinking", "text", "tool_use"]
    assert second[1]["content"][0]["signature"] == "EqQBCkYIBxgCKkBsig1/e2xq8Vn0fRmP4Ft1Zq=="
    assert second[2]["content"] == [
        {
            "type": "tool_result",
            "tool_use_id": "toolu_01C3kThk",
            "content": '{"orderId":1,"item":"widget","qty":3}',
            "cache_control": {"type": "ephemeral"},
        }
    ]
    store.close()


async def test_a_batch_with_a_failing_tool_is_sent_back_as_one_user_message_with_is_error(
    api: AnthropicAPI, make_model: Any
) -> None:
    class QuotaError(Exception):
        pass

    @tool
    def create_order(item: str, qty: int = 1) -> dict[str, Any]:
        """Place an order for an item."""
        if item == "gadget":
            raise QuotaError("quota exceeded")
        return {"orderId": 1}

    api.serve(sse("tool_use_multi.sse"), sse("final_answer.sse"))
    store = SQLiteStore(":memory:")
    agent = Agent(name="ops", model=make_model(cache=False), tools=[create_order])
    await Runtime([agent], store).session("ops", "s1").turn("Order both", turn_id="t1")
    messages = api.bodies[1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[2]["content"] == [
        {"type": "tool_result", "tool_use_id": "toolu_01A9wBz", "content": '{"orderId":1}'},
        {
            "type": "tool_result",
            "tool_use_id": "toolu_01B7xQm",
            "content": '{"error":"QuotaError: quota exceeded"}',
            "is_error": True,
        },
    ]
    store.close()


async def test_a_replayed_turn_sends_the_same_requests_as_an_uninterrupted_one(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given an uninterrupted run of a thinking tool turn, recorded
    api.serve(sse("thinking_tool_use.sse"), sse("final_answer.sse"))
    clean = SQLiteStore(":memory:")
    await (
        Runtime([order_agent(make_model(thinking=True), [])], clean)
        .session("ops", "s1")
        .turn("Order 3 widgets", turn_id="t1")
    )
    clean_bodies = api.bodies
    api.requests.clear()
    # When the same turn crashes right after the tool step committed (crash at after-tool-commit)
    api.serve(sse("thinking_tool_use.sse"), sse("final_answer.sse"))
    store = SQLiteStore(":memory:")
    runs: list[dict[str, Any]] = []
    crashed = Runtime([order_agent(make_model(thinking=True), runs)], store, crash=CrashAt("after-tool-commit"))
    with pytest.raises(CrashInjected):
        await crashed.session("ops", "s1").turn("Order 3 widgets", turn_id="t1")
    # and a new runtime over the same store replays it
    replay = Runtime([order_agent(make_model(thinking=True), runs)], store)
    assert await replay.session("ops", "s1").turn("Order 3 widgets", turn_id="t1") == "Done — order placed."
    # Then the model saw exactly the same two requests, and the tool ran once
    assert api.bodies == clean_bodies and len(runs) == 1
    clean.close()
    store.close()


async def test_a_provider_error_fails_the_turn_in_the_model_phase(api: AnthropicAPI, make_model: Any) -> None:
    api.serve(api_error(400, "invalid_request_400.json"))
    store = SQLiteStore(":memory:")
    session = Runtime([order_agent(make_model(), [])], store).session("ops", "s1")
    events: list[TurnEvent] = []
    session.observe(events.append)
    result = await session.result(await session.start("Order 3 widgets", turn_id="t1"))
    assert isinstance(result, Failed) and (result.phase, result.step) == ("model", "model:1")
    assert "Expected `thinking` or `redacted_thinking`" in result.error.message
    assert events[-1].type == "turn.failed"
    store.close()


async def test_an_empty_refusal_fails_the_turn_instead_of_answering_silence(api: AnthropicAPI, make_model: Any) -> None:
    api.serve(sse("refusal_empty.sse"))
    store = SQLiteStore(":memory:")
    session = Runtime([order_agent(make_model(), [])], store).session("ops", "s1")
    result = await session.result(await session.start("Order 3 widgets", turn_id="t1"))
    assert isinstance(result, Failed) and "stopped abnormally — refusal" in result.error.message
    store.close()
