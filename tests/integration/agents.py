"""Agents served by the Celery workers the integration tests start (``JUNE_AGENTS=tests.integration.agents:ALL``).

Every model here is scripted and decides from the transcript alone, so a replay on another
worker gets the same replies.

* ``ops``: "order <n> <item>" places an order with the sync ``create_order`` tool, which
  writes a row through the step's transaction (exactly-once); "slow <key>" calls the async
  ``hold`` tool, which blocks on its first attempt until the worker is killed; "refund"
  asks for approval; anything else gets "ok".
  "die <key>" calls the sync ``die`` tool, which SIGKILLs its own process every time.
* ``dribble``: the model streams many deltas slowly, so a cancel can land mid-stream.
* ``faulty`` (:mod:`.faulty`): stops at a chosen step so a test can inject a fault there.
* ``window``: a model with a 2,000-token window whose requests carry 1,500 tokens the transcript does
  not show (:class:`tests.unit.kit.WindowModel`): a session's second turn compacts before its request.
* ``fan`` (``parallel_tools=8``): "fan <n> <key>" asks for n async ``fan_call`` calls at once; on their
  first attempt the even-numbered ones block until the test kills the worker (or releases them), the odd
  ones return at once. Each logs when it starts and ends, so a test sees how many ran together.
* ``desks`` (``parallel_tools=8``): "desks <n>" asks n desks to sign off at once (async ``sign_off``
  calls, request ``desk<i>``, answered by user ``owner-<i>``): the turn parks on all n requests;
  "desks <n> expire" gives desk 1 a second (``timeout_s``), after which its call reads "timed out".
* ``overloaded``: "overloaded <n> <key>" makes the provider answer 529 overloaded (a retryable
  ``ModelProviderError``) to the session's first n model calls, counted in Redis; "overloaded never <key>" to
  all of them; anything else gets "ok".
* ``echo``: answers with :func:`transcript_digest` of the transcript it was sent, so a test can check
  that every model call saw the stored transcript, whichever worker made it; "tick" first calls the
  sync ``tick`` tool.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from june_wire.redis_url import connect
from june_worker import Agent, ToolContext, tool
from june_worker.engine.agent import AnswerRequest
from june_worker.engine.model import Done, ModelDelta, ModelRequest, TextChunk
from june_worker.engine.types import Message, ModelReply, ToolMessage, TriggerMessage, UserMessage
from june_worker.models import Reply, ScriptedModel

from ..unit.kit import WindowModel
from .faulty import faulty_agent


@tool
def create_order(ctx: ToolContext, item: str, qty: int = 1) -> dict[str, Any]:
    """Place an order: the row commits with the step, exactly once."""
    ctx.store.execute(
        "create table if not exists it_orders (turn_id text not null, call_id text not null, item text, qty integer)"
    )
    ctx.store.execute(
        "insert into it_orders (turn_id, call_id, item, qty) values (?, ?, ?, ?)", ctx.turn_id, ctx.call.id, item, qty
    )
    return {"item": item, "qty": qty}


def _redis() -> Any:
    """The events Redis of the worker (JUNE_REDIS_URL: one Redis, or a Redis Cluster); the tests' keys are
    single-key commands, so either works."""
    return connect(os.environ["JUNE_REDIS_URL"])


@tool
async def hold(ctx: ToolContext, key: str) -> dict[str, Any]:
    """Block on the first attempt (the test kills this worker meanwhile); return at once after."""
    r = _redis()
    attempt = r.incr(f"it:hold:{key}")
    r.rpush(f"it:hold:{key}:log", f"{os.getpid()}:{attempt}")
    if attempt == 1:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not r.exists(f"it:hold:{key}:release"):
            await asyncio.sleep(0.05)
    return {"attempt": int(attempt)}


@tool
def die(ctx: ToolContext, key: str) -> dict[str, Any]:
    """Take the worker process down every time (out of memory, a segfault): poison for the failure policy."""
    _redis().incr(f"it:die:{key}")
    os.kill(os.getpid(), signal.SIGKILL)
    return {"unreachable": True}


@tool
async def approve(ctx: ToolContext, amount: float = 10.0) -> dict[str, Any]:
    """Ask an operator to approve a refund."""
    ok = await ctx.request_input(
        id="approve-refund", prompt=f"Refund {amount}?", schema={"type": "boolean"}, answerers={"policy": "operator"}
    )
    return {"refunded": ok is True}


def _ops_script(request: ModelRequest) -> Reply:
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        return Reply(f"Done: {last.name} -> {last.result}")
    text = last.text if isinstance(last, (UserMessage, TriggerMessage)) else ""
    words = text.split()
    if words[:1] == ["order"]:
        qty = int(words[1]) if len(words) > 1 and words[1].isdigit() else 1
        item = words[2] if len(words) > 2 else "widget"
        return Reply("Placing it.", calls=[{"id": "c1", "name": "create_order", "input": {"item": item, "qty": qty}}])
    if words[:1] == ["slow"]:
        return Reply("Holding.", calls=[{"id": "c1", "name": "hold", "input": {"key": words[1]}}])
    if words[:1] == ["quick"]:
        return Reply("Asking briefly.", calls=[{"id": "c1", "name": "approve_soon", "input": {}}])
    if words[:1] == ["die"]:
        return Reply("Trying.", calls=[{"id": "c1", "name": "die", "input": {"key": words[1]}}])
    if words[:1] == ["refund"]:
        return Reply("Asking.", calls=[{"id": "c1", "name": "approve", "input": {"amount": 5}}])
    return Reply(f"ok: {text}")


@tool
async def fan_call(ctx: ToolContext, key: str, i: int) -> dict[str, Any]:
    """One call of a parallel batch: logs ``<pid>:start:<i>`` and ``<pid>:end:<i>``; counts its runs."""
    r = _redis()
    runs = r.incr(f"it:fan:{key}:{i}")
    r.rpush(f"it:fan:{key}:log", f"{os.getpid()}:start:{i}")
    if runs == 1 and i % 2 == 0:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not r.exists(f"it:fan:{key}:release"):
            await asyncio.sleep(0.05)
    else:
        await asyncio.sleep(0.1)
    r.rpush(f"it:fan:{key}:log", f"{os.getpid()}:end:{i}")
    return {"i": i, "run": int(runs)}


def _fan_script(request: ModelRequest) -> Reply:
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        results = [m.result for m in request.messages if isinstance(m, ToolMessage)]
        return Reply(f"fanned: {results}")
    words = (last.text if isinstance(last, UserMessage) else "").split()
    n, key = int(words[1]), words[2]
    calls = [{"id": f"c{i}", "name": "fan_call", "input": {"key": key, "i": i}} for i in range(1, n + 1)]
    return Reply("Fanning out.", calls=calls)


@tool
async def sign_off(ctx: ToolContext, desk: int, timeout_s: float | None = None) -> dict[str, Any]:
    """Ask one desk to sign off (within ``timeout_s``, if given: then the answer is ``"timed out"``)."""
    from june_worker.errors import InputTimeoutError

    try:
        ok = await ctx.request_input(
            id=f"desk{desk}", prompt=f"Desk {desk}: sign off?", answerers={"user": f"owner-{desk}"}, timeout_s=timeout_s
        )
    except InputTimeoutError:
        ok = "timed out"
    return {"desk": desk, "answer": ok}


def _desks_script(request: ModelRequest) -> Reply:
    """``desks <n> [expire]``: n desks at once; with ``expire``, desk 1 has a second to answer."""
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        return Reply(f"signed: {[m.result for m in request.messages if isinstance(m, ToolMessage)]}")
    words = (last.text if isinstance(last, UserMessage) else "desks 2").split()
    n, expire = int(words[1]), words[2:3] == ["expire"]
    calls = [
        {"id": f"c{i}", "name": "sign_off", "input": {"desk": i, **({"timeout_s": 1.0} if expire and i == 1 else {})}}
        for i in range(1, n + 1)
    ]
    return Reply("Asking.", calls=calls)


def _authorize(req: AnswerRequest) -> bool:
    if req.by == "op-outage":  # the app's own lookup fails (its database is down)
        raise RuntimeError("operator directory unavailable")
    return req.policy == "operator" and (req.by or "").startswith("op-")


class DribblingModel:
    """Streams ``JUNE_IT_DELTAS`` deltas ~2 ms apart on a turn's first model call, then answers. A turn whose text
    starts with "long" streams 30 times as many (two minutes or more): a test that stops it mid-stream (cancel,
    replace, reset) does not race the stream's end on a busy machine, and a stop that fails still shows."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        n = int(os.environ.get("JUNE_IT_DELTAS", "2000"))
        said = next((m.text for m in reversed(request.messages) if isinstance(m, UserMessage)), "")
        if said.startswith("long"):
            n *= 30
        for i in range(n):
            await asyncio.sleep(0.002)
            yield TextChunk(text=f"{i} ")
        yield Done(reply=ModelReply(text=f"streamed {n}"))


