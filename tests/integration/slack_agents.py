"""The agent the Slack end-to-end tests talk to (``JUNE_AGENTS=tests.integration.slack_agents:ALL``).

``desk`` is reached through Slack (its ``deliver`` hook is ``Channels([SlackChannel.from_env()])``:
the bot token and the fake Web API's URL come from the worker's environment). Its model decides
from the transcript alone and speaks word by word (``JUNE_IT_SLACK_WORD_S`` apart):

* "refund ..." says "Let me check." and calls ``approve_refund``, which asks the speaker (the
  default answerer: Slack attests them) to approve; the continuation says "Refund approved." or
  "Refund denied.";
* "stream <n>" says ``w0 w1 ... w<n-1>`` slowly (a worker can be killed mid-render);
* "fail" calls ``broken``, which raises (the timeline shows an error), then says "That did not work.";
* "boom": the model raises (the turn fails);
* anything else: "did: <text>".
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

from june_worker import Agent, ToolContext, tool
from june_worker.channels import Channels
from june_worker.channels.slack import SlackChannel
from june_worker.engine.model import Done, ModelDelta, ModelRequest, TextChunk
from june_worker.engine.types import ModelReply, ToolCall, ToolMessage, TriggerMessage, UserMessage


@tool
async def approve_refund(ctx: ToolContext) -> dict[str, Any]:
    """Ask the person who asked to approve the refund."""
    ok = await ctx.request_input(id="approve-refund", prompt="Approve the refund?", schema={"type": "boolean"})
    return {"refunded": ok is True}


@tool
def broken(ctx: ToolContext) -> dict[str, Any]:
    """Always fails."""
    raise RuntimeError("the ledger is read-only")


async def _say(words: list[str], calls: list[ToolCall] | None = None) -> AsyncIterator[ModelDelta]:
    pause = float(os.environ.get("JUNE_IT_SLACK_WORD_S", "0"))
    text = " ".join(words)
    if pause:
        for i, word in enumerate(words):
            await asyncio.sleep(pause)
            yield TextChunk(text=word if i == 0 else f" {word}")
    else:
        yield TextChunk(text=text)
    yield Done(reply=ModelReply(text=text, tool_calls=calls or []))


class DeskModel:
    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        last = request.messages[-1]
        if isinstance(last, ToolMessage):
            if last.name == "approve_refund":
                answer = "Refund approved." if (last.result or {}).get("refunded") else "Refund denied."
            else:
                answer = "That did not work." if last.is_error else f"Done: {last.name}"
            async for d in _say(answer.split()):
                yield d
            return
        text = last.text if isinstance(last, (UserMessage, TriggerMessage)) else ""
        words = text.split()
        if words[:1] == ["refund"]:
            stream = _say(["Let", "me", "check."], [ToolCall(id="c1", name="approve_refund", input={})])
        elif words[:1] == ["stream"]:
            stream = _say([f"w{i}" for i in range(int(words[1]))])
        elif words[:1] == ["fail"]:
            stream = _say(["Trying."], [ToolCall(id="c1", name="broken", input={})])
        elif words[:1] == ["boom"]:
            raise RuntimeError("the model is down")
        elif words[:1] == ["Summarize"]:
            stream = _say("Three threads are open.".split())
        else:
            stream = _say(["did:", *words])
        async for d in stream:
            yield d


def resolve(user: str, team: str | None) -> dict[str, Any] | None:
    """The identity resolver the test gateway uses: U_BROKEN's lookup fails (a directory outage)."""
    if user == "U_BROKEN":
        raise RuntimeError("directory unavailable")
    return {"id": f"acct-{user}", "team": team}


def ALL() -> list[Agent]:  # noqa: N802 - the JUNE_AGENTS path names it
    return [
        Agent(
            name="desk",
            model=DeskModel(),
            tools=[approve_refund, broken],
            deliver=Channels([SlackChannel.from_env()]),
        )
    ]
