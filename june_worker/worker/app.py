"""The Celery app. Settings come from the top-level ``celeryconfig`` module (Celery's convention),
which reads the environment; without it, the same defaults are built here.

Start workers with ``celery -A june_worker worker`` (or ``june worker``): ``-A june_worker``
finds this app through :mod:`june_worker.celery`.
"""

from __future__ import annotations

import importlib
import os
import signal
from typing import Any

from celery import Celery
from celery.concurrency import get_implementation
from celery.signals import worker_init, worker_ready, worker_shutting_down

from ..engine.secrets import scrubbed_logger
from . import logformat  # noqa: F401  (connects the log-format hooks: scrubbed always, JSON on request)

__all__ = ["SUPPORTED_POOLS", "app", "kill_worker"]

log = scrubbed_logger("june_worker.worker")


def _config() -> Any:
    name = os.environ.get("CELERY_CONFIG_MODULE", "celeryconfig")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        from . import defaultconfig

        return defaultconfig


_main_pid: int | None = None
"""The worker's main process (the one that talks to the broker); set in it before the pool forks."""


def kill_worker() -> None:
    """SIGKILL the worker's main process, then this one: a machine dying while a pool process runs a task.

    For crash tests (``JUNE_CRASH_AT``): the main process holds the task's message, so the broker,
    not the pool, must hand it out again.
    """
    if _main_pid is not None and _main_pid != os.getpid():
        os.kill(_main_pid, signal.SIGKILL)
    supervisor = os.environ.get("JUNE_SUPERVISOR_PID")  # many turns per process: the supervisor would start us again
    if supervisor and supervisor.isdigit() and _main_pid == os.getpid():
        os.kill(int(supervisor), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


# The tasks module sits above this one (it needs the host, which needs the app's settings only through its own
# module): a worker imports it at start (``include``), anything else that sends by name never needs it.
app = Celery("june_worker", include=["june_worker.worker.tasks"])
app.config_from_object(_config())


# How a worker runs its turns (worker/host.py): one at a time per process (prefork: -c processes; solo), or many
# at once in one process (threads: -c turns in flight, one event loop, worker/inflight.py). Greenlet pools would
# run the turns' blocking calls on one thread without the host knowing: they are refused.
SUPPORTED_POOLS = ("prefork", "solo", "threads")
_MANY_TURNS = False


def many_turns_per_process() -> bool:
    """True in a worker whose pool runs its tasks on threads of one process (``-P threads``)."""
    return _MANY_TURNS


@worker_init.connect  # type: ignore[untyped-decorator]
def _remember_main_process(sender: Any = None, **_: Any) -> None:
    global _main_pid
    if getattr(sender, "app", None) is app:
        _main_pid = os.getpid()


@worker_init.connect  # type: ignore[untyped-decorator]
def _check_before_start(sender: Any = None, **_: Any) -> None:
    """Refuse to start, in one line and a non-zero exit, a worker that could not serve a turn: a pool that shares
    one thread between tasks, agents that do not load. (A signal handler's Exception is only logged by Celery;
    SystemExit ends the worker before its banner.)"""
    global _MANY_TURNS
    if getattr(sender, "app", None) is not app:
        return
    pool = get_implementation(sender.pool_cls)
    names = {get_implementation(name): name for name in SUPPORTED_POOLS}
    if pool not in names:
        raise SystemExit(
            f"june worker: --pool {pool.__module__}.{pool.__qualname__} is not supported: use prefork (one turn per "
            "process), solo, or threads (--turns-per-process N: many turns in one process)"
        )
    _MANY_TURNS = names[pool] == "threads"
    from ..errors import ConfigError
    from .host import load_agents
    from .settings import WorkerSettings

    global _JSON_LOGS
    try:
        settings = WorkerSettings.from_env()
        _JSON_LOGS = settings.log_format == "json"
        agents = load_agents(settings.agents)  # imported here, before the pool forks: its processes inherit them
    except ConfigError as exc:
        raise SystemExit(f"june worker: {exc}") from None
    if os.environ.get("JUNE_START_CHECKED") != "1":  # (june's supervisor checked once for all its processes)
        from .startcheck import wait_until_ready

        code = wait_until_ready(settings, _say)
        if code:
            raise SystemExit(code)
    global _LEASE_S
    _LEASE_S = settings.lease_s
    log.info("serving agents %s", ", ".join(sorted(agents)))


_LEASE_S = 30.0
_JSON_LOGS = False
_TURN_TASKS = frozenset({"june.turn", "june.proactive"})


@worker_shutting_down.connect  # type: ignore[untyped-decorator]
def _say_what_a_warm_shutdown_waits_for(sig: str = "", how: str = "", **_: Any) -> None:
    """A warm shutdown (the first Ctrl-C, SIGTERM) waits for the running turns: say how many, and what else there is."""
    if how != "Warm":
        return
    from celery.worker import state

    turns = sum(1 for request in list(state.active_requests) if getattr(request, "name", None) in _TURN_TASKS)
    if not turns:
        return
    again = "Ctrl-C again" if sig == "SIGINT" else "SIGQUIT"
    _say(
        f"waiting for {turns} running turn{'' if turns == 1 else 's'} to end; {again} stops at once "
        f"(another worker then takes {'it' if turns == 1 else 'them'} over once the lease lapses, {_LEASE_S:g} s)"
    )


def _say(line: str) -> None:
    logformat.say(f"june worker: {line}", json_mode=_JSON_LOGS)


# --- operating it: metrics and log format (docs/operations.md) --------------------------------------------


@worker_init.connect  # type: ignore[untyped-decorator]
def _metrics_directory(sender: Any = None, **_: Any) -> None:
    """In the main process, before the pool forks: where every process keeps its metrics (JUNE_METRICS_PORT)."""
    if getattr(sender, "app", None) is not app:
        return
    from ..observe.serve import prepare_directory
    from .settings import WorkerSettings

    settings = WorkerSettings.from_env()
    if settings.metrics_port:
        # under june's supervisor (many turns per process) the directory outlives this process: a process that died
        # keeps its counts there, as a prefork pool process's do; the supervisor emptied it once, at its start
        prepare_directory(settings.metrics_dir, empty=os.environ.get("JUNE_METRICS_DIR_KEPT") != "1")


@worker_ready.connect  # type: ignore[untyped-decorator]
def _serve_metrics(sender: Any = None, **_: Any) -> None:
    """The main process serves the pool's metrics and the state gauges on JUNE_METRICS_PORT."""
    if getattr(sender, "app", None) is not app:
        return
    from ..observe.serve import serve
    from .host import load_agents
    from .settings import WorkerSettings

    settings = WorkerSettings.from_env()
    if not settings.metrics_port:
        return
    serve(
        port=settings.metrics_port,
        host=settings.metrics_host,
        path=os.environ["PROMETHEUS_MULTIPROC_DIR"],
        database_url=settings.database_url,
        agents=load_agents(settings.agents),
        broker_url=settings.broker_url,
        queues=(settings.queue, settings.control_queue),
    )
