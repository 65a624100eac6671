"""``june worker --turns-per-process N [-c P]``: P worker processes, each running up to N turns at once, kept running.

A prefork worker's main process starts a pool process again when one dies (a tool that segfaults, the OOM
killer). A worker that runs many turns in one process (Celery's threads pool, :mod:`.inflight`) is its own
main process: this supervisor is what starts it again. It starts P Celery workers (``-P threads -c N``, each
named ``<name>-<i>`` when P > 1) and one **isolation worker** (``-P solo`` on ``<queue>.isolated`` for their
``-Q`` queue, :func:`isolation_queue`; named ``<name>-isolated``): a turn whose process died under it goes on
there, alone, so that a turn that kills its process kills only itself from then on, and the turns it took down with it are not charged for it again
(:meth:`~june_worker.worker.host.WorkerHost._isolate`). It passes SIGTERM / SIGINT / SIGQUIT on to them
(Celery's warm and cold shutdowns), and starts again, after a backoff, one that dies while nobody asked it to
stop. One that exits by itself at once (a worker that refuses to start: bad agents, a bad setting) ends the
supervisor with its exit code: starting it again would only say the same again.

The turns a dead process was running are recovered like a killed prefork process's (the lease, the sweeper);
its messages go back to the broker (RabbitMQ at once, Redis after its visibility timeout).

The rule a reader must not break: **the supervisor imports nothing of Celery or the engine** (it only starts
processes), and never outlives its workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from .settings import WorkerSettings

__all__ = ["ISOLATION_AFTER_S", "REFUSED_WITHIN_S", "isolation_queue", "supervise", "worker_command"]

REFUSED_WITHIN_S = 10.0
"""A worker that exits with an error code this soon after it started refused to start: the supervisor ends too."""
ISOLATION_AFTER_S = REFUSED_WITHIN_S
"""The isolation worker starts this long after the others (once they did not refuse to start)."""
_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
_STEADY_S = REFUSED_WITHIN_S
"""A worker that ran this long before it died (a normal run, not a refusal) is started again without waiting: the
turns it held are what matter, and another process serving the queue is what recovers them soonest."""


def _take_option(args: list[str], short: str, long: str) -> str | None:
    """Remove ``-X v`` / ``-Xv`` / ``--long v`` / ``--long=v`` from ``args``; its value, or None."""
    for i, arg in enumerate(args):
        if arg in (short, long) and i + 1 < len(args):
            value = args.pop(i + 1)
            args.pop(i)
            return value
        if arg.startswith(long + "="):
            return args.pop(i).split("=", 1)[1]
        if arg.startswith(short) and len(arg) > len(short) and not arg.startswith("--"):
            return args.pop(i)[len(short) :]
    return None


def isolation_queue(env: dict[str, str] | os._Environ[str], queues: str | None = None) -> str:
    """Where turns whose process died under them go on alone: ``JUNE_ISOLATION_QUEUE``, else ``<queue>.isolated`` for
    the first turn queue the workers consume (``-Q``, the control queue aside), else for ``JUNE_QUEUE``.

    Workers of one queue (``-Q billing``, serving the billing agents) get an isolation queue of their own: on
    another queue's, that queue's isolation worker, which may not serve their agents, could take their turns."""
    if env.get("JUNE_ISOLATION_QUEUE"):
        return env["JUNE_ISOLATION_QUEUE"]
    control = env.get("JUNE_CONTROL_QUEUE") or WorkerSettings.control_queue
    consumed = [q.strip() for q in (queues or "").split(",") if q.strip() and q.strip() != control]
    return f"{consumed[0] if consumed else env.get('JUNE_QUEUE') or WorkerSettings.queue}.isolated"


def worker_command(
    app: str, turns: int, index: int, processes: int, rest: Sequence[str], *, isolated: str
) -> list[str]:
    """``celery worker``'s command line for worker ``index`` of ``processes`` (index 0: the isolation worker, on
    the queue ``isolated`` instead of the ``-Q`` queues)."""
    args = list(rest)
    name = _take_option(args, "-n", "--hostname") or "celery@%h"
    node, at, host = name.partition("@")
    if index == 0:
        _take_option(args, "-Q", "--queues")
        name = f"{node}-isolated{at}{host}"
        return [sys.executable, "-m", "celery", "-A", app, "worker", "-P", "solo", "-Q", isolated, "-n", name, *args]
    if processes > 1:
        name = f"{node}-{index}{at}{host}"
    return [sys.executable, "-m", "celery", "-A", app, "worker", "-P", "threads", "-c", str(turns), "-n", name, *args]


def _metrics_directory(env: os._Environ[str]) -> dict[str, str]:
    """With JUNE_METRICS_PORT: one Prometheus multiprocess directory for every worker this supervisor starts, emptied
    here once, kept by them (a process that dies keeps its counts, as a prefork pool process's do)."""
    port = env.get("JUNE_METRICS_PORT", "0").strip()
    if port in ("", "0"):
        return {}
    path = Path(env.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(prefix="june-metrics-"))
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink()
    return {"PROMETHEUS_MULTIPROC_DIR": str(path), "JUNE_METRICS_DIR_KEPT": "1"}


def _die_with_parent() -> None:
    """In the child before exec: on Linux, SIGKILL it when the supervisor dies (even by SIGKILL), so that no worker
    outlives it; elsewhere nothing (the supervisor's signal handlers still pass stops on)."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


@dataclass
class _Worker:
    index: int
    command: list[str]
    popen: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    deaths: int = 0
    due: float = 0.0


def supervise(app: str, *, turns: int, processes: int, rest: Sequence[str]) -> int:
    """Run ``processes`` workers of ``turns`` turns each until they are told to stop; the exit code."""
    # what every process needs (agents, Postgres, the broker), checked once here: a refusal is said once
    try:
        checked = subprocess.run([sys.executable, "-m", "june_worker.worker.startcheck"], check=False)
    except KeyboardInterrupt:  # (the check, in the same process group, got it too and said so)
        return 130
    if checked.returncode != 0:
        return checked.returncode
    # the isolation worker (index 0): one turn at a time, for turns whose process died under them
    isolated = isolation_queue(os.environ, _take_option(list(rest), "-Q", "--queues"))
    workers = [
        _Worker(i, worker_command(app, turns, i, processes, rest, isolated=isolated)) for i in range(0, processes + 1)
    ]
    # started a little later: a worker that refuses to start (bad agents) says so once, not once per process
    workers[0].due = time.monotonic() + ISOLATION_AFTER_S
    stopping: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)
        for w in workers:
            if w.popen is not None and w.popen.poll() is None:
                w.popen.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, forward)
    env = {**os.environ, "JUNE_SUPERVISOR_PID": str(os.getpid()), "JUNE_ISOLATION_QUEUE": isolated,
           "JUNE_START_CHECKED": "1"}  # fmt: skip
    env.update(_metrics_directory(os.environ))
    code = 0
    while True:
        now = time.monotonic()
        for w in workers:
            if w.popen is None and not stopping and now >= w.due:
                # the first turn worker serves the metrics of all (the directory they share); the others record only
                own = env if w.index == 1 or "JUNE_METRICS_PORT" not in env else {**env, "JUNE_METRICS_PORT": "0"}
                w.popen = subprocess.Popen(w.command, env=own, preexec_fn=_die_with_parent)
                w.started = time.monotonic()
            if w.popen is None or w.popen.poll() is None:
                continue
            rc, ran, pid = w.popen.returncode, time.monotonic() - w.started, w.popen.pid
            w.popen = None
            if stopping:
                code = code or (rc if rc > 0 else 0)
                continue
            if rc > 0 and ran < REFUSED_WITHIN_S:  # it refused to start and said why on its own stderr
                forward(signal.SIGTERM, None)
                code = rc
                continue
            w.deaths = 0 if ran >= _STEADY_S else w.deaths + 1
            wait = 0.0 if w.deaths == 0 else _BACKOFF_S[min(w.deaths, len(_BACKOFF_S)) - 1]
            w.due = time.monotonic() + wait
            how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
            print(f"june worker: process {w.index} (pid {pid}) ended with {how} after {ran:.0f}s; "
                  f"starting it again in {wait:.0f}s", file=sys.stderr, flush=True)  # fmt: skip
        if stopping and all(w.popen is None for w in workers):
            return code
        time.sleep(0.2)
