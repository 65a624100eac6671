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
* "policy": says whether its system prompt has ``instructions.slack.md`` and which tools it is offered
  (``slack_desk/``: Slack's turns are denied ``wire_money``); "wire": calls ``wire_money``;
* anything else: "did: <text>".

``bare`` (``slack_agents:BARE``, served by no worker here) has no ``deliver`` hook: a gateway must refuse to
take Slack's events for it.

A turn is held before its first model call while the file ``hold-<turn id>`` exists in
``JUNE_IT_SLACK_GATES`` (a test releases it by deleting the file).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
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


@tool
def wire_money(ctx: ToolContext) -> dict[str, Any]:
    """Denied to Slack's turns (agent.toml); it would say so if it ran."""
    return {"wired": True}


async def _held(turn_id: str) -> None:
    gates = os.environ.get("JUNE_IT_SLACK_GATES")
    if gates:
        hold = Path(gates) / f"hold-{turn_id}"
        for _ in range(3000):  # at most a minute: a test that forgot to release it fails rather than hangs
            if not hold.exists():
                return
            await asyncio.sleep(0.02)


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
        await _held(request.turn_id)
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
        elif words[:1] == ["policy"]:
            slack_md = "yes" if SLACK_INSTRUCTIONS in request.system else "no"
            stream = _say(["slack-instructions:", slack_md, "tools:", ",".join(sorted(t.name for t in request.tools))])
        elif words[:1] == ["wire"]:
            stream = _say(["Wiring."], [ToolCall(id="c1", name="wire_money", input={})])
        elif words[:1] == ["Summarize"]:
            stream = _say("Three threads are open.".split())
        else:
            stream = _say(["did:", *words])
        async for d in stream:
            yield d


SLOW_DIRECTORY = threading.Event()
"""Released by the test that makes the resolver hang for U_SLOW (the gateway runs in the test's process)."""


def resolve(user: str, team: str | None) -> dict[str, Any] | None:
    """The identity resolver the test gateway uses: U_BROKEN's lookup fails (a directory outage); U_SLOW's hangs
    until :data:`SLOW_DIRECTORY` is set (a directory that stopped answering)."""
    if user == "U_BROKEN":
        raise RuntimeError("directory unavailable")
    if user == "U_SLOW":
        SLOW_DIRECTORY.wait(60)
    return {"id": f"acct-{user}", "team": team}


DESK = Path(__file__).parent / "slack_desk"
SLACK_INSTRUCTIONS = (DESK / "instructions.slack.md").read_text().strip()


def ALL() -> list[Agent]:  # noqa: N802 - the JUNE_AGENTS path names it
    return [
        Agent.from_dir(
            DESK,
            model=DeskModel(),
            tools=[approve_refund, broken, wire_money],
            deliver=Channels([SlackChannel.from_env()]),
        )
    ]


def BARE() -> list[Agent]:  # noqa: N802 - the JUNE_AGENTS path names it
    return [Agent(name="bare", model=DeskModel(), instructions="Answer.", tools=[approve_refund])]
