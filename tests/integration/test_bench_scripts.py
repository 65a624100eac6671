"""The in-process benchmark scripts still run against the code as it is now.

They reach into the worker (``bench/turn_cost.py`` wraps the sink's and the queue's methods to
time them), so a change there can break them without any other test noticing. Each runs here
with the smallest sizes its options allow, and the test checks that it ran to its summary; the
figures themselves are not checked (no timed asserts: docs/benchmarks.md holds the measurements),
and nothing times the run: a busy machine makes it slower, not wrong. pytest-timeout's bound here
(:data:`HANG_GUARD_S`) catches a script that hangs, far above any run's length; whatever stops it
stops the script's process group with SIGTERM first, so that it stops the workers it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

SCRIPTS = {
    "turn_cost.py": (["-n", "5"], "a whole turn (wall)"),
    "history_cost.py": (["--history", "10,40", "--history-turns", "2"], "pg trips/turn"),
    "event_latency.py": (["-n", "20", "--warmup", "5"], "target p99 < 1.5 ms"),
    "step_overhead.py": (["--steps", "2", "--rounds", "1"], "tables+indexes grew per step"),
    # the regression guard: this checkout against a git worktree of HEAD (what --against REV does for any REV)
    "step_overhead.py --against": (["--steps", "2", "--rounds", "1", "--against", "HEAD"], "ratio this / "),
    "storage.py": (["--threads", "2", "--turns", "3"], "after relay and pruning"),
    # both modes side by side, two W = 0 rounds (the alternation), then one short wait
    "inflight.py": (
        ["--turns", "10", "--prefork-turns", "4", "--prefork-c", "2", "--wait", "0.1", "--cpu-rounds", "2"],
        "inflight: ",
    ),
    "parallel_tools.py": (["--calls", "2", "--wait-ms", "5", "--rounds", "1"], "ratio serial / parallel"),
    "subagents.py": (["--children", "2", "--wait-ms", "5", "--rounds", "1"], "ratio serial / parallel"),
    # One layout of one worker, one task or turn per batch and no warm-up batches; one ordinary turn of latency; one
    # recovery run, with the short lease, after the fewest baseline turns (3: 2 warm the workers up).
    "throughput.py": (
        "--brokers redis --layouts 1x1 --rounds 1 --turns 1 --empty 1 --per-session 1 --layout-warmup 0 "
        "--latency-turns 1 --warmup 0 --recovery-runs 0 --short-runs 1 --baseline-turns 3".split(),
        "target < 15 s (short lease)",
    ),
    # Kills 0.5-1 s apart cannot outpace start-ups: the killer waits for the worker that replaces a killed main
    # process to be ready before it kills again, and Celery forks a killed pool process again at once. The turns get
    # the script's own settling time (--settle-s, 240 s): on a busy machine they take longer, and are not lost.
    "chaos.py": (
        ["--turns", "6", "--sessions", "2", "--rate", "20", "--kill-every", "0.5", "1", "--durable"],
        "stuck sessions",
    ),
}

HANG_GUARD_S = 900
"""pytest-timeout for each script: a hang, not a slow run (each runs in under a minute alone, chaos.py included)."""


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a script to its end, however long it takes; if the test is stopped (a timeout), SIGTERM its process group
    (the scripts stop the workers they started on it), then SIGKILL what is left."""
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.timeout(HANG_GUARD_S)
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_the_benchmark_script_runs_to_its_summary(script: str, database_url: str, redis_url: str) -> None:
    args, summary = SCRIPTS[script]
    # PYTHONPATH: the script imports this checkout's package, not whichever one is installed
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JUNE_DATABASE_URL": database_url, "JUNE_REDIS_URL": redis_url}
    done = _run([sys.executable, str(ROOT / "bench" / script.split()[0]), *args], env)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert summary in done.stdout, done.stdout[-2000:]
