"""A reply cut off by the model's output limit: which of its tool calls may run.

A model that runs out of tokens (``max_tokens``) while writing a tool call still returns that call, with
whatever input parsed so far: ``{"item": "widget", "qty": 1`` of a ``12`` reads as a plausible, wrong
order. After such a stop a call runs only if it is **whole**: the model says its input was written in full
(:attr:`~.model.Done.complete_calls`: complete JSON) and the input is valid against the tool's schema. Any
other call is dropped from the reply before it is committed; the rest of the reply commits as usual.

The one rule a reader must not break: **a call that may have been cut short is never run**, and never
committed (a committed call is owed a result, so a replay would run it).
"""

from __future__ import annotations

from collections.abc import Mapping

from .tools import Tool, ToolInputError
from .types import ModelReply, ToolCall

__all__ = ["CUT_OFF_FINISHES", "without_cut_calls"]

CUT_OFF_FINISHES = frozenset({"max_tokens", "malformed_tool_call"})
"""Finish reasons after which a reply's tool calls may have been cut short."""


def _whole(call: ToolCall, complete: frozenset[str], tools: Mapping[str, Tool]) -> bool:
    if call.id not in complete:
        return False
    tool = tools.get(call.name)
    if tool is None:
        return True  # an unknown tool is answered with an error result; its input is never used
    try:
        tool.validate(call.input)
    except ToolInputError:
        return False
    return True


def without_cut_calls(
    reply: ModelReply, complete_calls: list[str] | None, tools: Mapping[str, Tool]
) -> tuple[ModelReply, list[ToolCall]]:
    """``reply`` without the calls that are not whole (for a reply that stopped on a cut-off), and those calls."""
    complete = frozenset(complete_calls or ())
    kept = [c for c in reply.tool_calls if _whole(c, complete, tools)]
    if len(kept) == len(reply.tool_calls):
        return reply, []
    cut = [c for c in reply.tool_calls if c not in kept]
    return reply.model_copy(update={"tool_calls": kept}), cut
