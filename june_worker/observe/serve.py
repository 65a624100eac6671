"""The worker's ``/metrics``: a small HTTP server in the worker's main process (``JUNE_METRICS_PORT``).

Celery's prefork pool runs tasks in child processes; each records into files of its own in
``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode). The main process, which
runs no task, serves them all summed, plus the state gauges (:mod:`.state`):

* :func:`prepare_directory` runs in the main process before the pool forks: it picks the
  directory (``PROMETHEUS_MULTIPROC_DIR``, or a new temporary one), sets the variable for the
  children, and empties it (files of an earlier run would be summed with this one's);
* :func:`serve` starts the server (``prometheus_client.start_http_server``, a daemon thread).

A pool child killed with SIGKILL leaves its files behind: its counters and histograms keep
counting in the sum (what it did, it did), and at each scrape :class:`_DeadProcesses` drops the
``livesum`` gauge files of processes that are gone (``june_turns_in_progress`` comes back down).
The child that replaces it writes files under its own pid.

The rule a reader must not break: **one directory per worker instance**: two workers sharing one
would wipe and sum each other's files.
"""

from __future__ import annotations

import glob
import os
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..engine.secrets import scrubbed_logger
from .metrics import metrics
from .state import StateCollector, broker_depths

__all__ = ["prepare_directory", "serve"]

log = scrubbed_logger("june_worker.observe")
_LIVE_FILE = re.compile(r"^gauge_live\w*_(\d+)\.db$")


def prepare_directory(configured: str | None, *, empty: bool = True) -> str:
    """The multiprocess directory for this worker, created and emptied (unless ``empty`` is False: a directory
    that outlives the worker's processes), and exported to the children."""
    if "prometheus_client.values" in sys.modules and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        log.warning("prometheus_client was imported before the metrics directory was set: this process's own "
                    "metrics stay in memory (the pool's are served)")  # fmt: skip
    path = Path(configured) if configured else Path(tempfile.mkdtemp(prefix="june-metrics-"))
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db") if empty else ():
        stale.unlink()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    return str(path)


class _DeadProcesses:
    """A collector that yields nothing: at each scrape it removes the live-gauge files of dead processes."""

    def __init__(self, path: str) -> None:
        self.path = path

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client import multiprocess

        for name in glob.glob(os.path.join(self.path, "gauge_live*_*.db")):
            found = _LIVE_FILE.match(os.path.basename(name))
            if found and not _alive(int(found.group(1))):
                multiprocess.mark_process_dead(int(found.group(1)), self.path)  # type: ignore[no-untyped-call]
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a child that died and was not reaped yet is a zombie: dead for us
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def serve(
    *,
    port: int,
    host: str,
    path: str,
    database_url: str,
    agents: Iterable[str],
    broker_url: str,
    queues: Iterable[str],
) -> Any:
    """Serve the pool's metrics and the state gauges on ``host:port``; returns the server."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    names = list(agents)
    metrics(names)  # this process's own files: the histograms that start at 0 (Metrics._at_zero) show before any turn
    registry = CollectorRegistry()
    registry.register(_DeadProcesses(path))  # first: the files it removes are not read below
    MultiProcessCollector(registry, path)  # type: ignore[no-untyped-call]
    queue_names = list(queues)
    registry.register(StateCollector(database_url, agents=names, depths=lambda: broker_depths(broker_url, queue_names)))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics (pool files in %s)", host, server.server_port, path)
    return server
