"""The in-process benchmark scripts still run against the code as it is now.

They reach into the worker (``bench/turn_cost.py`` wraps the sink's and the queue's methods to
time them), so a change there can break them without any other test noticing. Each runs here
with the smallest sizes its options allow; the figures themselves are not checked (no timed
asserts: docs/benchmarks.md holds the measurements).
"""

from __future__ import annotations

import os
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
    "storage.py": (["--threads", "2", "--turns", "3"], "after relay and pruning"),
    "parallel_tools.py": (["--calls", "2", "--wait-ms", "5", "--rounds", "1"], "ratio serial / parallel"),
    "subagents.py": (["--children", "2", "--wait-ms", "5", "--rounds", "1"], "ratio serial / parallel"),
    "throughput.py": (
        "--brokers redis --layouts 2x1,1x2 --rounds 1 --turns 4 --empty 4 --per-session 2 "
        "--latency-turns 3 --warmup 1 --recovery-runs 0 --short-runs 1".split(),
        "target < 15 s (short lease)",
    ),
    # Kills 0.5-1 s apart cannot outpace start-ups: the killer waits for the worker that replaces a killed main
    # process to be ready before it kills again, and Celery forks a killed pool process again at once.
    # --settle-s bounds the wait for the turns (and for the relay after them) well inside this test's timeout, so
    # a slow run ends with the script's own report of what did not end, not with a timeout of the test.
    "chaos.py": (
        ["--turns", "6", "--sessions", "2", "--rate", "20", "--kill-every", "0.5", "1", "--settle-s", "60"],
        "stuck sessions",
    ),
}
TIMEOUT_S = {"chaos.py": 240}
"""Scripts that may take longer than the default 120 s: worker start-ups, settling and teardown included."""


@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=pytest.mark.timeout(TIMEOUT_S.get(s, 120) + 20)) for s in sorted(SCRIPTS)]
)
def test_the_benchmark_script_runs_to_its_summary(script: str, database_url: str, redis_url: str) -> None:
    args, summary = SCRIPTS[script]
    # PYTHONPATH: the script imports this checkout's package, not whichever one is installed
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JUNE_DATABASE_URL": database_url, "JUNE_REDIS_URL": redis_url}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S.get(script, 120),
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert summary in done.stdout, done.stdout[-2000:]
