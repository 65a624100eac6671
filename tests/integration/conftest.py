"""Real Celery worker processes over real Postgres and Redis, started by the tests.

Each test module gets its own database and its own queue names and Redis key prefix, so
modules never see each other's messages or streams. Workers start once per module (fixture
``stack``) with short leases and sweep periods; a test that kills a worker starts its own.

The broker is Redis unless a test (or its module) is marked ``@pytest.mark.brokers("redis",
"amqp")``: it then runs once per broker, on a stack per broker (``amqp``: RabbitMQ, from
``tests._services``). Events and results stay on Redis either way.

Workers run one turn per process (``prefork``) unless a test (or its module) is marked
``@pytest.mark.modes("prefork", "threads")``: it then runs once per mode, the ``threads`` stack's
workers running many turns in one process (``-P threads``, ``june worker --turns-per-process``).
``JUNE_IT_MODE=threads`` runs every stack that is not parametrized in the threads mode.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from june_wire.redis_url import connect
from tests._budgets import PROCESS_START_S

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], *, timeout_s: float = 20.0, every_s: float = 0.02, what: str = "") -> T:
    """Poll until ``predicate`` returns something truthy; fail with ``what`` on timeout. Not a sleep."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(every_s)


BROKERS = ("redis", "amqp")
MODES = ("prefork", "threads")


def _marked(metafunc: pytest.Metafunc, name: str, allowed: tuple[str, ...]) -> tuple[str, ...] | None:
    marker = metafunc.definition.get_closest_marker(name)
    if marker is None:
        return None
    if set(marker.args) - set(allowed) or not marker.args:
        raise pytest.UsageError(f"@pytest.mark.{name} takes some of {allowed}, not {marker.args}")
    return tuple(marker.args)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.brokers(...)`` / ``@pytest.mark.modes(...)``: run the test once per broker and worker mode,
    each on its own module-wide stack (ids ``redis``, ``amqp``; ``redis-threads`` for a mode other than prefork)."""
    if "stack" not in metafunc.fixturenames:
        return
    brokers, modes = _marked(metafunc, "brokers", BROKERS), _marked(metafunc, "modes", MODES)
    if brokers is None and modes is None:
        return
    params = [(b, m) for b in brokers or ("redis",) for m in modes or (_default_mode(),)]
    ids = [b if m == "prefork" else f"{b}-{m}" for b, m in params]
    metafunc.parametrize("stack", params, ids=ids, indirect=True, scope="module")


def _default_mode() -> str:
    mode = os.environ.get("JUNE_IT_MODE", "prefork")
    if mode not in MODES:
        raise pytest.UsageError(f"JUNE_IT_MODE={mode!r}: expected one of {MODES}")
    return mode


def _admin_url(url: str, dbname: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    info["dbname"] = dbname
    return psycopg.conninfo.make_conninfo(**info)


def _database(database_url: str) -> Iterator[str]:
    """A new database on the test server for as long as the generator runs, dropped afterwards."""
    name = f"june_it_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'create database "{name}"')
    try:
        yield _admin_url(database_url, name)
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'drop database if exists "{name}" with (force)')


@pytest.fixture(params=["redis", "cluster"])
def events_url(request: pytest.FixtureRequest, redis_url: str) -> str:
    """Where events live: one Redis, or a three-node Redis Cluster of this run's own (``redis+cluster://``); a test
    that takes it runs on both, and the sink and the readers keep the same rules on each."""
    return str(request.getfixturevalue("redis_cluster_url")) if request.param == "cluster" else redis_url


@pytest.fixture(scope="module")
def fresh_db(database_url: str) -> Iterator[str]:
    """A database of this module's own on the test server, dropped afterwards."""
    yield from _database(database_url)


