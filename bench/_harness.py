"""What the worker benches share: a throwaway database, real ``celery -A june_worker`` processes, cleanup.

A :class:`BenchStack` owns everything it makes and removes all of it on exit (also on Ctrl-C,
SIGTERM or an exception): its database ``june_bench_<random>`` on ``JUNE_DATABASE_URL``
(dropped), its queues, Redis key prefix and task results on ``JUNE_REDIS_URL`` (deleted), and
the processes it started, each in a process group of its own, stopped by that group's id and
nothing else. Workers run the bench agents (``JUNE_AGENTS=bench.agents:ALL``) with
``-I bench.tasks`` (the ``bench.empty`` baseline task) at ``-l WARNING``.

The broker is Redis (``JUNE_REDIS_URL``) or, with ``broker="amqp"``, RabbitMQ at
``JUNE_BENCH_AMQP_URL`` (default ``amqp://guest:guest@127.0.0.1:5672//``): the stack's own
queues are declared as the workers declare them (quorum) and deleted at the end.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import redis
from celery import Celery

from june_worker.stores import PostgresStore
from june_worker.worker.broker import celery_options, publish_options
from june_worker.worker.settings import WorkerSettings
from producers import JuneProducer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DB = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672//"
T = TypeVar("T")

# kombu's Redis transport: a queue is a list named after it (priority 0), bound in this set.
_BINDINGS = ("_kombu.binding.{}", "_kombu.binding_permanent.{}")
_PRIORITY_SEP = "\x06\x16"
# Atomically move every message of one list to another, oldest first stays oldest first.
MOVE_LUA = """
local n = 0
while redis.call('RPOPLPUSH', KEYS[1], KEYS[2]) do n = n + 1 end
return n
"""


def pct(values: Iterable[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


@contextmanager
def throwaway_database(prefix: str = "june_bench") -> Iterator[str]:
    """A database of its own on ``JUNE_DATABASE_URL`` (``<prefix>_<random>``), dropped on the way out; its URL."""
    base = os.environ.get("JUNE_DATABASE_URL", DEFAULT_DB)
    name = f"{prefix}_{secrets.token_hex(4)}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'create database "{name}"')
    try:
        yield psycopg.conninfo.make_conninfo(base, dbname=name)
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'drop database if exists "{name}" with (force)')


def repeated_events(events: Iterable[dict[str, Any]]) -> list[str]:
    """What a session stream's structural events (decoded entries, in order) tell more than once, by meaning, not seq:
    per turn one ``turn.started`` (and one per resume, by its request), one terminal event (``turn.completed``,
    ``turn.failed``, ``turn.cancelled``), each message by its step, each action requested and completed by its
    step and call, each input requested and answered by its id. Two commits of the same event carry two seqs, so a
    check of seqs alone would not see them. Returns a line per repeat (empty: none)."""
    seen: dict[tuple[Any, ...], int] = {}
    for e in events:
        kind, turn = e["type"], e["turn_id"]
        if kind == "turn.started":
            trigger = e.get("trigger") or {}
            key: tuple[Any, ...] = (
                (kind, trigger.get("call_id"), trigger.get("input_id")) if trigger.get("kind") == "resume" else (kind,)
            )
        elif kind in ("turn.completed", "turn.failed", "turn.cancelled"):
            key = ("terminal",)
        elif kind == "message.completed":
            key = (kind, e.get("step"))
        elif kind in ("action.requested", "action.completed"):
            key = (kind, e.get("step"), (e.get("call") or {}).get("id"))
        elif kind == "input.requested":
            key = (kind, (e.get("request") or {}).get("id"))
        elif kind == "input.answered":
            key = (kind, e.get("input_id"))
        else:
            continue
        seen[(turn, *key)] = seen.get((turn, *key), 0) + 1
    return [f"{' '.join(str(k) for k in key if k is not None)}: {n} times" for key, n in seen.items() if n > 1]


def machine() -> str:
    return f"{time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {os.cpu_count()} CPUs  python {platform.python_version()}"


def wait_for(predicate: Callable[[], T], *, timeout_s: float, every_s: float = 0.05, what: str) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a live process has used; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` of this machine (from /proc; root sees every process)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            if os.readlink(fd) in inodes:
                return int(fd.split("/")[2])
        except OSError:
            continue
    return None


def machine_busy_s() -> float:
    """CPU seconds all CPUs of the machine spent busy (not idle, not waiting on I/O) since boot."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C does, so that every ``finally`` (process stops, cleanup) runs."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class PostgresCpu:
    """CPU seconds the Postgres processes of one database used while the ``with`` block ran, apart by kind.

    A thread lists the database's processes (``pg_stat_activity``) every ``every_s`` and reads each
    one's CPU from ``/proc`` when first and last seen, so connections opened during the block are
    counted (from their first sighting) and so are autovacuum workers, which come and go: their CPU
    is the tables' upkeep, not the statements', and is kept apart (``autovacuum_s``) instead of
    landing on whichever batch happened to see one start. Needs the server on this machine.
    """

    def __init__(self, db_url: str, *, exclude: int | None = None, every_s: float = 0.05) -> None:
        self._url = db_url
        self._exclude = exclude
        self._every_s = every_s
        self._seen: dict[int, tuple[str, float, float]] = {}  # pid -> (kind, CPU first seen, CPU last seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-cpu", daemon=True)
        self._conn: psycopg.Connection[Any] | None = None

    def __enter__(self) -> PostgresCpu:
        self._conn = psycopg.connect(self._url, autocommit=True)
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        assert self._conn is not None
        self._conn.close()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self._sample()

    def _sample(self) -> None:
        assert self._conn is not None
        rows = self._conn.execute(
            "select pid, backend_type from pg_stat_activity where datname = current_database() "
            "and pid <> pg_backend_pid()"
        ).fetchall()
        for pid, kind in rows:
            if pid == self._exclude:
                continue
            now = cpu_s(pid)
            if now == 0.0:
                continue  # gone meanwhile
            first = self._seen.get(pid, (kind, now, now))[1]
            self._seen[pid] = (kind, first, now)

    def _total(self, autovacuum: bool) -> float:
        return sum(
            last - first for kind, first, last in self._seen.values() if (kind == "autovacuum worker") == autovacuum
        )

    @property
    def clients_s(self) -> float:
        """CPU of the client backends: the connections of the workers (and of the bench's own queries)."""
        return self._total(False)

    @property
    def autovacuum_s(self) -> float:
        """CPU of autovacuum workers on this database."""
        return self._total(True)