class OverloadedModel:
    """A provider that is overloaded (529, retryable) for a while, or for good: see the module docstring."""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        from june_worker.errors import ModelProviderError

        words = next((m.text.split() for m in reversed(request.messages) if isinstance(m, UserMessage)), [])
        if words[:1] == ["overloaded"] and len(words) == 3:
            calls = _redis().incr(f"it:overloaded:{words[2]}")
            if words[1] == "never" or calls <= int(words[1]):
                raise ModelProviderError("overloaded", status_code=529, error_type="overloaded_error", retryable=True)
        yield Done(reply=ModelReply(text=f"ok: {' '.join(words)}"))


def transcript_digest(messages: list[Message]) -> str:
    """How many messages, and a hash of all of them: what the echo model answers."""
    joined = "\n".join(m.model_dump_json() for m in messages)
    return f"{len(messages)} {hashlib.sha256(joined.encode()).hexdigest()[:16]}"


def _echo_script(request: ModelRequest) -> Reply:
    last = request.messages[-1]
    if isinstance(last, UserMessage) and last.text.startswith("tick"):
        return Reply(transcript_digest(request.messages), calls=[{"id": "c1", "name": "tick", "input": {}}])
    return Reply(transcript_digest(request.messages))


@tool
def tick() -> dict[str, Any]:
    """Do nothing, as a step of its own."""
    return {"ticked": True}


