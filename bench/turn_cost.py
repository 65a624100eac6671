"""Where a turn's time goes in the worker host, without Celery: every round trip of ``june.turn``'s work, by statement.

    .venv/bin/python bench/turn_cost.py [--quick] [-n 300]

Runs :func:`june_worker.worker.control.intake` (what the ``june.turn`` task calls) in this
process, on a :class:`~june_worker.worker.host.WorkerHost` over a throwaway database
``june_bench_<random>`` of ``JUNE_DATABASE_URL`` and ``JUNE_REDIS_URL`` under a unique key prefix
(both removed at the end), for ``-n`` turns of the ``bench`` agent (model, sync tool, model),
each in a new session. Every Postgres statement (``psycopg.Cursor.execute``) and every Redis
command or pipeline the turn sends is counted and timed (wall clock, from the call to its
return) and named after the code that sends it. What no round trip explains (the engine,
pydantic, the event loop) is the remainder. Next to it: a bare ``select 1`` and a PING, timed
in the same run, as the price of one round trip on this machine.

The rule a reader must not break: these figures are one process with nothing else to do; the
Celery task adds its own costs around them (see ``bench/throughput.py``).
"""

from __future__ import annotations

import argparse
import collections
import logging
import resource
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import redis
from _harness import BenchStack, machine, median, sigterm_as_exit
from agents import ALL

from june_worker.events.redis_stream import RedisStreamSink
from june_worker.worker import control
from june_worker.worker.host import WorkerHost
from june_worker.worker.payloads import TurnMessage
from june_worker.worker.settings import WorkerSettings

# What sends each statement, by how the SQL starts (file names as of this bench's writing).
NAMES = [
    ("select (select suspended::text", "worker/queue.py SessionQueue.intake_view (turn row + park)"),
    ("select turn_id, position, status", "stores/postgres.py get_turn"),
    ("select suspended::text from june_sessions", "stores/postgres.py pending"),
    ("with snap as", "worker/queue.py SessionQueue.intake (turn + lease + transcript)"),
    ("with existing as", "stores/postgres.py enqueue_turn"),
    ("with acquired as", "worker/queue.py SessionQueue.take (lease + first turn)"),
    ("insert into june_sessions (agent, session, lease_owner", "worker/queue.py SessionQueue.acquire"),
    ("select s.reset_pending", "worker/queue.py SessionQueue.next_turn"),
    ("with released as", "worker/queue.py SessionQueue.release_or_next"),
    ("update june_sessions s set lease_owner = null", "worker/queue.py SessionQueue.release"),
    ("select coalesce(json_agg(body", "stores/postgres.py events (outbox relay)"),
    ("select s.generation", "stores/postgres.py load (transcript)"),
    ("with upd as", "stores/postgres.py commit (a step's checkpoint)"),
]


def name_sql(query: Any) -> str:
    text = " ".join((query if isinstance(query, str) else repr(query)).split())
    for prefix, name in NAMES:
        if text.startswith(prefix):
            return f"pg: {name}"
    return f"pg: {text[:60]}"


class Meter:
    """Counts and times round trips by name while installed."""

    def __init__(self) -> None:
        self.count: collections.Counter[str] = collections.Counter()
        self.wall: collections.Counter[str] = collections.Counter()
        self._undo: list[Callable[[], None]] = []

    def _wrap(self, owner: Any, attr: str, name: Callable[..., str]) -> None:
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            key = name(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.wall[key] += time.perf_counter() - t0
                self.count[key] += 1

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original))

    def install(self) -> None:
        self._wrap(psycopg.Cursor, "execute", lambda cur, query, *a, **k: name_sql(query))
        # the worker's sink is pipelined: it sends without waiting and reads the replies at the next publish
        self._wrap(
            RedisStreamSink, "_send", lambda sink, cmds, ref: "redis: pipelined send " + ",".join(c[0] for c in cmds)
        )
        self._wrap(RedisStreamSink, "_read_unread", lambda sink, keep=0: "redis: pipelined replies read (owed)")
        self._wrap(redis.Redis, "execute_command", lambda client, *args, **k: f"redis: {args[0]}")
        self._wrap(
            redis.client.Pipeline,
            "execute",
            lambda pipe, *a, **k: "redis: pipeline " + ",".join(str(c[0][0]) for c in pipe.command_stack),
        )

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def clear(self) -> None:
        self.count.clear()
        self.wall.clear()


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 turns")
    parser.add_argument("-n", type=int, default=300, help="turns measured")
    args = parser.parse_args()
    if args.quick:
        args.n = 60
    print(f"# turn_cost.py  {machine()}  {args.n} turns of the bench agent, each in a new session", flush=True)
    meter = Meter()
    with sigterm_as_exit(), BenchStack("turn-cost") as stack:
        host = WorkerHost(WorkerSettings.from_env(stack.env), agents={a.name: a for a in ALL()})
        try:

            def turn(label: str) -> dict[str, Any]:
                payload = {"turn_id": f"t_{uuid.uuid4().hex}", "agent": "bench", "session": stack.session(label)}
                return control.intake(host, TurnMessage.model_validate({**payload, "text": "go"}))

            for i in range(20):  # warm-up: pool connections, prepared statements, the script cache
                turn(f"warm-{i}")
            meter.install()
            c0, t0 = cpu_s(), time.perf_counter()
            for i in range(args.n):
                out = turn(f"t{i}")
                assert out["status"] == "completed", out
            wall_ms = (time.perf_counter() - t0) * 1000 / args.n
            cpu_ms = (cpu_s() - c0) * 1000 / args.n
            totals = dict(meter.wall)
            counts = dict(meter.count)
            meter.clear()
            pings, selects = [], []
            with host.store.pool.connection() as conn:
                for _ in range(200):
                    p0 = time.perf_counter()
                    host.redis.ping()
                    p1 = time.perf_counter()
                    conn.execute("select 1").fetchone()
                    pings.append(p1 - p0)
                    selects.append(time.perf_counter() - p1)
        finally:
            meter.uninstall()
            logging.getLogger("june_worker.worker").setLevel(logging.ERROR)  # its listener thread minds the close
            host.close()
    print("| round trip (sent by)                                              | per turn | ms per turn |")
    print("|-------------------------------------------------------------------|---------:|------------:|")
    io_ms = 0.0
    for key in sorted(totals, key=lambda k: -totals[k]):
        ms = totals[key] * 1000 / args.n
        io_ms += ms
        print(f"| {key:<65} | {counts[key] / args.n:8.2f} | {ms:11.3f} |")
    trips = sum(counts.values()) / args.n
    print(f"| {'all of the above':<65} | {trips:8.2f} | {io_ms:11.3f} |")
    print(f"| {'the rest: engine, pydantic, event loop, host':<65} |          | {wall_ms - io_ms:11.3f} |")
    print(f"| {'a whole turn (wall)':<65} |          | {wall_ms:11.3f} |")
    print(
        f"(CPU of this process per turn: {cpu_ms:.2f} ms; in the same run a bare `select 1` took "
        f"{median(selects) * 1000:.3f} ms and a PING {median(pings) * 1000:.3f} ms, medians)"
    )


if __name__ == "__main__":
    main()
