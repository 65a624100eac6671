"""One process of the two-process SQLite test: a runtime on a shared file runs turn t1 of ops/s1.

``python -m tests.unit._sqlite_process DB WORKDIR LOCK_TIMEOUT_S`` prints one JSON line: how t1
ended for this process, or that the file was locked. The turn's async tool appends this process's
pid to ``WORKDIR/runs`` and then waits until ``WORKDIR/release`` exists, so the test decides when
the first run may finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from june_worker import Agent, Runtime, tool
from june_worker.errors import JuneError, StoreLockedError
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import SQLiteStore

RELEASE_WAIT_S = 60.0


def agent(work: Path) -> Agent:
    @tool
    async def slow_refund(order_id: str) -> dict[str, Any]:
        """Refund an order (counts its runs, and waits for the test's go-ahead)."""
        with (work / "runs").open("a") as runs:
            runs.write(f"{os.getpid()}\n")
        deadline = time.monotonic() + RELEASE_WAIT_S
        while not (work / "release").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the test never released the tool")
            await asyncio.sleep(0.01)
        return {"refunded": order_id}

    script = [Reply("", calls=[{"id": "c1", "name": "slow_refund", "input": {"order_id": "42"}}]), Reply("Refunded.")]
    return Agent(name="ops", model=ScriptedModel(script), tools=[slow_refund])


async def run(db: str, work: Path, lock_timeout_s: float) -> dict[str, Any]:
    try:
        store = SQLiteStore(db, lock_timeout_s=lock_timeout_s)
    except StoreLockedError as exc:
        return {"status": "locked", "error": str(exc)}
    try:
        session = Runtime([agent(work)], store).session("ops", "s1")
        await session.start("refund order 42", turn_id="t1")
        result = await session.result("t1")
        return {"status": result.status, "text": getattr(result, "text", None)}
    except JuneError as exc:
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        store.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    outcome = asyncio.run(run(sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])))
    print(json.dumps({"pid": os.getpid(), **outcome}), flush=True)
