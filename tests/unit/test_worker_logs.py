"""The worker's logging, as Celery sets it up in a worker's or beat's process (``app.log.setup``), in a process of
its own: billiard's logger ``multiprocessing`` (which reports a pool process that died) has a handler of its own,
apart from the root logger's, and gets the same treatment.

Fails on main (c104bc8): that handler had neither the scrubbing filter nor the JSON formatter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from june_worker.cli import beat_args

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-ant-api03-" + "Q" * 24

_SCRIPT = f"""
import logging
from billiard import util
from june_worker.worker.app import app
app.log.setup(logging.INFO)  # as the worker's main process does (celery.apps.worker.Worker.setup_logging)
util.get_logger().error("pool process said %s", {KEY!r})
"""


def _celery_logging(log_format: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JUNE_LOG_FORMAT": log_format}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_billiards_records_are_scrubbed_in_either_format(log_format: str) -> None:
    # Given the worker's logging set up by Celery; When billiard's logger writes a key
    err = _celery_logging(log_format)
    # Then the line says what it said, without the key
    assert "pool process said <redacted>" in err and KEY not in err


def test_billiards_records_are_json_in_json_mode() -> None:
    # Given the worker's logging set up by Celery with JUNE_LOG_FORMAT=json; When billiard's logger writes
    lines = _celery_logging("json").splitlines()
    # Then the line is one JSON record of that logger
    assert [(r["logger"], r["level"]) for r in map(json.loads, lines)] == [("multiprocessing", "ERROR")]


@pytest.mark.parametrize(("log_format", "expected"), [("json", ["--quiet", "beat", "-l", "INFO"]),
                                                      ("JSON ", ["--quiet", "beat", "-l", "INFO"]),
                                                      ("text", ["beat", "-l", "INFO"]), ("", ["beat", "-l", "INFO"])])  # fmt: skip
def test_june_beat_runs_celery_quiet_in_json_mode(log_format: str, expected: list[str]) -> None:
    assert beat_args(["-l", "INFO"], log_format) == expected
