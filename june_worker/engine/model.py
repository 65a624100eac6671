"""The Model seam: streaming-first.

A model call is an async iterator of :data:`ModelDelta`: any number of ``text`` and
``reasoning`` deltas, then exactly one ``done`` carrying the authoritative reply and why
the model stopped. The engine reads up to ``done`` and closes the stream (``aclose()``);
anything the stream yields or raises after ``done`` is ignored. Deltas are for people
watching; only the ``done`` reply is committed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from .types import Finish, JsonValue, Message, ModelReply, Usage, omitted_if_none

__all__ = ["Done", "Model", "ModelDelta", "ModelRequest", "ReasoningChunk", "TextChunk", "ToolSpec"]


class ToolSpec(BaseModel):
    """What the model is told about a tool."""

    model_config = ConfigDict(frozen=True)

    name: str
    description: str = ""
    input_schema: dict[str, JsonValue] = Field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """One model call: the system prompt, the transcript, and the tools on offer.

    ``messages`` is the whole transcript, or, once the agent's context policy compacted it, a
    :class:`~.types.SummaryMessage` followed by the messages it keeps (a model maps the summary as it
    sees fit; the Anthropic adapter sends it as the first user message). A compaction step's own
    request (``step`` ``compact:<n>``) is one user message holding the part to summarise as text.
    """

    system: str
    messages: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    turn_id: str = ""
    step: str = ""


class TextChunk(BaseModel):
    model_config = ConfigDict(frozen=True)
    type: Literal["text"] = "text"
    text: str


class ReasoningChunk(BaseModel):
    model_config = ConfigDict(frozen=True)
    type: Literal["reasoning"] = "reasoning"
    text: str


class Done(BaseModel):
    """The model's final reply. ``finish`` is omitted from a dump when the model gave none (S39).

    ``usage``: what the reply cost, summed over its requests when it took several (a paused reply that
    went on). ``window_tokens``: then, how full the context window is with the reply in it, the last
    request's input (cached or not) plus its output; a sum over requests would count the transcript once
    per request. None (left out of a dump) for a reply of one request: its ``usage`` says it.

    ``complete_calls``: the ids of the reply's tool calls whose input the model saw written whole (a provider
    that streams a call's JSON knows whether it was closed). It matters only after a cut-off stop
    (``max_tokens``): a call not named here may have been cut short, yet parse, so the engine never runs it.
    None (left out of a dump): the model does not say, and after such a stop no call counts as whole.
    """

    model_config = ConfigDict(frozen=True)
    type: Literal["done"] = "done"
    reply: ModelReply
    finish: Finish | None = omitted_if_none()
    usage: Usage | None = None
    window_tokens: int | None = omitted_if_none()
    complete_calls: list[str] | None = omitted_if_none()


ModelDelta = Annotated[TextChunk | ReasoningChunk | Done, Field(discriminator="type")]


class Model(Protocol):
    def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        """Start a model call. Usually an ``async def`` generator."""
        ...
