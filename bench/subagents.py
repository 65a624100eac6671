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

``--workers N`` runs the same on real workers instead (``bench/_harness.BenchStack``: N worker processes of
``-c 1`` and beat, a throwaway database and queues): the parent is sent as ``june.turn``, each child is
recorded and sent as its own ``june.turn`` to whichever worker takes it, and the parent is woken by the
worker that ends its last child. A worker process runs one turn at a time, so with 2 workers 4 children
run two at a time. Timed from the send to the parent's row ``completed``; also printed, the most children
whose runs overlapped (from each child's ``turn.started`` to its end, as Postgres stamped them).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Any

from _harness import throwaway_database

from june_worker.engine import Agent, Runtime, ToolContext, tool
from june_worker.engine.model import ModelRequest
from june_worker.engine.store import SessionRef
from june_worker.engine.types import ToolMessage
from june_worker.models.scripted import Reply, ScriptedModel
from june_worker.stores import PostgresStore

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


def _on_workers(args: argparse.Namespace) -> dict[str, list[float]]:
    from _harness import BenchStack, wait_for

    times: dict[str, list[float]] = {"parallel": [], "serial": [], "overlap": []}
    with BenchStack("subagents") as stack:
        workers = [stack.worker(f"w{i}") for i in range(args.workers)]
        stack.wait_ready(*workers)
        stack.beat()

        def run(agent: str) -> tuple[float, int]:
            session = stack.session(f"{agent}-{uuid.uuid4().hex[:8]}")
            started = time.perf_counter()
            turn_id = stack.turn(agent, session, f"{args.children} {int(args.wait_ms)}")
            query = "select status from june_turns where agent = %s and session = %s and turn_id = %s"

            def done() -> bool:
                rows = stack.sql(query, agent, session, turn_id)
                if rows and rows[0][0] in ("failed", "cancelled", "rejected"):
                    raise RuntimeError(f"the parent turn ended {rows[0][0]}")
                return bool(rows) and rows[0][0] == "completed"

            wait_for(done, timeout_s=120, every_s=0.005, what="the parent turn")
            elapsed = time.perf_counter() - started
            spans = stack.sql(
                "select e.created_at, t.finished_at from june_turns t join june_events e on e.agent = t.agent "
                "and e.session = t.session and e.turn_id = t.turn_id and e.type = 'turn.started' "
                "where t.agent = 'child' and t.session like %s",
                f"{session}:sub:%",
            )
            assert len(spans) == args.children, spans
            most = max(sum(1 for s, f in spans if s <= at < f) for at, _ in spans)
            return elapsed, most

        run("par")  # warm
        for _ in range(args.rounds):
            elapsed, most = run("par")
            times["parallel"].append(elapsed)
            times["overlap"].append(float(most))
            times["serial"].append(run("ser")[0])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--wait-ms", type=float, default=200.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=0, help="run on this many worker processes (0: in process)")
    args = parser.parse_args()
    if args.workers:
        times = _on_workers(args)
        where = f"on {args.workers} worker processes (-c 1)"
    else:
        with throwaway_database() as url:
            times = asyncio.run(_bench(args, url))
        where = "in process (Postgres store)"
    med: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"a parent with {args.children} child turns, each waiting {args.wait_ms:.0f} ms, {where}, "
        f"medians over {args.rounds} rounds:"
    )
    print(f"  floor     {args.wait_ms:8.1f} ms (one child's wait)")
    for key in ("parallel", "serial"):
        print(f"  {key:<9} {med[key] * 1000:8.1f} ms")
    if "overlap" in med:
        print(f"  children running at once (parallel): {med['overlap']:.0f}")
    print(f"  ratio serial / parallel: {med['serial'] / med['parallel']:.2f}x")


if __name__ == "__main__":
    main()