@tool
async def delegate_to(ctx: ToolContext, agent: str, text: str, wait: bool = True) -> dict[str, Any]:
    """Run a turn of another agent (a child turn) and return its result; counts its runs per call."""
    _redis().incr(f"it:delegate:{ctx.session_id}:{ctx.call.id}")
    return await ctx.delegate(agent=agent, text=text, wait=wait)


@tool
async def give_up(ctx: ToolContext, key: str) -> dict[str, Any]:
    """Fail the turn (a fatal error) once a scout child of ``key`` has started working."""
    from june_worker.errors import FatalToolError

    r, deadline = _redis(), time.monotonic() + 30
    while time.monotonic() < deadline and not r.llen(f"it:scout:{key}:log"):
        await asyncio.sleep(0.05)
    raise FatalToolError("the boss gives up")


def _boss_script(request: ModelRequest) -> Reply:
    """``delegate <n> <key> [start|hold|ask|mixed|holdask|holdfail]``: n calls at once, each delegating
    ``scout <key> <i> <n>`` to the scout agent (``start``: without waiting for it; ``hold``: the children wait for a
    release key; ``ask``: each child asks a person, ``go``; ``mixed``: the first child holds, the others end at once;
    ``holdask``: as ``hold``, and one more call asks user ``owner-1`` (request ``desk1``); ``holdfail``: as ``hold``,
    and one more call fails the turn once a child works)."""
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        results = [m.result for m in request.messages if isinstance(m, ToolMessage)]
        return Reply(f"children: {results}")
    words = (last.text if isinstance(last, UserMessage) else "").split()
    if words[:1] != ["delegate"]:
        return Reply(f"ok: {' '.join(words)}")
    n, key, mode = int(words[1]), words[2], words[3:4]
    # hold: each child waits for it:scout:<key>:release; mixed: the first does, the others end at once
    barrier = 0 if mode in (["hold"], ["holdask"], ["holdfail"]) else n
    calls = [
        {
            "id": f"c{i}",
            "name": "delegate_to",
            "input": {
                "agent": "scout",
                "text": f"ask {key}"
                if mode == ["ask"]
                else f"scout {key} {i} {(0 if i == 1 else 1) if mode == ['mixed'] else barrier}",
                "wait": mode != ["start"],
            },
        }
        for i in range(1, n + 1)
    ]
    if mode == ["holdask"]:
        calls.append({"id": f"c{n + 1}", "name": "sign_off", "input": {"desk": 1}})
    if mode == ["holdfail"]:
        calls.append({"id": f"c{n + 1}", "name": "give_up", "input": {"key": key}})
    return Reply("Delegating.", calls=calls)


