"""The ``faulty`` agent: a turn that stops at a chosen step so that a test can inject a fault there.

A turn's text is ``fault <step> <fault> <key>``. At ``<step>`` (``model``, ``sync``, ``async``,
``park``, ``resume``, ``cancel``, ``reset``) the agent's model or tool writes ``<dir>/<key>.at``
(holding its pid) and waits for ``<dir>/<key>.go``, where ``<dir>`` is ``JUNE_IT_FAULT_DIR``.
Meanwhile the test injects the fault (kills the database connections, SIGKILLs this process,
stops Redis), then writes the ``go`` file. Files, not Redis or Postgres, because the fault may
take either away. Only a turn's first attempt stops: a replay finds the ``at`` file and goes on.

Faults the agent makes itself: ``stmt`` (the sync tool runs a statement that fails and catches
the error) and ``unstorable`` (NUL characters and lone surrogates in what the step produces).

Every sync write goes to ``it_faults (key, call_id)``: a test counts its rows.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from june_worker import Agent, ToolContext, tool
from june_worker.engine.model import Done, ModelDelta, ModelRequest, TextChunk
from june_worker.engine.types import AssistantMessage, ModelReply, ToolCall, ToolMessage, UserMessage

__all__ = ["UNSTORABLE", "faulty_agent"]

UNSTORABLE = "nul\x00 and lone \udcff surrogate"


def _dir() -> Path:
    return Path(os.environ.get("JUNE_IT_FAULT_DIR", "/tmp/june-it-faults"))


def _announce(at: Path, text: str) -> None:
    """Write ``at`` whole at once (a test waits for it to exist, then reads the pid in it)."""
    tmp = at.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, at)


async def _stop_here(key: str, where: str) -> None:
    """The first time only: say where we are, then wait for the test to inject its fault and let us go."""
    at = _dir() / f"{key}.at"
    if at.exists():
        return  # a replay: the fault happened already
    _announce(at, f"{os.getpid()} {where}")
    go = _dir() / f"{key}.go"
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def _words(request: ModelRequest) -> list[str]:
    for m in reversed(request.messages):
        if isinstance(m, UserMessage):
            return m.text.split()
    return []


def _count(key: str, what: str) -> None:
    with (_dir() / f"{key}.{what}").open("a") as f:
        f.write(f"{os.getpid()}\n")


class FaultyModel:
    """Decides from the transcript alone (a replay on another worker gets the same replies)."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        words = _words(request)
        if words[:1] != ["fault"] or len(words) < 4:
            yield Done(reply=ModelReply(text=f"ok: {' '.join(words)}"))
            return
        step, fault, key = words[1:4]
        last = request.messages[-1]
        if isinstance(last, ToolMessage):
            yield Done(reply=ModelReply(text=f"done after {last.name}"))
            return
        if isinstance(last, AssistantMessage):  # not reached: a tool result always follows a call
            yield Done(reply=ModelReply(text="done"))
            return
        if step == "model":
            _count(key, "model")
            yield TextChunk(text="thinking ")
            await _stop_here(key, "model")
            text = f"model said {UNSTORABLE}" if fault == "unstorable" else "model said ok"
            yield Done(reply=ModelReply(text=text))
            return
        tool_name = {"sync": "fault_sync"}.get(step, "fault_async")
        call = ToolCall(id="c1", name=tool_name, input={"step": step, "fault": fault, "key": key})
        yield Done(reply=ModelReply(text="calling", tool_calls=[call]))


@tool
def fault_sync(ctx: ToolContext, step: str, fault: str, key: str) -> dict[str, Any]:
    """Writes a row through the step's transaction, stops for the fault, returns."""
    _count(key, "sync")
    ctx.store.execute("insert into it_faults (key, call_id) values (?, ?)", key, ctx.call.id)
    _stop_sync(key)
    found: str = "-"
    if fault == "stmt":
        try:
            ctx.store.query("select * from it_missing_table")
        except Exception as exc:  # the tool's own choice: carry on
            found = type(exc).__name__
    ctx.store.execute("insert into it_faults (key, call_id) values (?, ?)", key, ctx.call.id + "-after")
    result: dict[str, Any] = {"written": 2, "caught": found}
    if fault == "unstorable":
        result["odd"] = UNSTORABLE
    return result


def _stop_sync(key: str) -> None:
    at = _dir() / f"{key}.at"
    if at.exists():
        return
    _announce(at, f"{os.getpid()} sync")
    go = _dir() / f"{key}.go"
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


@tool
async def fault_async(ctx: ToolContext, step: str, fault: str, key: str) -> dict[str, Any]:
    """Stops for the fault at its step: before it returns, before it parks, or after it was answered."""
    _count(key, "async")
    if step == "park":
        await _stop_here(key, "park")
        prompt = f"approve? {UNSTORABLE}" if fault == "unstorable" else "approve?"
        answer = await ctx.request_input(id="ok", prompt=prompt)
        return {"answer": answer}
    if step == "resume":
        answer = await ctx.request_input(id="ok", prompt="approve?")
        await _stop_here(key, "resume")
        return {"answer": answer, "odd": UNSTORABLE} if fault == "unstorable" else {"answer": answer}
    await _stop_here(key, step)  # async, cancel, reset: the test cancels or resets while we wait here
    return {"odd": UNSTORABLE} if fault == "unstorable" else {"ok": True}


def faulty_agent() -> Agent:
    return Agent(name="faulty", model=FaultyModel(), tools=[fault_sync, fault_async])
