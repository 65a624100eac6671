"""Where a turn's time goes in the worker host, without Celery: every round trip of ``june.turn``'s work, by statement.

    .venv/bin/python bench/turn_cost.py [--quick] [-n 300] [--partitions 0,16] [--rounds 5]

A whole turn on sessions that already hold a long history is measured by ``bench/history_cost.py``.

Runs :func:`june_worker.worker.control.intake` (what the ``june.turn`` task calls) in this
process, on a :class:`~june_worker.worker.host.WorkerHost` over a throwaway database
``june_bench_<random>`` of ``JUNE_DATABASE_URL`` and ``JUNE_REDIS_URL`` under a unique key prefix
(both removed at the end), for ``-n`` turns of the ``bench`` agent (model, sync tool, model),
each in a new session. Every Postgres statement (``psycopg.Cursor.execute``) and every Redis
command or pipeline the turn sends is counted and timed (wall clock, from the call to its
return) and named after the code that sends it. What no round trip explains (the engine,
pydantic, the event loop) is the remainder. Next to it: a bare ``select 1`` and a PING, timed
in the same run, as the price of one round trip on this machine, and the CPU the Postgres backends
serving the host used per turn (``/proc``, so the server must run on this machine), and redis-server's
(``INFO cpu``: the events only, no broker here; shared with whatever else uses that Redis), and the WAL the
server wrote per turn (``pg_current_wal_insert_lsn``: the whole cluster's, so run it on a quiet server).

``--partitions 0,16`` measures the same turns on two databases, one with the per-session tables
hash-partitioned into 16 (``june migrate --partitions 16``), their turns alternating in rounds.

The rule a reader must not break: these figures are one process with nothing else to do; the
Celery task adds its own costs around them (see ``bench/throughput.py``).
"""

from __future__ import annotations

