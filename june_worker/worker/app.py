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
from celery.signals import worker_init, worker_ready

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
    os.kill(os.getpid(), signal.SIGKILL)


app = Celery("june_worker")
app.config_from_object(_config())
app.autodiscover_tasks(["june_worker.worker"], related_name="tasks", force=True)


# A worker process runs one turn at a time on its own event loop, Postgres pool and Redis
# connection (worker/host.py): the pools that run tasks in separate processes, or one at a time,
# are the ones that keep that true. Threads or greenlets would share one host between tasks.
SUPPORTED_POOLS = ("prefork", "solo")


@worker_init.connect  # type: ignore[untyped-decorator]
def _remember_main_process(sender: Any = None, **_: Any) -> None:
    global _main_pid
    if getattr(sender, "app", None) is app:
        _main_pid = os.getpid()


@worker_init.connect  # type: ignore[untyped-decorator]
def _refuse_shared_pools(sender: Any = None, **_: Any) -> None:
    if getattr(sender, "app", None) is not app:
        return
    pool = get_implementation(sender.pool_cls)
    if pool not in {get_implementation(name) for name in SUPPORTED_POOLS}:
        message = (
            f"june-worker runs on --pool prefork or solo, not {pool.__module__}.{pool.__qualname__}: "
            "one turn per process at a time"
        )
        log.critical(message)
        raise SystemExit(message)  # a signal handler's Exception is only logged; the worker must not start


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
        prepare_directory(settings.metrics_dir)


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
