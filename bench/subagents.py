"""A parent turn delegating to several child turns at once (``ctx.delegate`` with ``parallel_tools``) against
the same children one after the other.

Run: ``.venv/bin/python bench/subagents.py [--children 4] [--wait-ms 200] [--rounds 5]``.

The parent's model asks for ``--children`` calls at once; each delegates to a child agent whose one async
tool waits ``--wait-ms`` (a slow outside API). In process on a Postgres store (its own database
``june_bench_<random>`` on ``JUNE_DATABASE_URL``, dropped at the end): every child is its own session and
turn, the parent parks on its children and is resumed by them, each step committed as on a worker. Per
round, interleaved:

* **parallel**: the parent with ``parallel_tools`` = children: it parks once, on all of them;
* **serial**: ``parallel_tools=1``: each call starts its child and parks on it before the next call runs.

Printed: the median wall time of each, the floor (one child's wait), and the ratio serial / parallel.
(`tests/integration/test_worker_subagents.py` runs four children on two worker processes.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import time
import uuid
from typing import Any

import psycopg

from june_worker.engine import Agent, Runtime, ToolContext, tool
from june_worker.engine.model import ModelRequest
from june_worker.engine.store import SessionRef
from june_worker.engine.types import ToolMessage
from june_worker.models.scripted import Reply, ScriptedModel
from june_worker.stores import PostgresStore

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
TERMINAL = {"turn.completed", "turn.failed", "turn.cancelled"}


def _agents(children: int, wait_s: float) -> list[Agent]:
    @tool
    async def lookup(key: int) -> dict[str, int]:
        """Ask a slow service."""
        await asyncio.sleep(wait_s)
        return {"key": key}

    def child_script(request: ModelRequest) -> Reply:
        if isinstance(request.messages[-1], ToolMessage):
            return Reply("found")
        return Reply("", calls=[{"id": "l1", "name": "lookup", "input": {"key": 1}}])

    @tool
    async def ask(ctx: ToolContext, q: str) -> dict[str, Any]:
        """Delegate to the child agent."""
        return await ctx.delegate(agent="child", text=q)

    def parent_script(request: ModelRequest) -> Reply:
        if isinstance(request.messages[-1], ToolMessage):
            return Reply("done")
        return Reply("", calls=[{"id": f"c{i}", "name": "ask", "input": {"q": f"q{i}"}} for i in range(children)])

    return [
        Agent(name="child", model=ScriptedModel(child_script), tools=[lookup]),
        Agent(name="par", model=ScriptedModel(parent_script), tools=[ask], parallel_tools=children),
        Agent(name="ser", model=ScriptedModel(parent_script), tools=[ask], parallel_tools=1),
    ]


async def _turn(runtime: Runtime, agent: str) -> float:
    session = runtime.session(agent, f"s-{uuid.uuid4().hex[:12]}")
    done = asyncio.Event()
    turn_id = f"t-{uuid.uuid4().hex[:12]}"
    stop = session.observe(lambda e: done.set() if e.type in TERMINAL else None, turn_id=turn_id)
    started = time.perf_counter()
    try:
        await session.start("go", turn_id=turn_id)
        await asyncio.wait_for(done.wait(), 120)
    finally:
        stop()
    elapsed = time.perf_counter() - started
    ref = SessionRef(agent, session.session_id)
    rec = runtime.store.get_turn(ref, turn_id)
    assert rec is not None and rec.status == "completed", rec
    children = runtime.store.child_turns(ref, turn_id, ["child"])
    assert children and all(c.status == "completed" for c in children), "the children did not run"
    return elapsed


async def _bench(args: argparse.Namespace, url: str) -> dict[str, list[float]]:
    store = PostgresStore(url)
    try:
        runtime = Runtime(_agents(args.children, args.wait_ms / 1000), store)
        await _turn(runtime, "par")  # warm: schema, connections, plans
        times: dict[str, list[float]] = {"parallel": [], "serial": []}
        for _ in range(args.rounds):
            times["parallel"].append(await _turn(runtime, "par"))
            times["serial"].append(await _turn(runtime, "ser"))
        return times
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--wait-ms", type=float, default=200.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    base = os.environ.get("JUNE_DATABASE_URL", DEFAULT_URL)
    name = f"june_bench_{secrets.token_hex(4)}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'create database "{name}"')
    try:
        url = psycopg.conninfo.make_conninfo(base, dbname=name)
        times = asyncio.run(_bench(args, url))
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'drop database if exists "{name}" with (force)')
    med: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"a parent with {args.children} child turns, each waiting {args.wait_ms:.0f} ms, "
        f"medians over {args.rounds} rounds (Postgres store):"
    )
    print(f"  floor     {args.wait_ms:8.1f} ms (one child's wait)")
    for key in ("parallel", "serial"):
        print(f"  {key:<9} {med[key] * 1000:8.1f} ms")
    print(f"  ratio serial / parallel: {med['serial'] / med['parallel']:.2f}x")


if __name__ == "__main__":
    main()
