"""A worker that could not serve a turn refuses to start: one line saying why, a non-zero exit, before any
message is taken (a worker that says "ready" and then drops every turn it is sent loses them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Proc, Stack, wait_for

pytestmark = pytest.mark.integration

NO_SUCH_AGENT = "june worker: cannot load agent 'nosuch.module:ops': ModuleNotFoundError: No module named 'nosuch'"


def _start_refused(stack: Stack, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "celery", "-A", "june_worker", "worker", *extra]
    args += ["-Q", stack.queue, "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"]
    return subprocess.run(args, env={**stack.env, **(env or {})}, capture_output=True, text=True, timeout=60)


def test_a_worker_on_a_pool_that_runs_tasks_on_one_thread_refuses_to_start(stack: Stack) -> None:
    # a pool june's host knows nothing of (greenlets, a custom one) would run the turns' blocking calls unseen
    done = _start_refused(stack, "-P", "custom", env={"CELERY_CUSTOM_WORKER_POOL": "celery.concurrency.base:BasePool"})
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == (
        "june worker: --pool celery.concurrency.base.BasePool is not supported: use prefork (one turn per process), "
        "solo, or threads (--turns-per-process N: many turns in one process)"
    )
    assert "Traceback" not in done.stderr
    assert "ready." not in done.stderr + done.stdout


def test_a_worker_whose_agents_do_not_load_refuses_to_start_in_one_line(stack: Stack) -> None:
    # Given JUNE_AGENTS naming a module that is not there; when the worker starts; then it says so and exits
    done = _start_refused(stack, "-P", "prefork", "-c", "1", env={"JUNE_AGENTS": "nosuch.module:ops"})
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    # (as root, Celery's own SecurityWarning about superuser privileges may come first)
    assert (
        lines[-1] == "june worker: cannot load agent 'nosuch.module:ops': ModuleNotFoundError: No module named 'nosuch'"
    )
    assert "Traceback" not in done.stderr
    assert "ready." not in done.stdout


def test_a_many_turns_worker_whose_agents_do_not_load_refuses_to_start_in_one_line(stack: Stack) -> None:
    # the supervisor of june worker --turns-per-process ends with its worker's refusal, said once
    args = [sys.executable, "-m", "june_worker.cli", "worker", "--turns-per-process", "50", "-Q", stack.queue]
    env = {**stack.env, "JUNE_AGENTS": "nosuch.module:ops"}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == NO_SUCH_AGENT and done.stderr.count(NO_SUCH_AGENT) == 1, done.stderr
    assert "Traceback" not in done.stderr


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_no_worker_outlives_its_supervisor_even_killed(stack: Stack) -> None:
    # Given june worker --turns-per-process running its workers; when the supervisor alone is SIGKILLed (no
    # signal handler runs); then its workers end too, instead of serving the queue unsupervised for ever
    args = [sys.executable, "-m", "june_worker.cli", "worker", "--turns-per-process", "4", "-Q", stack.queue]
    proc = Proc("lonely", [*args, "-n", "lonely@%h", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
                stack.env, stack.tmp / "lonely.log")  # fmt: skip
    stack.procs.append(proc)
    stack._wait_ready(proc)
    workers = proc.children()
    assert workers, "the supervisor started no worker"
    os.kill(proc.pid, signal.SIGKILL)
    proc.popen.wait(10)
    wait_for(lambda: not any(_alive(pid) for pid in workers), timeout_s=30, what="the supervisor's workers to end")
