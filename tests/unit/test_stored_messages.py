"""A transcript row's body (stores/_sql.message_body) holds less than the message, and reading puts back the rest."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from june_worker.engine.types import (
    AssistantMessage,
    Message,
    ReasoningBlock,
    SummaryMessage,
    ToolCall,
    ToolMessage,
    TriggerMessage,
    Usage,
    UserMessage,
)
from june_worker.stores._sql import message_body, message_from_row

text = st.text(max_size=20)
scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | text
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8
)
counts = st.integers(0, 10**6)

messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(UserMessage, turn_id=text, text=text),
    st.builds(TriggerMessage, turn_id=text, text=text, by=text),
    st.builds(
        AssistantMessage,
        turn_id=text,
        text=text,
        tool_calls=st.lists(
            st.builds(
                ToolCall,
                id=text,
                name=text,
                input=st.dictionaries(text, json_values, max_size=3),
                provider_state=json_values,
            ),
            max_size=2,
        ),
        reasoning=st.lists(
            st.builds(ReasoningBlock, text=text, signature=st.none() | text, redacted=st.none() | text), max_size=2
        ),
        usage=st.none() | st.builds(Usage, input_tokens=counts, output_tokens=counts, cache_read_tokens=counts),
        window_tokens=st.none() | counts,
    ),
    st.builds(ToolMessage, turn_id=text, call_id=text, name=text, result=json_values, is_error=st.booleans()),
    st.builds(SummaryMessage, turn_id=text, text=text, kept_from=counts),
)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_a_message_read_back_from_its_row_is_the_message_written(message: Message) -> None:
    body = message_body(message)
    assert not {"role", "turn_id"} & json.loads(body).keys()  # the row's columns hold them
    assert message_from_row(message.role, message.turn_id, body) == message


def test_the_body_leaves_out_the_columns_and_the_defaults() -> None:
    reply = AssistantMessage(turn_id="01JDZK7Q8W3M5X9YB2C4D6E8FG", text="done")
    assert message_body(reply) == '{"text":"done"}'
    assert reply.model_dump_json().startswith('{"role":"assistant","turn_id":"01JDZK7Q8W3M5X9YB2C4D6E8FG"')
    assert message_body(AssistantMessage(turn_id="t")) == "{}"
    assert message_from_row("assistant", "t", "{}") == AssistantMessage(turn_id="t")