class Proc:
    """A process a test started (worker or beat), in its own process group so it can be killed whole."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        self._out = log.open("ab")
        self.popen = subprocess.Popen(
            args, env=env, cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def children(self) -> list[int]:
        path = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def kill(self) -> None:
        """SIGKILL the whole process group: the machine died."""
        if self.popen.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(10)
        self._out.close()

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


class Stack:
    """Workers, beat, a broker client and the database of one test module."""

    def __init__(
        self,
        db_url: str,
        redis_url: str,
        tmp: Path,
        broker_url: str | None = None,
        events_url: str | None = None,
        mode: str | None = None,
    ) -> None:
        tag = uuid.uuid4().hex[:8]
        self.mode = mode or _default_mode()
        """How its workers run turns: ``prefork`` (one per process) or ``threads`` (many in one process)."""
        self.db_url = db_url
        self.redis_url = redis_url  # the result backend, and the broker unless broker_url
        self.events_url = events_url or redis_url  # the streams and control channels (JUNE_REDIS_URL): maybe a cluster
        self.broker_url = broker_url or redis_url
        self.broker = "amqp" if self.broker_url.startswith("amqp") else "redis"
        self.tmp = tmp
        self.queue = f"june-it-{tag}"
        self.control_queue = f"june-it-{tag}.control"
        self.prefix = f"june-it-{tag}"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "JUNE_DATABASE_URL": db_url,
            "JUNE_REDIS_URL": self.events_url,
            "CELERY_BROKER_URL": self.broker_url,
            "CELERY_RESULT_BACKEND": redis_url,
            "JUNE_AGENTS": "tests.integration.agents:ALL",
            "JUNE_QUEUE": self.queue,
            "JUNE_CONTROL_QUEUE": self.control_queue,
            "JUNE_KEY_PREFIX": self.prefix,
            "JUNE_LEASE_S": "2",
            "JUNE_ALIVE_S": "1",
            "JUNE_SWEEP_S": "0.5",
            "JUNE_ENABLE_TEST_HOOKS": "1",
            "JUNE_IT_DELTAS": "2000",
        }
        self.procs: list[Proc] = []
        self.redis: Any = connect(self.events_url, decode_responses=True)
        from celery import Celery

        from june_worker.worker.broker import celery_options
        from june_worker.worker.settings import WorkerSettings

        # The queues, confirms and publish timeouts a worker with this environment declares and uses.
        self.settings = WorkerSettings.from_env(self.env)
        self.client = Celery("june-it-client", broker=self.broker_url, backend=redis_url)
        self.client.conf.update(
            **celery_options(self.settings),
            task_serializer="json",
            accept_content=["json"],
            result_accept_content=["json"],
            task_routes={
                "june.resume": {"queue": self.control_queue},
                "june.cancel": {"queue": self.control_queue},
                "june.reset": {"queue": self.control_queue},
                "june.sweep": {"queue": self.control_queue},
            },
            task_default_queue=self.queue,
        )

    # --- processes ---------------------------------------------------------------------------

    def worker(
        self,
        name: str,
        *,
        pool: str | None = None,
        concurrency: int = 1,
        queues: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """A worker on ``pool``; by default the stack's mode's: prefork, or many turns in one process (threads)."""
        if pool is None and self.mode == "threads":
            # the same turns in flight, in one process, under june's supervisor (it starts the process again if it
            # dies, as a prefork worker starts a pool process again): its child is the worker's "pool process"
            start = [sys.executable, "-m", "june_worker.cli", "worker", "--turns-per-process", str(concurrency)]
        else:
            pool = pool or "prefork"
            start = [sys.executable, "-m", "celery", "-A", "june_worker", "worker", "-P", pool, "-c", str(concurrency)]
        args = [
            *start, "-n", f"{name}@%h", "-Q", queues or f"{self.queue},{self.control_queue}",
            "--without-gossip", "--without-mingle", "-l", "INFO",
        ]  # fmt: skip
        if self.broker == "redis":
            # On RabbitMQ the worker's event loop sleeps up to 10 s when idle, and a SIGTERM does not wake
            # it; the worker-heartbeat event (every 2 s) does, so an idle worker stops quickly.
            args.append("--without-heartbeat")
        proc = Proc(name, args, {**self.env, **(env or {})}, self.tmp / f"{name}.log")
        self.procs.append(proc)
        self._wait_ready(proc)
        return proc

    def _wait_ready(self, proc: Proc) -> None:
        def ready() -> bool:
            if "ready." in proc.log.read_text(errors="replace"):
                return True  # it started; a test's crash hook may have taken it down already
            if proc.popen.poll() is not None:
                raise AssertionError(f"worker {proc.name} exited:\n{proc.tail()}")
            return False

        wait_for(ready, timeout_s=PROCESS_START_S, every_s=0.1, what=f"worker {proc.name} to be ready")

    def beat(self, env: dict[str, str] | None = None) -> Proc:
        args = [
            sys.executable, "-m", "celery", "-A", "june_worker", "beat", "-l", os.environ.get("IT_LOGLEVEL", "INFO"),
            "-s", str(self.tmp / "beat-schedule"), "--pidfile=",
        ]  # fmt: skip
        proc = Proc("beat", args, {**self.env, **(env or {})}, self.tmp / "beat.log")
        self.procs.append(proc)
        wait_for(
            lambda: "beat: Starting" in proc.log.read_text(errors="replace"), timeout_s=PROCESS_START_S, what="beat"
        )
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()
        self.procs.clear()

    def close(self) -> None:
        """Stop the processes and close the clients."""
        self.stop()
        self.client.close()
        self.redis.close()

    # --- sending and reading ---------------------------------------------------------------------

    def send(self, task: str, payload: Any, **options: Any) -> Any:
        from june_worker.worker.broker import publish_options

        return self.client.send_task(task, args=[payload], **{**publish_options(self.settings), **options})

    def turn(self, agent: str, session: str, text: str, turn_id: str | None = None, **fields: Any) -> str:
        turn_id = turn_id or f"t_{uuid.uuid4().hex}"
        self.send("june.turn", {"turn_id": turn_id, "agent": agent, "session": session, "text": text, **fields})
        return turn_id

    def producer(self, **options: Any) -> Any:
        """A producers.JuneProducer wired to this stack's broker, queues and key prefix."""
        from producers import JuneProducer

        return JuneProducer(
            self.events_url,
            broker_url=self.broker_url,
            result_backend=self.redis_url,
            queue=self.queue,
            control_queue=self.control_queue,
            key_prefix=self.prefix,
            **options,
        )

    def stream_key(self, agent: str, session: str) -> str:
        return f"{self.prefix}:events:{{{agent}:{session}}}"

    def events(self, agent: str, session: str) -> list[dict[str, Any]]:
        return [
            {"id": entry_id, **json.loads(fields["data"])}
            for entry_id, fields in self.redis.xrange(self.stream_key(agent, session))
        ]

    def structural(self, agent: str, session: str) -> list[dict[str, Any]]:
        return [e for e in self.events(agent, session) if not e["type"].endswith(".delta")]

    def wait_terminal(self, agent: str, session: str, turn_id: str, timeout_s: float = 30) -> dict[str, Any]:
        terminal = {"turn.completed", "turn.failed", "turn.cancelled", "input.requested"}

        def found() -> dict[str, Any] | None:
            for e in self.events(agent, session):
                if e["turn_id"] == turn_id and e["type"] in terminal:
                    return e
            return None

        return wait_for(found, timeout_s=timeout_s, what=f"terminal event of {turn_id}")

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            cur = conn.execute(query, params)  # type: ignore[arg-type]
            return cur.fetchall() if cur.description else []

    def outcome(self, result: Any, timeout_s: float = 30) -> dict[str, Any]:
        """The summary a turn or proactive task returned. Those tasks store no result (``ignore_result``):
        it is read where the worker logged it (``Task june.turn[<id>] succeeded in <s>s: {...}``)."""
        needle = f"[{result.id}] succeeded in "

        def found() -> dict[str, Any] | None:
            for proc in self.procs:
                text = proc.log.read_text(errors="replace")
                if needle in text:  # the value runs to the next log record (it may hold a line break)
                    value = re.split(r"\n\[\d{4}-", text.split(needle, 1)[1].split(": ", 1)[1], maxsplit=1)[0]
                    with warnings.catch_warnings():  # Celery's saferepr keeps a regex's "\-" as it is
                        warnings.simplefilter("ignore")
                        return ast.literal_eval(value.rstrip("\n"))  # type: ignore[no-any-return]
            return None

        return wait_for(found, timeout_s=timeout_s, what=f"task {result.id} to succeed")

    def turn_row(self, agent: str, session: str, turn_id: str) -> dict[str, Any] | None:
        rows = self.sql(
            "select status, attempts, result::text from june_turns where agent = %s and session = %s and turn_id = %s",
            agent,
            session,
            turn_id,
        )
        if not rows:
            return None
        status, attempts, result = rows[0]
        return {"status": status, "attempts": attempts, "result": json.loads(result) if result else None}


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, fresh_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """The module's stack; on RabbitMQ when parametrized with ``"amqp"`` (see :func:`pytest_generate_tests`)."""
    broker, mode = getattr(request, "param", ("redis", None))
    broker_url = request.getfixturevalue("amqp_url") if broker == "amqp" else redis_url
    s = Stack(fresh_db, redis_url, tmp_path_factory.mktemp("stack"), broker_url, mode=mode)
    # the app table the ops agent's create_order writes (made here, not raced by two workers)
    s.sql("create table if not exists it_orders (turn_id text not null, call_id text not null, item text, qty integer)")
    try:
        yield s
    finally:
        s.close()
