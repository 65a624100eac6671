"""``JUNE_LOG_FORMAT=json``: every line a worker or beat writes, on stdout and on stderr, is one JSON object.

Not only june's records: Celery's main process writes lines of its own, which operators alert on (billiard's
``Process 'ForkPoolWorker-1' pid:... exited with 'signal 9 (SIGKILL)'``, the ``WorkerLostError`` and its
traceback), a banner, a warning before its logging is set up (as root), and a notice when it shuts down. Here a real
``june worker`` has its pool process SIGKILLed mid-task and is then stopped; a real ``june beat`` starts and stops.
Each stream is read whole, every line parsed.

Fails on main (c104bc8): the SIGKILL line, the banner and the shutdown notice are plain text.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, Stack, wait_for

pytestmark = pytest.mark.integration


class June:
    """``june <command>`` (``python -m june_worker.cli``) in a process group of its own, stdout and stderr apart."""

    def __init__(self, args: list[str], env: dict[str, str], tmp: Path) -> None:
        self.stdout, self.stderr = tmp / "stdout", tmp / "stderr"
        with self.stdout.open("wb") as out, self.stderr.open("wb") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "june_worker.cli", *args],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.stdout.read_text(errors="replace") + self.stderr.read_text(errors="replace")

    def wait_for_text(self, needle: str, what: str, timeout_s: float = 60) -> None:
        def seen() -> bool:
            if needle in self.text():
                return True
            assert self.popen.poll() is None, f"june exited before {what}:\n{self.text()[-3000:]}"
            return False

        wait_for(seen, timeout_s=timeout_s, every_s=0.1, what=what)

    def stop(self) -> int:
        """SIGTERM (a warm shutdown), then its exit status; SIGKILL if it does not stop in time."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                return self.popen.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
                raise
        return self.popen.returncode

    def records(self) -> list[dict[str, Any]]:
        """Every line of stdout, then of stderr, parsed; fails naming the first line that is not one JSON object."""
        out = []
        for path in (self.stdout, self.stderr):
            for n, line in enumerate(path.read_text(errors="replace").split("\n")[:-1], 1):
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                assert isinstance(record, dict), f"{path.name} line {n} is not one JSON object: {line!r}"
                out.append(record)
        return out


@pytest.fixture
def json_env(stack: Stack) -> dict[str, str]:
    return {**stack.env, "JUNE_LOG_FORMAT": "json"}


@pytest.fixture
def worker(stack: Stack, json_env: dict[str, str], tmp_path: Path) -> Iterator[June]:
    args = ["worker", "-P", "prefork", "-c", "1", "-n", f"json-{uuid.uuid4().hex[:6]}@%h",
            "-Q", f"{stack.queue},{stack.control_queue}", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-l", "INFO"]  # fmt: skip
    proc = June(args, json_env, tmp_path)
    try:
        yield proc
    finally:
        if proc.popen.poll() is None:
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(10)


def test_a_worker_whose_pool_process_is_killed_writes_only_json_lines(stack: Stack, worker: June) -> None:
    # Given a `june worker` logging JSON, ready
    worker.wait_for_text("ready.", "the worker to be ready")
    # When a turn's tool SIGKILLs the pool process running it, and the worker is then stopped
    session = f"j-{uuid.uuid4().hex[:10]}"
    stack.turn("ops", session, f"die {uuid.uuid4().hex}")
    worker.wait_for_text("exited with 'signal 9 (SIGKILL)'", "the main process to report the killed pool process")
    worker.wait_for_text("WorkerLostError", "the main process to report the lost task")
    assert worker.stop() == 0
    # Then every line it wrote, on stdout and stderr, is one JSON object: these among them
    records = worker.records()
    killed = [r for r in records if "exited with 'signal 9 (SIGKILL)'" in r["message"]]
    assert [(r["level"], r["logger"]) for r in killed] == [("ERROR", "multiprocessing")]
    lost = [r for r in records if r.get("exc_type") == "WorkerLostError"]
    assert lost and "Traceback (most recent call last)" in lost[0]["exc"]
    assert any(stack.queue in r["message"] and r["logger"] == "celery.apps.worker" for r in records)  # the banner
    assert any(r["message"] == "worker: Warm shutdown (MainProcess)" for r in records)


def test_beat_writes_only_json_lines(stack: Stack, json_env: dict[str, str], tmp_path: Path) -> None:
    # Given `june beat` logging JSON
    beat = June(["beat", "-l", "INFO", "-s", str(tmp_path / "schedule"), "--pidfile="], json_env, tmp_path)
    try:
        # When it has sent the sweep once, and is stopped
        beat.wait_for_text("Sending due task june-sweep", "beat to send the sweep")
        beat.stop()
        # Then every line it wrote is one JSON object
        assert any(r["message"] == "beat: Starting..." for r in beat.records())
    finally:
        if beat.popen.poll() is None:
            os.killpg(beat.popen.pid, signal.SIGKILL)
            beat.popen.wait(10)
