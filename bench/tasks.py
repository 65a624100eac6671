"""Bench-only additions to the june worker, loaded with ``celery -A june_worker worker -I bench.tasks``.

* ``bench.empty``: the baseline, a task that does nothing, registered on the same app as the
  ``june.*`` tasks, so it runs under the very same settings (JSON, acks_late, prefetch 1, task
  events, started state and result stored in the result backend).
* ``bench.commits``: the floor of a turn's cost through Celery, what a 3-step turn cannot do without:
  ``n`` (4, a turn's commits) one-row INSERTs in autocommit, each its own round trip and fsync, on a
  connection the pool process keeps to ``JUNE_DATABASE_URL``, into a table of its own; no engine, no events, no lease.
* A WARNING line ``bench worker ready`` when the worker consumes (the benches run workers at
  ``-l WARNING``, where Celery's own ``ready.`` line is not printed).
* With ``JUNE_BENCH_PROBE=1``: :data:`bench.agents.PROBE` becomes the host's crash hook in each
  pool process, to time commits for the ``stamp`` agent (it never crashes anything).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import psycopg
from celery.signals import worker_process_init, worker_ready

from june_worker.worker.app import app

log = logging.getLogger("bench")


@app.task(name="bench.empty")
def empty(*args: Any, **kwargs: Any) -> dict[str, str]:
    return {"status": "ok"}


_floor: psycopg.Connection[Any] | None = None


@app.task(name="bench.commits")
def commits(payload: dict[str, Any] | None = None) -> dict[str, str]:
    global _floor
    n = int((payload or {}).get("n", 4))
    if _floor is None or _floor.closed:
        _floor = psycopg.connect(os.environ["JUNE_DATABASE_URL"], autocommit=True)
        _floor.execute(f"create table bench_floor_{os.getpid()} (id bigserial primary key, v text)")
    for _ in range(n):
        _floor.execute(f"insert into bench_floor_{os.getpid()} (v) values (%s)", ("x",))
    return {"status": "ok"}


@worker_ready.connect
def _ready(**_: Any) -> None:
    log.warning("bench worker ready")


@worker_process_init.connect
def _install_probe(**_: Any) -> None:
    if os.environ.get("JUNE_BENCH_PROBE") == "1":
        from june_worker.worker.process import get_host

        from .agents import PROBE

        get_host().crash = PROBE