@tool
async def scout_work(ctx: ToolContext, key: str, i: int, n: int) -> dict[str, Any]:
    """A child's work: logs ``<pid>:start:<i>``, waits until two of its ``n`` siblings started (or 30 s), logs the end;
    waits for ``it:scout:<key>:release`` instead when ``n`` is 0."""
    r = _redis()
    r.incr(f"it:scout:{key}:{i}")
    r.rpush(f"it:scout:{key}:log", f"{os.getpid()}:start:{i}")
    deadline = time.monotonic() + 30

    def waiting() -> bool:
        if n == 0:
            return not r.exists(f"it:scout:{key}:release")
        return sum(1 for e in r.lrange(f"it:scout:{key}:log", 0, -1) if b":start:" in e) < min(n, 2)

    while time.monotonic() < deadline and waiting():
        await asyncio.sleep(0.05)
    r.rpush(f"it:scout:{key}:log", f"{os.getpid()}:end:{i}")
    return {"i": i}


@tool
async def scout_ask(ctx: ToolContext) -> dict[str, Any]:
    """Ask a person whether to go on."""
    return {"go": await ctx.request_input(id="go", prompt="Go on?", schema={"type": "boolean"})}


def _scout_script(request: ModelRequest) -> Reply:
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        return Reply(f"scouted {last.result}")
    words = (last.text if isinstance(last, UserMessage) else "").split()
    if words[:1] == ["ask"]:
        return Reply("Asking.", calls=[{"id": "a1", "name": "scout_ask", "input": {}}])
    if words[:1] == ["scout"] and len(words) == 4:
        work = {"key": words[1], "i": int(words[2]), "n": int(words[3])}
        return Reply("Working.", calls=[{"id": "w1", "name": "scout_work", "input": work}])
    return Reply(f"scouted: {' '.join(words)}")


# --- flight: turns that stay in flight (many per process: tests/integration/test_inflight.py) ----------------

_AREDIS: dict[int, Any] = {}


def _aredis() -> Any:
    """An asyncio client of the events Redis for the running loop (never a blocking call on the turns' loop)."""
    import redis.asyncio as aioredis

    loop = id(asyncio.get_running_loop())
    if loop not in _AREDIS:
        # hundreds of turns wait at once: they take turns on a few connections (redis-py's default pool refuses
        # a connection past its maximum instead of waiting for one)
        pool = aioredis.BlockingConnectionPool.from_url(os.environ["JUNE_REDIS_URL"], max_connections=16)
        _AREDIS[loop] = aioredis.Redis(connection_pool=pool)
    return _AREDIS[loop]


@tool
def flight_write(ctx: ToolContext) -> dict[str, Any]:
    """One row per call through the step's transaction: exactly once, whatever is killed when."""
    ctx.store.execute("insert into it_flight (turn_id, call_id) values (?, ?)", ctx.turn_id, ctx.call.id)
    return {"written": True}


@tool
async def linger(ctx: ToolContext, key: str) -> dict[str, Any]:
    """Wait, without holding the loop, until the test opens the gate ``it:flight:<key>:go`` (at most 120 s)."""
    r = _aredis()
    await r.incr(f"it:flight:{key}:lingering")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not await r.exists(f"it:flight:{key}:go"):
        await asyncio.sleep(0.05)
    return {"lingered": True}


