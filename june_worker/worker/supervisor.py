"""``june worker --turns-per-process N [-c P]``: P worker processes, each running up to N turns at once, kept running.

A prefork worker's main process starts a pool process again when one dies (a tool that segfaults, the OOM
killer). A worker that runs many turns in one process (Celery's threads pool, :mod:`.inflight`) is its own
main process: this supervisor is what starts it again. It starts P Celery workers (``-P threads -c N``, each
named ``<name>-<i>`` when P > 1), passes SIGTERM / SIGINT / SIGQUIT on to them (Celery's warm and cold
shutdowns), and starts again, after a backoff, one that dies while nobody asked it to stop. One that exits by
itself at once (a worker that refuses to start: bad agents, a bad setting) ends the supervisor with its exit
code: starting it again would only say the same again.

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
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

__all__ = ["REFUSED_WITHIN_S", "supervise", "worker_command"]

REFUSED_WITHIN_S = 10.0
"""A worker that exits with an error code this soon after it started refused to start: the supervisor ends too."""
_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
_STEADY_S = 60.0
"""A worker that ran this long before it died is started again without waiting."""


def worker_command(app: str, turns: int, index: int, processes: int, rest: Sequence[str]) -> list[str]:
    """``celery worker``'s command line for worker ``index`` of ``processes``."""
    args = list(rest)
    name = "celery@%h"
    for i, arg in enumerate(args):
        if arg in ("-n", "--hostname") and i + 1 < len(args):
            name = args.pop(i + 1)
            args.pop(i)
            break
        if arg.startswith("--hostname="):
            name = args.pop(i).split("=", 1)[1]
            break
    if processes > 1:
        node, at, host = name.partition("@")
        name = f"{node}-{index}{at}{host}"
    return [sys.executable, "-m", "celery", "-A", app, "worker", "-P", "threads", "-c", str(turns), "-n", name, *args]


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
    workers = [_Worker(i, worker_command(app, turns, i, processes, rest)) for i in range(1, processes + 1)]
    stopping: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)
        for w in workers:
            if w.popen is not None and w.popen.poll() is None:
                w.popen.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, forward)
    env = {**os.environ, "JUNE_SUPERVISOR_PID": str(os.getpid())}
    code = 0
    while True:
        now = time.monotonic()
        for w in workers:
            if w.popen is None and not stopping and now >= w.due:
                w.popen = subprocess.Popen(w.command, env=env)
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