class Proc:
    """A process the bench started, in its own session (its pid is its process group's id)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.nodename = ""
        self.log = log
        self._out = log.open("ab")
        self.popen = subprocess.Popen(
            args, env=env, cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (the worker and its pool children): the machine died."""
        if self.alive():
            os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.alive():
            try:
                os.killpg(self.pid, signal.SIGTERM)
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(10)
        else:
            # the group leader is gone; its children (same group) may not be
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._out.close()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-n:])


class BenchStack:
    """One bench's database, names, processes and Redis keys. Use as a context manager."""

    def __init__(
        self, name: str, *, env: dict[str, str] | None = None, broker: str = "redis", partitions: int = 0
    ) -> None:
        self.tag = f"jb{secrets.token_hex(4)}"
        self.name = name
        self.admin_url = os.environ.get("JUNE_DATABASE_URL", DEFAULT_DB)
        self.redis_url = os.environ.get("JUNE_REDIS_URL", DEFAULT_REDIS)
        self.broker = broker
        self.partitions = partitions  # > 0: the per-session tables hash-partitioned (june migrate --partitions N)
        self.broker_url = self.redis_url if broker == "redis" else os.environ.get("JUNE_BENCH_AMQP_URL", DEFAULT_AMQP)
        self.dbname = f"june_bench_{self.tag[2:]}"
        self.db_url = psycopg.conninfo.make_conninfo(self.admin_url, dbname=self.dbname)
        self.queue = f"june-bench-{self.tag}"
        self.control_queue = f"{self.queue}.control"
        self.staging_queue = f"{self.queue}.staging"
        self.prefix = f"june-bench-{self.tag}"
        self.tmp = Path(tempfile.mkdtemp(prefix=f"june-bench-{name}-"))
        self.procs: list[Proc] = []
        self.sent: list[str] = []  # task ids whose results this bench forgets at the end
        self._db_made = False
        self._conn: psycopg.Connection[Any] | None = None
        self._producer: JuneProducer | None = None
        self._durable: JuneProducer | None = None
        base = {k: v for k, v in os.environ.items() if not k.startswith(("JUNE_", "CELERY_"))}
        self.env = {
            **base,
            "PYTHONPATH": str(ROOT),
            "JUNE_DATABASE_URL": self.db_url,
            "JUNE_REDIS_URL": self.redis_url,
            "CELERY_BROKER_URL": self.broker_url,
            "CELERY_RESULT_BACKEND": self.redis_url,
            "JUNE_AGENTS": "bench.agents:ALL",
            "JUNE_QUEUE": self.queue,
            "JUNE_CONTROL_QUEUE": self.control_queue,
            "JUNE_KEY_PREFIX": self.prefix,
            **(env or {}),
        }
        self.redis = redis.Redis.from_url(self.redis_url, decode_responses=True)
        self.settings = WorkerSettings.from_env(self.env)
        # Like JuneProducer: messages that are not waited for go through an app without a result
        # backend (one with a backend subscribes to every task's result channel as it sends).
        self.sender = self._celery("sender", None)
        self.client = self._celery("client", self.redis_url)

    def _celery(self, name: str, backend: str | None) -> Celery:
        app = Celery(f"{self.tag}-{name}", broker=self.broker_url, backend=backend, set_as_current=False)
        app.conf.update(
            **celery_options(self.settings),  # the queues as the workers declare them; confirms on RabbitMQ
            task_serializer="json",
            result_serializer="json",
            accept_content=["json"],
            result_accept_content=["json"],
            task_default_queue=self.queue,
        )
        return app

    # --- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> BenchStack:
        try:
            with psycopg.connect(self.admin_url, autocommit=True) as admin:
                admin.execute(f'create database "{self.dbname}"')
            self._db_made = True
            store = PostgresStore(self.db_url, min_size=1, max_size=1)  # the schema, before any worker races for it
            try:
                if self.partitions:
                    store.partition(self.partitions)
            finally:
                store.close()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the processes, delete the keys, drop the database; a second Ctrl-C or SIGTERM does not cut it short."""
        ignored = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._close()
        finally:
            for sig, handler in ignored.items():
                signal.signal(sig, handler)

    def _close(self) -> None:
        for proc in self.procs:
            try:
                proc.stop()
            except Exception as exc:  # keep stopping the others
                print(f"# could not stop {proc.name} (pid {proc.pid}): {exc}", file=sys.stderr)
        self.procs.clear()
        try:
            self._clean_redis()
            if self.broker == "amqp":
                self._delete_queues()
        finally:
            for producer in (self._producer, self._durable):
                if producer is not None:
                    producer.close()
            if self._conn is not None:
                self._conn.close()
            if self._db_made:
                with psycopg.connect(self.admin_url, autocommit=True) as admin:
                    admin.execute(f'drop database if exists "{self.dbname}" with (force)')
                self._db_made = False
            self.sender.close()
            self.client.close()
            self.redis.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _clean_redis(self) -> None:
        r = self.redis
        doomed: list[str] = list(r.scan_iter(match=f"{self.prefix}:*", count=1000))
        for q in (self.queue, self.control_queue, self.staging_queue):
            doomed += [q, *(b.format(q) for b in _BINDINGS), *(f"{q}{_PRIORITY_SEP}{p}" for p in range(1, 10))]
        doomed += [f"celery-task-meta-{tid}" for tid in self.sent]
        # results of turns the workers sent themselves (the sweeper's re-sends) name our sessions
        for key in r.scan_iter(match="celery-task-meta-*", count=1000):
            value = r.get(key)
            if value and f'"{self.tag}-' in value:
                doomed.append(key)
        for start in range(0, len(doomed), 500):
            r.delete(*doomed[start : start + 500])
        # messages a killed worker had taken stay in kombu's shared 'unacked' hash: drop ours only
        ours = {self.queue, self.control_queue, self.staging_queue}
        for tag, raw in r.hscan_iter("unacked", count=1000):
            try:
                _, exchange, routing_key = json.loads(raw)
            except (ValueError, TypeError):
                continue
            if exchange in ours or routing_key in ours:
                r.hdel("unacked", tag)
                r.zrem("unacked_index", tag)
        for key in ("_kombu.binding.celery.pidbox", "_kombu.binding.reply.celery.pidbox"):
            members = [m for m in r.smembers(key) if self.tag in m]
            if members:
                r.srem(key, *members)

    def _delete_queues(self) -> None:
        with self.sender.connection_for_write() as conn:
            channel = conn.default_channel
            for q in (self.queue, self.control_queue):
                channel.queue_delete(q)

    # --- processes ---------------------------------------------------------------------------------

    def worker(
        self,
        name: str,
        *,
        pool: str = "prefork",
        concurrency: int = 1,
        queues: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        # pool "threads": many turns in one process (``june worker --turns-per-process``), under june's supervisor,
        # whose children are then this worker's processes (the turns' process and the isolation worker)
        start = (
            [sys.executable, "-m", "june_worker.cli", "worker", "--turns-per-process", str(concurrency)]
            if pool == "threads"
            else [sys.executable, "-m", "celery", "-A", "june_worker", "worker", "-P", pool, "-c", str(concurrency)]
        )
        args = [
            *start, "-I", "bench.tasks", "-n", f"{self.tag}-{name}@%h",
            "-Q", queues or f"{self.queue},{self.control_queue}",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
        ]  # fmt: skip
        proc = Proc(name, args, {**self.env, **(env or {})}, self.tmp / f"{name}.log")
        proc.nodename = f"{self.tag}-{name}@{platform.node()}"
        self.procs.append(proc)
        return proc

    def wait_ready(self, *procs: Proc, timeout_s: float = 60) -> None:
        for proc in procs:

            def ready(proc: Proc = proc) -> bool:
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
                return "bench worker ready" in proc.text()

            wait_for(ready, timeout_s=timeout_s, what=f"worker {proc.name}")

    def beat(self, env: dict[str, str] | None = None) -> Proc:
        args = [
            sys.executable, "-m", "celery", "-A", "june_worker", "beat", "-l", "INFO",
            "-s", str(self.tmp / f"beat-{uuid.uuid4().hex[:6]}"), "--pidfile=",
        ]  # fmt: skip
        proc = Proc("beat", args, {**self.env, **(env or {})}, self.tmp / "beat.log")
        self.procs.append(proc)
        wait_for(lambda: "beat: Starting" in proc.text(), timeout_s=30, what="beat")
        return proc

    def stop(self, proc: Proc) -> None:
        proc.stop()
        self.procs.remove(proc)

    @property
    def producer(self) -> JuneProducer:
        """A producer client for this stack's queues and streams, as another service would use it."""
        if self._producer is None:
            self._producer = JuneProducer(
                self.redis_url, broker_url=self.broker_url, queue=self.queue, control_queue=self.control_queue,
                key_prefix=self.prefix,
            )  # fmt: skip
        return self._producer

    def durable_producer(self) -> JuneProducer:
        """A producer that records each turn in this stack's Postgres before it sends it (``durable=True``)."""
        if self._durable is None:
            self._durable = JuneProducer(
                self.redis_url, broker_url=self.broker_url, queue=self.queue, control_queue=self.control_queue,
                key_prefix=self.prefix, database_url=self.db_url, durable=True,
            )  # fmt: skip
        return self._durable

    # --- messages and rows -------------------------------------------------------------------------

    def send(
        self, task: str, payload: dict[str, Any], *, queue: str | None = None, wait: bool = False, **options: Any
    ) -> Any:
        """Send a task by name; ``wait``: through the app with a result backend, to read its result."""
        task_id = options.pop("task_id", None) or str(uuid.uuid4())
        self.sent.append(task_id)
        options = {**publish_options(self.settings), **options}
        return (self.client if wait else self.sender).send_task(
            task, args=[payload], queue=queue or self.queue, task_id=task_id, kwargsrepr="", **options
        )

    def turn(self, agent: str, session: str, text: str = "go", *, queue: str | None = None, **options: Any) -> str:
        turn_id = f"t_{uuid.uuid4().hex}"
        payload = {"turn_id": turn_id, "agent": agent, "session": session, "text": text}
        self.send("june.turn", payload, queue=queue, argsrepr=f"{{{agent} {session} {turn_id}}}", **options)
        return turn_id

    def session(self, label: str) -> str:
        return f"{self.tag}-{label}"

    def stream_key(self, agent: str, session: str) -> str:
        return f"{self.prefix}:events:{{{agent}:{session}}}"

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        """Run one statement on the bench's own connection (kept open: a connection per poll would cost the
        server a process start each time, and land in the Postgres CPU the bench measures)."""
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.db_url, autocommit=True)
        cur = self._conn.execute(query, params)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []

    @property
    def own_pid(self) -> int | None:
        """The server process of the bench's own connection (:meth:`sql`), if open: not one of the workers'."""
        return None if self._conn is None or self._conn.closed else self._conn.info.backend_pid

    def worker_pids(self) -> list[int]:
        """Every live process of this stack's workers: each worker's main process and its pool."""
        return [p for proc in self.procs if proc.alive() for p in (proc.pid, *children(proc.pid))]

    def backend_pids(self) -> list[int]:
        """The client backends serving this stack's database (other than the asking one): its workers' connections."""
        rows = self.sql(
            "select pid from pg_stat_activity where datname = current_database() and pid <> pg_backend_pid() "
            "and backend_type = 'client backend'"
        )
        return [int(r[0]) for r in rows]

    def postgres_cpu(self) -> PostgresCpu:
        """A sampler of this database's Postgres processes' CPU: use ``with stack.postgres_cpu() as pg:`` around
        what you measure, then read ``pg.clients_s`` and ``pg.autovacuum_s``."""
        self.sql("select 1")  # open the bench's own connection now, so that the sampler knows to leave it out
        return PostgresCpu(self.db_url, exclude=self.own_pid)

    def redis_cpu_s(self) -> float:
        info = self.redis.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def broker_cpu_s(self) -> float:
        """CPU seconds of the broker's server process: redis-server, or RabbitMQ's node (beam)."""
        if self.broker == "redis":
            return self.redis_cpu_s()
        port = int(self.broker_url.split("@")[-1].split("/")[0].rsplit(":", 1)[1])
        pid = listener_pid(port)
        return cpu_s(pid) if pid is not None else 0.0

    def consume(self, queue: str, on: bool) -> None:
        """Make this stack's workers (and no one else's) start or stop consuming ``queue``."""
        names = [p.nodename for p in self.procs if p.nodename and p.alive()]
        control = self.client.control
        call = control.add_consumer if on else control.cancel_consumer
        replies = call(queue, destination=names, reply=True, timeout=10)
        if len(replies) != len(names):
            raise RuntimeError(f"{'add' if on else 'cancel'}_consumer({queue}): {len(replies)} of {len(names)} replied")

    def forget(self, task_ids: Iterable[str]) -> None:
        keys = [f"celery-task-meta-{t}" for t in task_ids]
        for start in range(0, len(keys), 500):
            self.redis.delete(*keys[start : start + 500])