@tool
async def hold_the_loop(ctx: ToolContext, seconds: float) -> dict[str, Any]:
    """A blocking call inside an async tool (the mistake LoopWatch reports): the loop is held that long."""
    time.sleep(seconds)
    return {"held_s": seconds}


def _flight_script(request: ModelRequest) -> Reply:
    """``flight <key>``: a sync write, then an async wait on the key's gate, then the answer. ``hold <s>``: a tool
    that holds the loop for s seconds."""
    first, last = request.messages[0], request.messages[-1]
    words = first.text.split() if isinstance(first, (UserMessage, TriggerMessage)) else []
    if words[:1] == ["hold"]:
        if isinstance(last, ToolMessage):
            return Reply("released")
        return Reply("", calls=[{"id": "h1", "name": "hold_the_loop", "input": {"seconds": float(words[1])}}])
    if isinstance(last, ToolMessage) and last.call_id == "c2":
        return Reply("landed")
    if isinstance(last, ToolMessage):
        return Reply("", calls=[{"id": "c2", "name": "linger", "input": {"key": words[1]}}])
    return Reply("", calls=[{"id": "c1", "name": "flight_write", "input": {}}])


def ALL() -> list[Agent]:  # noqa: N802 - the JUNE_AGENTS path names it
    return [
        Agent(
            name="ops",
            model=ScriptedModel(_ops_script),
            tools=[create_order, hold, approve, approve_soon, die],
            authorize_answer=_authorize,
            deliver=_deliver,
        ),
        Agent(name="dribble", model=DribblingModel()),
        Agent(name="overloaded", model=OverloadedModel()),
        faulty_agent(),
        Agent(name="echo", model=ScriptedModel(_echo_script), tools=[tick]),
        Agent(name="window", model=WindowModel(2000, extra_tokens=1500)),
        Agent(name="fan", model=ScriptedModel(_fan_script), tools=[fan_call], parallel_tools=8),
        Agent(name="desks", model=ScriptedModel(_desks_script), tools=[sign_off], parallel_tools=8),
        Agent(name="boss", model=ScriptedModel(_boss_script), tools=[delegate_to, sign_off, give_up], parallel_tools=4),
        Agent(name="scout", model=ScriptedModel(_scout_script), tools=[scout_work, scout_ask]),
        Agent(name="flight", model=ScriptedModel(_flight_script), tools=[flight_write, linger, hold_the_loop]),
    ]


def OPS_ONLY() -> list[Agent]:  # noqa: N802 - a worker of one queue only (tests/integration/test_worker_queues.py)
    return [a for a in ALL() if a.name == "ops"]


def ECHO_ONLY() -> list[Agent]:  # noqa: N802 - the workers of another queue
    return [a for a in ALL() if a.name == "echo"]


def BOSS_AND_SCOUT() -> list[Agent]:  # noqa: N802 - a parent agent and its subagent, on a queue of their own
    return [a for a in ALL() if a.name in ("boss", "scout")]


def _deliver(*, target: dict[str, Any], result: Any, events: list[Any], session: str) -> None:
    if target.get("channel") == "broken":  # a target whose rendering always fails
        _redis().rpush(f"it:delivery-failed:{session}", "attempt")
        raise RuntimeError("the channel is broken")
    _redis().rpush(f"it:delivered:{session}", f"{target.get('channel')}|{getattr(result, 'text', result.status)}")
    _redis().rpush(f"it:delivered-events:{session}", ",".join(e.type for e in events))  # the history it rendered


@tool
async def approve_soon(ctx: ToolContext) -> dict[str, Any]:
    """Ask for approval, but give up after a second."""
    from june_worker.errors import InputTimeoutError

    try:
        ok = await ctx.request_input(id="quick", prompt="Approve within a second?", timeout_s=1.0)
    except InputTimeoutError:
        return {"approved": False, "timed_out": True}
    return {"approved": ok}
