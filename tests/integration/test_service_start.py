"""Starting the throwaway servers (tests/_services.py) on a busy machine: a start has a budget that fits one, and a
start that fails is tried once more, from scratch; one that fails twice says so in one line, with its log.

The retry tests run ``redis-server`` through a wrapper (``JUNE_REDIS_SERVER``) that fails its first runs the way a
server does (a line in its log, exit 1) and then runs the real one.

Fails on main (c104bc8): a start was tried once, and there was no ServiceStartFailed to tell a failed start from a
missing binary (both stopped the whole run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import _rabbitmq, _services
from tests._budgets import SERVER_START_S

from .conftest import wait_for

pytestmark = pytest.mark.integration

_FAKE = """#!/bin/sh
echo run >> '{runs}'
if [ "$(wc -l < '{runs}')" -gt {failures} ]; then exec '{real}' "$@"; fi
while [ $# -gt 0 ]; do
  if [ "$1" = --logfile ]; then echo "# Warning: Could not create server TCP listening socket (run by the test)" >> "$2"; fi
  shift
done
exit 1
"""


def _redis_failing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failures: int) -> Path:
    """Make ``JUNE_REDIS_SERVER`` a redis-server that fails its first ``failures`` runs; the file that counts runs."""
    real = _services._find_redis_server()
    assert real is not None, "these tests need redis-server"
    runs = tmp_path / "runs"
    runs.touch()
    fake = tmp_path / "redis-server"
    fake.write_text(_FAKE.format(runs=runs, failures=failures, real=real))
    fake.chmod(0o755)
    monkeypatch.setenv("JUNE_REDIS_SERVER", str(fake))
    return runs


def test_a_server_that_fails_its_first_start_is_started_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a redis-server that fails the first time it runs
    runs = _redis_failing(tmp_path, monkeypatch, failures=1)
    # When the tests start a Redis of their own
    with _services.private_redis() as server:
        # Then it answers, from the second run
        assert _services._redis_ping(server.port)
        assert len(runs.read_text().splitlines()) == 2


def test_a_server_that_fails_both_starts_fails_in_one_line_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a redis-server that fails every time
    runs = _redis_failing(tmp_path, monkeypatch, failures=99)
    # When the tests start a Redis of their own
    with pytest.raises(_services.ServiceStartFailed) as failed, _services.private_redis():
        pass
    # Then it was tried twice, and the error is one line naming both attempts, with the end of the last one's log
    message = str(failed.value)
    assert len(runs.read_text().splitlines()) == 2
    assert "\n" not in message and "tried twice" in message and "exited with 1" in message
    assert "Could not create server TCP listening socket (run by the test)" in message


@pytest.fixture
def busy_cpus() -> Iterator[list[int]]:
    """One busy loop per CPU, for as long as the test runs: the load of another test suite beside this one."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        yield [h.pid for h in hogs]
    finally:
        for hog in hogs:
            os.kill(hog.pid, signal.SIGKILL)
            hog.wait(10)


def _spinning(pid: int) -> bool:
    """The process has used CPU time already (utime in /proc/<pid>/stat)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[11]) > 0


@pytest.mark.timeout(2 * SERVER_START_S + 60)  # a start and its retry, each with its budget
def test_a_rabbitmq_starts_while_every_cpu_is_busy(busy_cpus: list[int]) -> None:
    # Given every CPU busy
    wait_for(lambda: all(_spinning(p) for p in busy_cpus), what="the busy loops to run")
    # When the tests start a RabbitMQ of their own
    with _services.private_rabbitmq() as server:
        # Then it answers
        assert _rabbitmq.amqp_answers(server.url)


@pytest.mark.timeout(2 * SERVER_START_S + 60)
def test_a_postgres_starts_while_every_cpu_is_busy(busy_cpus: list[int]) -> None:
    # Given every CPU busy
    wait_for(lambda: all(_spinning(p) for p in busy_cpus), what="the busy loops to run")
    # When the tests start a Postgres of their own
    with _services.private_postgres() as server:
        # Then it answers
        assert _services._postgres_answers(server.url)
