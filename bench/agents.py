"""Agents served by the benchmark workers (``JUNE_AGENTS=bench.agents:ALL``, ``PYTHONPATH=<repo root>``).

Every model here decides from the transcript alone (a replay gets the same replies) and does
no I/O of its own, so what a bench measures is the worker, not the model.

* ``bench``: the 3-step turn of ``bench/throughput.py``: the model calls the trivial sync tool
  ``tick``, the tool returns, the model answers "done". No deltas.
* ``stamp``: the event-latency turn, the same three steps, instrumented. Its first model call
  streams one delta whose text is ``time.monotonic_ns()`` taken just before the yield; its last
  reply's text is the JSON of the instants :data:`PROBE` recorded around this turn's earlier
  commits (the probe is the engine's crash hook, installed by ``bench/tasks.py``
  when ``JUNE_BENCH_PROBE=1``). Each step first sleeps ``JUNE_BENCH_PAUSE_MS`` (as a model or a
  tool waiting on the network would), so every event finds the reader blocked in XREAD again.
* ``hold``: the recovery turn. Its async tool ``hold`` blocks on the turn's first attempt (the
  bench kills that worker meanwhile) and returns at once on any later attempt; each attempt
  pushes its pid to ``<JUNE_KEY_PREFIX>:hold:<turn_id>:pids``.
* ``dribble``: a model that streams ``JUNE_BENCH_DELTAS`` deltas 2 ms apart, so that a cancel
  lands mid-stream.
* ``wait``: the in-flight turn (``bench/inflight.py``): opened with ``wait <W>``, its two model calls and
  its async tool each wait W seconds.
* ``chaos``: the chaos turn: the model streams a few deltas, calls the sync tool ``record``, which
  writes ``(turn_id, call_id)`` to ``chaos_writes`` through the step's transaction, then answers;
  each step first waits ``JUNE_BENCH_PAUSE_MS``, so that kills land in the middle of turns.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import redis

from june_worker import Agent, ToolContext, tool
from june_worker.engine.model import Done, ModelDelta, ModelRequest, TextChunk
from june_worker.engine.types import ModelReply, ToolCall, ToolMessage, UserMessage
from june_worker.models import Reply, ScriptedModel

__all__ = ["ALL", "PROBE", "PublishProbe"]


# --- bench: model, tool, model -------------------------------------------------------------------------


@tool
def tick(n: int) -> dict[str, int]:
    """Count one up."""
    return {"n": n + 1}


def _three_steps(request: ModelRequest) -> Reply:
    if isinstance(request.messages[-1], ToolMessage):
        return Reply(text="done")
    return Reply(calls=[{"id": "c1", "name": "tick", "input": {"n": 0}}])


# --- stamp: the event-latency turn ------------------------------------------------------------------------


class PublishProbe:
    """The engine's crash hook used as a stopwatch: when each commit of the running turn returned.

    ``before-publish`` is hit after the step's commit returned and before its events are
    published (``TurnRunner._commit``); ``after-model-commit`` / ``after-tool-commit`` once the
    publish returned (stored as ``after:<step>``). A prefork child runs one turn at a time, so
    the stamps since the last ``turn:open`` belong to the running turn.
    """

    def __init__(self) -> None:
        self.stamps: dict[str, int] = {}

    def fires(self, point: str, step: str) -> bool:
        """Never: the worker asks its crash hook this where it would die its own way (``before-intake``)."""
        return False

    def __call__(self, point: str, step: str) -> None:
        now = time.monotonic_ns()
        if point == "before-publish":
            if step == "turn:open":
                self.stamps = {}
            self.stamps[step] = now
        elif point in ("after-model-commit", "after-tool-commit"):
            self.stamps[f"after:{step}"] = now


PROBE = PublishProbe()


def _pause_s() -> float:
    return float(os.environ.get("JUNE_BENCH_PAUSE_MS", "2")) / 1000


@tool
def pause() -> dict[str, bool]:
    """Wait a moment, as a tool calling a service would."""
    time.sleep(_pause_s())
    return {"ok": True}


class StampModel:
    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        await asyncio.sleep(_pause_s())
        if isinstance(request.messages[-1], ToolMessage):
            yield Done(reply=ModelReply(text=json.dumps(PROBE.stamps)))
            return
        yield TextChunk(text=str(time.monotonic_ns()))
        await asyncio.sleep(_pause_s())
        yield Done(reply=ModelReply(tool_calls=[ToolCall(id="c1", name="pause", input={})]))


# --- hold: the recovery turn -------------------------------------------------------------------------------

_REDIS: tuple[int, redis.Redis] | None = None


def _redis() -> redis.Redis:
    global _REDIS
    if _REDIS is None or _REDIS[0] != os.getpid():
        _REDIS = (os.getpid(), redis.Redis.from_url(os.environ["JUNE_REDIS_URL"]))
    return _REDIS[1]


@tool
async def hold(ctx: ToolContext) -> dict[str, int]:
    """Block on the turn's first attempt (its worker gets killed meanwhile); return at once after."""
    r = _redis()
    key = f"{os.environ['JUNE_KEY_PREFIX']}:hold:{ctx.turn_id}"
    attempt = int(r.incr(key))
    r.rpush(f"{key}:pids", f"{os.getpid()}:{attempt}")
    if attempt == 1:
        await asyncio.sleep(600)
    return {"attempt": attempt}


