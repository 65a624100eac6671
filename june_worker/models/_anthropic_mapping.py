"""Pure mapping between the engine's types and the Anthropic Messages API (no SDK import, no I/O).

Request side: the transcript becomes alternating ``user`` / ``assistant`` messages of content
blocks; replies come back as a :class:`ModelReply`, a :class:`Finish` and a :class:`Usage`.

The rule a reader must not break: **an assistant message is replayed as the API returned it**
— its thinking blocks (signature intact, redacted ones included) first and in their original
order, then its text, then its ``tool_use`` blocks with whatever the API attached to each call
(kept as the call's ``provider_state``) — otherwise a tool-use turn under thinking is rejected on
replay.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.model import ToolSpec
from ..engine.secrets import scrubbed_logger
from ..engine.types import (
    AssistantMessage,
    Finish,
    FinishReason,
    Message,
    ModelReply,
    ReasoningBlock,
    SummaryMessage,
    ToolCall,
    ToolMessage,
    TriggerMessage,
    Usage,
    UserMessage,
)

__all__ = [
    "DEFAULT_TRIGGER_NOTE",
    "EMPTY_MESSAGE_NOTE",
    "STOP_REASONS",
    "SUMMARY_NOTE",
    "complete_call_ids",
    "continuation_param",
    "finish_for",
    "reply_from",
    "system_param",
    "tools_param",
    "transcript_param",
    "usage_from",
]

log = scrubbed_logger("june_worker.models.anthropic")

Block = dict[str, Any]
MessageParam = dict[str, Any]

CACHE_CONTROL: dict[str, str] = {"type": "ephemeral"}

DEFAULT_TRIGGER_NOTE = "[Automated message from {by}. No human sent it.]"
"""Sent as a text block before a ``trigger`` message's text, so the model knows no person is asking."""

SUMMARY_NOTE = (
    "[Summary of the earlier conversation. The messages it replaces were left out of this request to keep it "
    "within the context window.]"
)
"""Sent as a text block before a context summary (:class:`SummaryMessage`), which goes as a user message."""

EMPTY_MESSAGE_NOTE = "[The message had no text.]"
"""Sent for a user (or trigger) message with no text but whitespace, which the API refuses as a block. Sending
nothing would end the request on the assistant's last reply: a prefill, which the API refuses with thinking
on (and a session's first turn would send no message at all)."""

STOP_REASONS: dict[str, FinishReason] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "max_tokens",
    "model_context_window_exceeded": "max_tokens",
    "refusal": "refusal",
    "pause_turn": "other",
}
"""Every documented ``stop_reason``; anything else maps to ``other`` (``raw`` keeps the value).

``pause_turn`` reaches the engine only past the adapter's bound on continuations."""

CUT_OFF_STOPS = frozenset({"max_tokens", "model_context_window_exceeded"})
"""The ``stop_reason`` values that may end a reply inside a tool call's input."""

_UNCACHEABLE = frozenset({"thinking", "redacted_thinking"})
_TOOL_USE_KEYS = frozenset({"type", "id", "name", "input", "cache_control"})
"""The fields of a ``tool_use`` block the mapping owns; any other is the call's provider state."""


# --- request ---------------------------------------------------------------------------------------


def _text(text: str) -> list[Block]:
    # The API refuses empty and whitespace-only text blocks (a reply of "\n\n" before a tool call is
    # ordinary model output), and would refuse every later request of the session: send no block.
    return [{"type": "text", "text": text}] if text.strip() else []


def reasoning_param(block: ReasoningBlock) -> Block | None:
    """A stored reasoning block as the API wants it back, or None when it cannot be verified."""
    if block.redacted is not None:
        return {"type": "redacted_thinking", "data": block.redacted}
    if block.signature is not None:
        return {"type": "thinking", "thinking": block.text, "signature": block.signature}
    return None  # unsigned reasoning (another provider, a scripted model): the API would reject it


def tool_result_content(result: Any) -> str:
    """A tool result as compact JSON text (``{"ok":1}``), the same bytes on every replay."""
    return json.dumps(result, ensure_ascii=False, separators=(",", ":"))


