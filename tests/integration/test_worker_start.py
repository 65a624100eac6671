"""A worker that could not serve a turn refuses to start: one line saying why, a non-zero exit, before any
message is taken (a worker that says "ready" and then drops every turn it is sent loses them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from .conftest import Proc, Stack, _admin_url, _database, wait_for

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


# --- configuration errors, start checks, june migrate (issue 26) ------------------------------------------------

CLOSED_PORT_URL = "postgresql://postgres@127.0.0.1:1/june"
"""Postgres at a port nothing listens on (1: tcpmux, never served here)."""


def _june(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "june_worker.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _own_lines(stderr: str) -> list[str]:
    """What june said on stderr (as root, Celery's SecurityWarning about superuser privileges comes too); none of
    it a traceback."""
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("june ")]


@pytest.mark.parametrize(
    ("variable", "value", "line"),
    [
        ("JUNE_LEASE_S", "abc", "JUNE_LEASE_S='abc': expected a number of seconds, at least 0.5"),
        ("JUNE_LOG_FORMAT", "xml", "JUNE_LOG_FORMAT='xml': expected text or json"),
        ("JUNE_AGENTS", "", "JUNE_AGENTS='': expected module:attribute paths, comma-separated"),
    ],
)
@pytest.mark.parametrize("command", ["worker", "beat", "migrate"])
def test_a_bad_setting_is_one_line_and_exit_code_2(
    stack: Stack, tmp_path: Path, command: str, variable: str, value: str, line: str
) -> None:
    args = [command, "-Q", stack.queue] if command == "worker" else [command]
    done = subprocess.run([sys.executable, "-m", "june_worker.cli", *args], env={**stack.env, variable: value},
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"june {command}: {line}"])


def test_june_migrate_names_a_server_that_does_not_answer_in_one_line(stack: Stack) -> None:
    done = _june("migrate", env={**stack.env, "JUNE_DATABASE_URL": CLOSED_PORT_URL}, timeout=20)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["june migrate: postgres at 127.0.0.1:1 does not answer (connection refused)"]


def test_june_migrate_names_a_database_that_does_not_exist_in_one_line(stack: Stack) -> None:
    url = _admin_url(stack.db_url, "june_no_such_db")
    done = _june("migrate", env={**stack.env, "JUNE_DATABASE_URL": url}, timeout=20)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f'june migrate: postgres at {_where(url)}: database "june_no_such_db" does not exist (create it first)'
    ]


def test_june_migrate_says_what_it_applied_and_then_that_the_schema_is_up_to_date(database_url: str) -> None:
    from june_worker.stores._pg_schema import MIGRATIONS

    for url in _database(database_url):
        env = {**os.environ, "JUNE_DATABASE_URL": url}
        first, second = _june("migrate", env=env), _june("migrate", env=env)
        assert (first.returncode, first.stdout.splitlines()) == (0, [f"applied migrations 1-{len(MIGRATIONS)}"])
        assert (second.returncode, second.stdout.splitlines()) == (0, ["schema is up to date"])
        assert first.stderr == second.stderr == ""


def test_a_worker_whose_database_does_not_exist_refuses_to_start_in_one_line(stack: Stack) -> None:
    url = _admin_url(stack.db_url, "june_no_such_db")
    done = _start_refused(stack, "-P", "solo", env={"JUNE_DATABASE_URL": url})
    assert done.returncode == 1
    lines = _own_lines(done.stderr)
    assert len(lines) == 1 and lines[0].endswith('database "june_no_such_db" does not exist (create it first)'), lines
    assert "ready." not in done.stdout + done.stderr


def test_a_worker_whose_postgres_does_not_answer_says_so_once_and_retries(stack: Stack, tmp_path: Path) -> None:
    # with JUNE_START_RETRY_S=0 it exits at once
    done = _start_refused(stack, "-P", "solo", env={"JUNE_DATABASE_URL": CLOSED_PORT_URL, "JUNE_START_RETRY_S": "0"})
    assert done.returncode == 1
    assert _own_lines(done.stderr) == [
        "june worker: postgres at 127.0.0.1:1 does not answer (connection refused); not starting (JUNE_START_RETRY_S=0)"
    ]
    # else it says so once, and tries again (here: several times) until it answers
    log = tmp_path / "worker.log"
    env = {**stack.env, "JUNE_DATABASE_URL": CLOSED_PORT_URL, "JUNE_START_RETRY_S": "0.05"}
    args = [sys.executable, "-m", "celery", "-A", "june_worker", "worker", "-P", "solo", "-Q", stack.queue]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        line = "june worker: postgres at 127.0.0.1:1 does not answer (connection refused); retrying every 0.05 s"
        wait_for(lambda: line in log.read_text(), timeout_s=30, what="the worker to say it retries")
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    assert log.read_text().count(line) == 1


def test_a_worker_on_an_unmigrated_database_migrates_it_at_start_and_says_so(database_url: str, stack: Stack) -> None:
    from june_worker.stores._pg_schema import MIGRATIONS

    for url in _database(database_url):
        done = _start_refused(stack, "-P", "solo", env={"JUNE_DATABASE_URL": url, "JUNE_AGENTS": "nosuch.module:ops"})
        assert "applied migrations" not in done.stderr  # (agents first: nothing is touched for a worker that refuses)
        proc = stack.worker("migrating", pool="solo", env={"JUNE_DATABASE_URL": url})
        assert f"june worker: applied migrations 1-{len(MIGRATIONS)}" in proc.log.read_text()
        proc.stop()


def test_a_many_turns_worker_says_a_refusal_once_for_all_its_processes(stack: Stack) -> None:
    url = _admin_url(stack.db_url, "june_no_such_db")
    done = _june("worker", "--turns-per-process", "4", "-c", "3", "-Q", stack.queue,
                 env={**stack.env, "JUNE_DATABASE_URL": url})  # fmt: skip
    assert done.returncode == 1
    assert _own_lines(done.stderr) == [
        f'june worker: postgres at {_where(url)}: database "june_no_such_db" does not exist (create it first)'
    ]


def _where(url: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    return f"{info['host']}:{info['port']}"


def test_a_workers_first_ctrl_c_says_how_many_turns_it_waits_for(stack: Stack, session_id: str) -> None:
    stack.sql("create table if not exists it_flight (turn_id text not null, call_id text not null)")
    key = session_id
    worker = stack.worker("interrupted", pool="prefork", concurrency=2)
    for i in range(2):
        stack.turn("flight", f"{session_id}-{i}", f"flight {key}")
    wait_for(lambda: int(stack.redis.get(f"it:flight:{key}:lingering") or 0) == 2, timeout_s=30, what="two turns")
    os.kill(worker.pid, signal.SIGINT)  # the worker's main process, as a terminal's Ctrl-C
    line = ("june worker: waiting for 2 running turns to end; Ctrl-C again stops at once (another worker then takes "
            "them over once the lease lapses, 2 s)")  # fmt: skip
    wait_for(lambda: line in worker.log.read_text(), timeout_s=30, what="the worker to say what it waits for")
    assert worker.popen.poll() is None  # it waits
    stack.redis.set(f"it:flight:{key}:go", "1")
    worker.popen.wait(30)
    assert worker.log.read_text().count("june worker: waiting for") == 1


@pytest.mark.parametrize("pool", [["-P", "gevent"], ["--pool=eventlet"], ["--turns-per-process", "2", "-P", "threads"]])
def test_a_pool_june_refuses_is_said_once_in_one_line(stack: Stack, pool: list[str]) -> None:
    done = _june("worker", *pool, "-Q", stack.queue, env=stack.env)
    assert done.returncode == 2
    assert len(_own_lines(done.stderr)) == 1 and len(done.stderr.splitlines()) == 1, done.stderr