def _hold_script(request: ModelRequest) -> Reply:
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        return Reply(text=f"recovered: {last.result}")
    return Reply(calls=[{"id": "c1", "name": "hold", "input": {}}])


# --- dribble: a long stream to cancel --------------------------------------------------------------------


class DribblingModel:
    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        n = int(os.environ.get("JUNE_BENCH_DELTAS", "20000"))
        for i in range(n):
            await asyncio.sleep(0.002)
            yield TextChunk(text=f"{i} ")
        yield Done(reply=ModelReply(text=f"streamed {n}"))


# --- chaos: a turn with a sync write, killed anywhere ---------------------------------------------------


@tool
def record(ctx: ToolContext) -> dict[str, bool]:
    """Write this call's row through the step's transaction: exactly once, whatever is killed when."""
    time.sleep(_pause_s())
    ctx.store.execute("insert into chaos_writes (turn_id, call_id) values (?, ?)", ctx.turn_id, ctx.call.id)
    return {"written": True}


class ChaosModel:
    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        await asyncio.sleep(_pause_s())
        for word in ("working", "on", "it"):
            yield TextChunk(text=f"{word} ")
        if isinstance(request.messages[-1], ToolMessage):
            yield Done(reply=ModelReply(text="recorded"))
        else:
            yield Done(reply=ModelReply(tool_calls=[ToolCall(id="c1", name="record", input={})]))


# --- wait: a turn that waits, as real ones do (bench/inflight.py) ----------------------------------------------


def _waits_s(request: ModelRequest) -> float:
    """The turn's W: its opening text is ``wait <seconds>``."""
    first = request.messages[0]
    words = first.text.split() if isinstance(first, UserMessage) else []
    return float(words[1]) if len(words) == 2 and words[0] == "wait" else 0.0


@tool
async def call_service(ctx: ToolContext, seconds: float) -> dict[str, bool]:
    """Call a slow service (waits ``seconds``)."""
    await asyncio.sleep(seconds)
    return {"ok": True}


class WaitingModel:
    """Two calls per turn, each waiting W before it answers (a model thinking); between them the async tool
    ``call_service`` waits W too: a turn waits 3 W in all, and does the work of a 3-step turn."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        w = _waits_s(request)
        await asyncio.sleep(w)
        if isinstance(request.messages[-1], ToolMessage):
            yield Done(reply=ModelReply(text="waited"))
        else:
            yield Done(reply=ModelReply(tool_calls=[ToolCall(id="c1", name="call_service", input={"seconds": w})]))


# --- subagents (bench/subagents.py --workers): a parent delegating to child turns run by any worker ----------


@tool
async def child_wait(ms: int) -> dict[str, int]:
    """Ask a slow service (waits ``ms``)."""
    await asyncio.sleep(ms / 1000)
    return {"waited_ms": ms}


def _child_script(request: ModelRequest) -> Reply:
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        return Reply("found")
    ms = int(last.text) if isinstance(last, UserMessage) and last.text.isdigit() else 100
    return Reply("", calls=[{"id": "w1", "name": "child_wait", "input": {"ms": ms}}])


@tool
async def ask_child(ctx: ToolContext, ms: int) -> dict[str, Any]:
    """Delegate to the child agent."""
    return await ctx.delegate(agent="child", text=str(ms))


def _parent_script(request: ModelRequest) -> Reply:
    """ "<n> <ms>": n calls at once, each delegating a child turn that waits ms."""
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        return Reply("children done")
    words = last.text.split() if isinstance(last, UserMessage) else []
    n, ms = (int(words[0]), int(words[1])) if len(words) == 2 else (4, 200)
    return Reply("", calls=[{"id": f"c{i}", "name": "ask_child", "input": {"ms": ms}} for i in range(n)])


def ALL() -> list[Agent]:  # noqa: N802 - the JUNE_AGENTS path names it
    return [
        Agent(name="bench", model=ScriptedModel(_three_steps), tools=[tick]),
        Agent(name="stamp", model=StampModel(), tools=[pause]),
        Agent(name="hold", model=ScriptedModel(_hold_script), tools=[hold]),
        Agent(name="dribble", model=DribblingModel()),
        Agent(name="chaos", model=ChaosModel(), tools=[record]),
        Agent(name="wait", model=WaitingModel(), tools=[call_service]),
        Agent(name="child", model=ScriptedModel(_child_script), tools=[child_wait]),
        Agent(name="par", model=ScriptedModel(_parent_script), tools=[ask_child], parallel_tools=16),
        Agent(name="ser", model=ScriptedModel(_parent_script), tools=[ask_child], parallel_tools=1),
    ]
