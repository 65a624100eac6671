"""A batch of async tool calls run in parallel (``Agent(parallel_tools=N)``) against the same batch in turn.

Run: ``.venv/bin/python bench/parallel_tools.py [--calls 8] [--wait-ms 100] [--rounds 5]``.

Each turn's model asks for ``--calls`` async calls at once; each call waits ``--wait-ms`` (an outside
API, say) and returns. The turn runs in process on a Postgres store (its own database
``june_bench_<random>`` on ``JUNE_DATABASE_URL``, dropped at the end), every result committed as
its own step, as on a worker. Three figures per round, interleaved so that load on the machine
hits them alike:

* **ideal**: the same waits gathered with ``asyncio.gather`` and no engine (the floor);
* **parallel**: the turn with ``parallel_tools`` = calls;
* **serial**: the turn with ``parallel_tools=1`` (the reference's behaviour).

Printed: the median wall time of each, the turn's own cost above the floor (parallel - ideal), and
the ratios serial / parallel and parallel / ideal.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Any

from _harness import throwaway_database

from june_worker.engine import Agent, Runtime, tool
from june_worker.engine.model import ModelRequest
from june_worker.engine.types import ToolMessage
from june_worker.models.scripted import Reply, ScriptedModel
from june_worker.stores import PostgresStore


def _agent(calls: int, wait_s: float, parallel: int) -> Agent:
    @tool
    async def fetch(key: int) -> dict[str, int]:
        """Fetch one thing from a slow service."""
        await asyncio.sleep(wait_s)
        return {"key": key}

    def script(request: ModelRequest) -> Reply:
        if isinstance(request.messages[-1], ToolMessage):
            return Reply("fetched")
        return Reply("", calls=[{"id": f"c{i}", "name": "fetch", "input": {"key": i}} for i in range(calls)])

    return Agent(name=f"p{parallel}", model=ScriptedModel(script), tools=[fetch], parallel_tools=parallel)


async def _turn(runtime: Runtime, agent: str) -> float:
    session = runtime.session(agent, f"s-{uuid.uuid4().hex[:12]}")
    started = time.perf_counter()
    assert await session.turn("fetch them", turn_id=f"t-{uuid.uuid4().hex[:12]}") == "fetched"
    return time.perf_counter() - started


async def _ideal(calls: int, wait_s: float) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(asyncio.sleep(wait_s) for _ in range(calls)))
    return time.perf_counter() - started


async def _bench(args: argparse.Namespace, url: str) -> dict[str, list[float]]:
    wait_s = args.wait_ms / 1000
    store = PostgresStore(url)
    try:
        agents = [_agent(args.calls, wait_s, args.calls), _agent(args.calls, wait_s, 1)]
        runtime = Runtime(agents, store)
        await _turn(runtime, agents[0].name)  # warm: schema, connections, plans
        times: dict[str, list[float]] = {"ideal": [], "parallel": [], "serial": []}
        for _ in range(args.rounds):
            times["ideal"].append(await _ideal(args.calls, wait_s))
            times["parallel"].append(await _turn(runtime, agents[0].name))
            times["serial"].append(await _turn(runtime, agents[1].name))
        return times
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--wait-ms", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with throwaway_database() as url:
        times = asyncio.run(_bench(args, url))
    med: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{args.calls} async calls of {args.wait_ms:.0f} ms each, medians over {args.rounds} rounds (Postgres store):"
    )
    for key in ("ideal", "parallel", "serial"):
        print(f"  {key:<9} {med[key] * 1000:8.1f} ms")
    print(f"  engine above the floor (parallel - ideal): {(med['parallel'] - med['ideal']) * 1000:.1f} ms")
    print(f"  ratio serial / parallel: {med['serial'] / med['parallel']:.2f}x")
    print(f"  ratio parallel / ideal:  {med['parallel'] / med['ideal']:.2f}")


if __name__ == "__main__":
    main()
