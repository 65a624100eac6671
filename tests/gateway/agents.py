"""More agents for the gateway tests, served beside ``tests.integration.agents`` by the same workers.

* ``boom``: the model raises "model exploded (dependency skew)" at once (S127: the failure log).
* ``fragile``: the ops script with the ``approve`` tool, but its ``authorize_answer`` hook raises
  (a database outage): a resume is a 500 and the answer is not applied.
* ``form``: asks for a shipping form (an object schema) with no ``answerers``: the default
  answerer is the turn's speaker, whom the gateway attests (the token's principal).
* ``pair``: asks two yes/no questions at once (two async calls run in parallel): the turn parks on both,
  answered by the turn's speaker, each on its own.
* ``bulk``: "stream <n> <size>" streams ``n`` text deltas of ``size`` characters at once, then
  answers "streamed <n>": load for the SSE tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from june_worker import Agent, ToolContext, tool
from june_worker.engine.agent import AnswerRequest
from june_worker.engine.model import Done, ModelDelta, ModelRequest, TextChunk
from june_worker.engine.types import ModelReply, ToolMessage, UserMessage
from june_worker.models import Reply, ScriptedModel
from tests.integration.agents import _ops_script, approve

SHIPPING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"address": {"type": "string", "title": "Address"}, "express": {"type": "boolean"}},
    "required": ["address"],
    "additionalProperties": False,
}


class ExplodingModel:
    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        raise RuntimeError("model exploded (dependency skew)")
        yield  # pragma: no cover - makes this an async generator


class BulkModel:
    """ "stream <n> <size>": ``n`` deltas of ``size`` characters, no pause; then "streamed <n>"."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        last = request.messages[-1]
        words = last.text.split() if isinstance(last, UserMessage) else []
        n = int(words[1]) if len(words) > 1 and words[0] == "stream" else 1
        size = int(words[2]) if len(words) > 2 else 8
        for i in range(n):
            yield TextChunk(text=f"{i:06d}".ljust(size, ".")[:size])
        yield Done(reply=ModelReply(text=f"streamed {n}"))


def _refuse_with_outage(req: AnswerRequest) -> bool:
    raise RuntimeError("authorization database is down")


@tool
async def ask_shipping(ctx: ToolContext) -> dict[str, Any]:
    """Ask the speaker where to ship."""
    answer = await ctx.request_input(id="shipping", prompt="Where should we ship it?", schema=SHIPPING_SCHEMA)
    return {"shipping": answer}


def _form_script(request: ModelRequest) -> Reply:
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        return Reply(f"Shipping to {last.result}")
    return Reply("Asking for the address.", calls=[{"id": "c1", "name": "ask_shipping", "input": {}}])


@tool
async def ask_desk(ctx: ToolContext, desk: str) -> dict[str, Any]:
    """Ask the speaker whether a desk may go ahead."""
    return {desk: await ctx.request_input(id=f"ok-{desk}", prompt=f"May {desk} go ahead?", schema={"type": "boolean"})}


def _pair_script(request: ModelRequest) -> Reply:
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        return Reply(f"Answers: {[m.result for m in request.messages if isinstance(m, ToolMessage)]}")
    calls = [{"id": f"c{i}", "name": "ask_desk", "input": {"desk": d}} for i, d in enumerate(("finance", "legal"), 1)]
    return Reply("Asking both desks.", calls=calls)


def ALL() -> list[Agent]:  # noqa: N802 - the JUNE_AGENTS path names it
    return [
        Agent(name="boom", model=ExplodingModel()),
        Agent(name="fragile", model=ScriptedModel(_ops_script), tools=[approve], authorize_answer=_refuse_with_outage),
        Agent(name="form", model=ScriptedModel(_form_script), tools=[ask_shipping]),
        Agent(name="bulk", model=BulkModel()),
        Agent(name="pair", model=ScriptedModel(_pair_script), tools=[ask_desk], parallel_tools=2),
    ]
