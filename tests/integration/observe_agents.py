"""The ``metered`` agent of the observability tests: a scripted model that reports token usage, and tools
that succeed, fail on their own, fail the turn, or park. Its texts and arguments hold the marker
:data:`SECRET` so a test can check that none of them reaches a metric label, a span attribute or a log line.

A turn's text picks the path: ``hello``, ``lookup``, ``oops`` (the tool raises: an error result),
``fatal`` (the tool raises FatalToolError: the turn fails), ``ask`` (the tool parks for an answer).
"""

from __future__ import annotations

from typing import Any

from june_worker import Agent, FatalToolError, ToolContext, tool
from june_worker.engine.model import ModelRequest
from june_worker.engine.types import ToolMessage, Usage, UserMessage
from june_worker.models import Reply, ScriptedModel

__all__ = ["ALL", "SECRET", "USAGE"]

SECRET = "zebra-7f3a-secret"
USAGE = Usage(input_tokens=11, output_tokens=5, cache_read_tokens=3, cache_write_tokens=2)


@tool
def lookup(ctx: ToolContext, what: str) -> dict[str, Any]:
    """Look something up."""
    return {"found": what}


@tool
def oops(ctx: ToolContext, what: str) -> dict[str, Any]:
    """Fail on its own."""
    raise ValueError(f"cannot look up {what}")


@tool
def fatal(ctx: ToolContext, what: str) -> dict[str, Any]:
    """Fail the turn."""
    raise FatalToolError(f"giving up on {what}")


@tool
async def ask(ctx: ToolContext, what: str) -> dict[str, Any]:
    """Ask a person."""
    answer = await ctx.request_input(id="confirm", prompt=f"Confirm {what}?", schema={"type": "boolean"})
    return {"confirmed": answer}


def _script(request: ModelRequest) -> Reply:
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        return Reply(f"done with {SECRET}", usage=USAGE)
    word = last.text.split()[0] if isinstance(last, UserMessage) and last.text.split() else "hello"
    if word in ("lookup", "oops", "fatal", "ask"):
        call = {"id": "c1", "name": word, "input": {"what": SECRET}}
        return Reply(f"calling {word} for {SECRET}", calls=[call], usage=USAGE)
    return Reply(f"hi {SECRET}", usage=USAGE)


def ALL() -> list[Agent]:  # noqa: N802 - the JUNE_AGENTS path names it
    return [
        Agent(
            name="metered",
            instructions=f"instructions {SECRET}",
            model=ScriptedModel(_script),
            tools=[lookup, oops, fatal, ask],
        )
    ]