def _assistant_blocks(message: AssistantMessage) -> list[Block]:
    blocks = [p for p in (reasoning_param(r) for r in message.reasoning) if p is not None]
    blocks += _text(message.text)
    blocks += [_tool_use(c) for c in message.tool_calls]
    return blocks


def _tool_use(call: ToolCall) -> Block:
    block: Block = {"type": "tool_use", "id": call.id, "name": call.name, "input": dict(call.input)}
    if isinstance(call.provider_state, dict):
        # what the API attached to the call (its caller, a toolset name...) goes back as it came
        block.update({k: v for k, v in call.provider_state.items() if k not in _TOOL_USE_KEYS})
    return block


def _tool_result(message: ToolMessage) -> Block:
    block: Block = {
        "type": "tool_result",
        "tool_use_id": message.call_id,
        "content": tool_result_content(message.result),
    }
    if message.is_error:
        block["is_error"] = True
    return block


def _role_and_blocks(message: Message, trigger_note: str | None) -> tuple[str, list[Block]]:
    if isinstance(message, UserMessage):
        return "user", _text(message.text) or _text(EMPTY_MESSAGE_NOTE)
    if isinstance(message, TriggerMessage):
        note = _text(trigger_note.format(by=message.by)) if trigger_note else []
        return "user", note + _text(message.text) or _text(EMPTY_MESSAGE_NOTE)
    if isinstance(message, AssistantMessage):
        return "assistant", _assistant_blocks(message)
    if isinstance(message, SummaryMessage):
        # The start of every request after a compaction; the API wants a user message first anyway.
        return "user", _text(SUMMARY_NOTE) + _text(message.text)
    return "user", [_tool_result(message)]


def transcript_param(
    messages: Sequence[Message], *, trigger_note: str | None = DEFAULT_TRIGGER_NOTE, cache: bool = False
) -> list[MessageParam]:
    """The transcript as Messages API ``messages``, roles strictly alternating.

    Consecutive messages of one role are folded into one message: the results of one batch of
    tool calls become one ``user`` message of ``tool_result`` blocks, as the API requires. A
    message with no content (an empty assistant reply) is left out. With ``cache``, the last
    block of the last message carries a cache breakpoint, so the whole prefix is cached.
    """
    out: list[MessageParam] = []
    for message in messages:
        role, blocks = _role_and_blocks(message, trigger_note)
        if not blocks:
            continue
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})
    if cache and out:
        last = out[-1]["content"][-1]
        if last["type"] not in _UNCACHEABLE:
            last["cache_control"] = dict(CACHE_CONTROL)
    return out


def system_param(system: str, *, cache: bool) -> list[Block] | None:
    """The system prompt as one text block (a cache breakpoint when ``cache``), or None when empty."""
    if not system:
        return None
    block: Block = {"type": "text", "text": system}
    if cache:
        block["cache_control"] = dict(CACHE_CONTROL)
    return [block]


def tools_param(tools: Sequence[ToolSpec], *, cache: bool) -> list[Block] | None:
    """Tool definitions; with ``cache`` the last one carries the breakpoint that caches them all."""
    if not tools:
        return None
    out: list[Block] = []
    for spec in tools:
        definition: Block = {"name": spec.name, "input_schema": dict(spec.input_schema)}
        if spec.description:
            definition["description"] = spec.description
        out.append(definition)
    if cache:
        out[-1]["cache_control"] = dict(CACHE_CONTROL)
    return out


# --- reply ------------------------------------------------------------------------------------------


def finish_for(stop_reason: str | None) -> Finish:
    """Why the model stopped, in the engine's words; ``raw`` is always the provider's own value."""
    return Finish(reason=STOP_REASONS.get(stop_reason or "", "other"), raw=stop_reason)