import argparse
import collections
import logging
import resource
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
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
    ("select r.recorded", "worker/queue.py SessionQueue.intake (turn + lease + new messages)"),
    (
        "select s.generation, s.status, s.suspended::text, s.event_seq, s.reset_pending, s.park_expires_at, tr",
        "worker/queue.py SessionQueue.read (new messages)",
    ),
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
        turns = threading.current_thread()  # the turns' thread: other threads' calls (samplers, heartbeats) not counted

        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not turns:
                return original(*args, **kwargs)
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
            RedisStreamSink, "_send", lambda sink, cmds, ref: "redis: pipelined send " + ",".join(c[0] for _, c in cmds)
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
    parser.add_argument("-n", type=int, default=300, help="turns measured (per schema)")
    parser.add_argument(
        "--partitions",
        default="0",
        help="comma-separated partition counts of the per-session tables, each on a database of its own, their turns "
        "alternating in rounds (0: not partitioned; e.g. 0,16)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds the turns of each schema are split into")
    args = parser.parse_args()
    if args.quick:
        args.n, args.rounds = 60, 2
    counts_of = [int(p) for p in args.partitions.split(",")]
    per_round = max(1, args.n // args.rounds)
    print(
        f"# turn_cost.py  {machine()}  {per_round * args.rounds} turns of the bench agent per schema, each in a new "
        f"session, schemas {counts_of} alternating over {args.rounds} rounds",
        flush=True,
    )
    with sigterm_as_exit(), ExitStack() as stacks:
        runs = [Run(stacks.enter_context(BenchStack("turn-cost", partitions=p)), p) for p in counts_of]
        try:
            for run in runs:
                run.start()
            for r in range(args.rounds):
                for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
                    run.measure(r, per_round)
            for run in runs:
                run.baseline()
        finally:
            for run in runs:
                run.close()
    for run in runs:
        run.report()


class Run:
    """One schema's stack, host and figures."""

    def __init__(self, stack: BenchStack, partitions: int) -> None:
        self.stack = stack
        self.partitions = partitions
        self.meter = Meter()
        self.host: WorkerHost | None = None
        self.turns = 0
        self.wall_s = self.cpu_s = self.pg_s = self.redis_s = 0.0
        self.wal_bytes = 0
        self.totals: collections.Counter[str] = collections.Counter()
        self.counts: collections.Counter[str] = collections.Counter()
        self.pings: list[float] = []
        self.selects: list[float] = []

    def start(self) -> None:
        self.host = WorkerHost(WorkerSettings.from_env(self.stack.env), agents={a.name: a for a in ALL()})
        for i in range(20):  # warm-up: pool connections, prepared statements, the script cache
            self.turn(f"warm-{i}")

    def turn(self, label: str) -> dict[str, Any]:
        assert self.host is not None
        payload = {"turn_id": f"t_{uuid.uuid4().hex}", "agent": "bench", "session": self.stack.session(label)}
        return control.intake(self.host, TurnMessage.model_validate({**payload, "text": "go"}))

    def measure(self, r: int, n: int) -> None:
        with self.stack.postgres_cpu() as pg:  # its statements and INFO are the bench's, sent before the meter is on
            r0 = self.stack.redis_cpu_s()
            w0 = self._wal_lsn()
            self.meter.install()
            try:
                c0, t0 = cpu_s(), time.perf_counter()
                for i in range(n):
                    out = self.turn(f"r{r}-{i}")
                    assert out["status"] == "completed", out
                self.wall_s += time.perf_counter() - t0
                self.cpu_s += cpu_s() - c0
            finally:
                self.meter.uninstall()
            self.redis_s += self.stack.redis_cpu_s() - r0
            self.wal_bytes += self._wal_lsn() - w0
        self.pg_s += pg.clients_s
        self.turns += n
        self.totals.update(self.meter.wall)
        self.counts.update(self.meter.count)
        self.meter.clear()

    def _wal_lsn(self) -> int:
        """Where the server's WAL is (bytes; the whole cluster's, so shared with whatever else writes to it)."""
        assert self.host is not None
        with self.host.store.pool.connection() as conn:
            row = conn.execute("select pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint").fetchone()
        assert row is not None
        return int(row[0])

    def baseline(self) -> None:
        assert self.host is not None
        with self.host.store.pool.connection() as conn:
            for _ in range(200):
                p0 = time.perf_counter()
                self.host.redis.ping()
                p1 = time.perf_counter()
                conn.execute("select 1").fetchone()
                self.pings.append(p1 - p0)
                self.selects.append(time.perf_counter() - p1)

    def close(self) -> None:
        if self.host is not None:
            logging.getLogger("june_worker.worker").setLevel(logging.ERROR)  # its listener thread minds the close
            self.host.close()
            self.host = None

    def report(self) -> None:
        n = self.turns
        schema = f"{self.partitions} hash partitions per table" if self.partitions else "tables not partitioned"
        print(f"\n## {schema}")
        print("| round trip (sent by)                                              | per turn | ms per turn |")
        print("|-------------------------------------------------------------------|---------:|------------:|")
        io_ms = 0.0
        for key in sorted(self.totals, key=lambda k: -self.totals[k]):
            ms = self.totals[key] * 1000 / n
            io_ms += ms
            print(f"| {key:<65} | {self.counts[key] / n:8.2f} | {ms:11.3f} |")
        wall_ms = self.wall_s * 1000 / n
        trips = sum(self.counts.values()) / n
        print(f"| {'all of the above':<65} | {trips:8.2f} | {io_ms:11.3f} |")
        print(f"| {'the rest: engine, pydantic, event loop, host':<65} |          | {wall_ms - io_ms:11.3f} |")
        print(f"| {'a whole turn (wall)':<65} |          | {wall_ms:11.3f} |")
        print(
            f"(CPU per turn: this process {self.cpu_s * 1000 / n:.2f} ms, the Postgres backends serving it "
            f"{self.pg_s * 1000 / n:.2f} ms, redis-server {self.redis_s * 1000 / n:.2f} ms (shared with whatever else "
            f"uses it); WAL {self.wal_bytes / n / 1024:.1f} KB per turn (the cluster's); in the same run a bare `select 1` took {median(self.selects) * 1000:.3f} "
            f"ms and a PING {median(self.pings) * 1000:.3f} ms, medians)"
        )


if __name__ == "__main__":
    main()