def reply_from(*messages: Any) -> ModelReply:
    """The authoritative reply from the SDK's final assembled message(s).

    Text blocks are joined (the same text the deltas spelled out); thinking and redacted
    thinking blocks are kept verbatim, in order, for replay. Server-side blocks (web search and
    the like) have no place in the transcript and are left out. Several messages are the parts
    of one reply that paused (``pause_turn``) and went on, read as one.
    """
    texts: list[str] = []
    calls: list[ToolCall] = []
    reasoning: list[ReasoningBlock] = []
    for block in (b for m in messages for b in getattr(m, "content", None) or []):
        kind = getattr(block, "type", None)
        if kind == "text":
            texts.append(block.text)
        elif kind == "thinking":
            reasoning.append(ReasoningBlock(text=block.thinking, signature=block.signature))
        elif kind == "redacted_thinking":
            reasoning.append(ReasoningBlock(redacted=block.data))
        elif kind == "tool_use":
            raw_input = block.input
            calls.append(
                ToolCall(
                    id=block.id,
                    name=block.name,
                    input=dict(raw_input) if raw_input else {},
                    provider_state=_call_state(block),
                )
            )
        else:
            log.debug("anthropic reply: ignoring a %s block", kind)
    return ModelReply(text="".join(texts), tool_calls=calls, reasoning=reasoning)


def complete_call_ids(messages: Sequence[Any], streamed_inputs: Sequence[Mapping[int, str]]) -> list[str]:
    """The ids of the ``tool_use`` blocks written whole (:attr:`~june_worker.engine.model.Done.complete_calls`).

    ``streamed_inputs``: per message, the ``input_json_delta`` text each content block index streamed. Every call
    of a message that stopped on its own is whole; of one cut off (``max_tokens``), those whose streamed input is
    complete JSON, an object. The SDK parses a call's input leniently as it streams, so its assembled input
    cannot tell ``{"qty": 1`` (cut) from ``{"qty": 1}``; the streamed text can.
    """
    out: list[str] = []
    for message, streamed in zip(messages, streamed_inputs, strict=True):
        cut_off = getattr(message, "stop_reason", None) in CUT_OFF_STOPS
        for index, block in enumerate(getattr(message, "content", None) or []):
            if getattr(block, "type", None) == "tool_use" and (not cut_off or _json_object(streamed.get(index))):
                out.append(block.id)
    return out


def _json_object(text: str | None) -> bool:
    try:
        return isinstance(json.loads(text or ""), dict)
    except ValueError:
        return False


def continuation_param(messages: Sequence[MessageParam], paused: Sequence[Any]) -> list[MessageParam]:
    """The request's messages followed by what the paused replies wrote, as the assistant's message.

    Every block goes back as the API sent it (server tool calls and results, thinking with its
    signature), minus whitespace-only text, which the API refuses.
    """
    blocks: list[Block] = []
    for message in paused:
        for block in getattr(message, "content", None) or []:
            sent = block.to_dict(mode="json", exclude_none=True)
            if sent.get("type") == "text" and not str(sent.get("text", "")).strip():
                continue
            blocks.append(sent)
    out = list(messages)
    if out and out[-1]["role"] == "assistant":
        out[-1] = {"role": "assistant", "content": [*out[-1]["content"], *blocks]}
    else:
        out.append({"role": "assistant", "content": blocks})
    return out


def _call_state(block: Any) -> dict[str, Any] | None:
    """The fields of a ``tool_use`` block beyond id, name and input (``caller``...), kept for replay."""
    to_dict = getattr(block, "to_dict", None)
    if not callable(to_dict):
        return None
    fields = to_dict(mode="json", exclude_none=True)
    extra = {k: v for k, v in fields.items() if k not in _TOOL_USE_KEYS}
    return extra or None


def usage_from(*messages: Any) -> Usage | None:
    """Token counts, summed over the messages; ``input_tokens`` excludes the cached ones, reported apart."""
    total: Usage | None = None
    for message in messages:
        usage = getattr(message, "usage", None)
        if usage is None:
            continue
        part = Usage(
            input_tokens=getattr(usage, "input_tokens", None) or 0,
            output_tokens=getattr(usage, "output_tokens", None) or 0,
            cache_read_tokens=getattr(usage, "cache_read_input_tokens", None) or 0,
            cache_write_tokens=getattr(usage, "cache_creation_input_tokens", None) or 0,
        )
        total = part if total is None else total + part
    return total
