"""Two OS processes on one SQLite file: the second waits for (or is refused by) the first, so an async
tool of a turn they both ask for runs once, and neither caller gets a StoreError for a turn that completed.

The in-process runtime takes no lease; the file's lock (``<db>.lock``, held by the SQLiteStore) is what
keeps two processes from running the same turn. Each process is ``tests/unit/_sqlite_process.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from june_worker.errors import StoreLockedError
from june_worker.stores import SQLiteStore

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT_S}s waiting for {what}")
        time.sleep(0.01)


class Proc:
    """One runtime process on the shared file; its stderr (logs) goes to a file the test can read."""

    started: list[Proc] = []

    def __init__(self, db: Path, work: Path, name: str, lock_timeout_s: float) -> None:
        self.log = work / f"{name}.log"
        with self.log.open("w") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "tests.unit._sqlite_process", str(db), str(work), str(lock_timeout_s)],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        Proc.started.append(self)

    def logged(self) -> str:
        return self.log.read_text()

    def exited(self) -> bool:
        return self.popen.poll() is not None

    def outcome(self) -> dict[str, Any]:
        out, _ = self.popen.communicate(timeout=WAIT_S)
        assert self.popen.returncode == 0, f"process failed ({self.popen.returncode}): {self.logged()}"
        return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    """The test's directory; a process it started and that is still running at the end is killed (by pid)."""
    yield tmp_path
    while Proc.started:
        p = Proc.started.pop()
        if not p.exited():
            p.popen.kill()
        p.popen.wait(WAIT_S)
        if p.popen.stdout is not None:
            p.popen.stdout.close()


def runs(work: Path) -> list[str]:
    path = work / "runs"
    return path.read_text().split() if path.exists() else []


def test_a_second_process_on_the_file_waits_and_then_reports_the_turn_without_running_its_tool(work: Path) -> None:
    db = work / "june.db"
    # Given process A running turn t1, inside its async tool
    a = Proc(db, work, "a", lock_timeout_s=10)
    wait_until(lambda: len(runs(work)) == 1 or a.exited(), "process A to be inside its tool")
    # When process B, on the same file, asks for the same turn t1
    b = Proc(db, work, "b", lock_timeout_s=WAIT_S)
    wait_until(
        lambda: "is in use by process" in b.logged() or len(runs(work)) > 1 or b.exited(),
        "process B to wait for the file (or to run the tool itself)",
    )
    (work / "release").touch()
    done_a, done_b = a.outcome(), b.outcome()
    # Then the tool ran once, in A; B waited for A, then read t1's result: completed, no StoreError
    assert runs(work) == [str(done_a["pid"])]
    assert f"in use by process {done_a['pid']}" in b.logged()
    assert done_a["status"] == done_b["status"] == "completed", (done_a, done_b)
    assert done_a["text"] == done_b["text"] == "Refunded."


def test_a_second_process_that_will_not_wait_is_refused_with_a_clear_error(work: Path) -> None:
    db = work / "june.db"
    # Given process A running turn t1, inside its async tool
    a = Proc(db, work, "a", lock_timeout_s=10)
    wait_until(lambda: len(runs(work)) == 1 or a.exited(), "process A to be inside its tool")
    # When process B opens the same file without waiting
    b = Proc(db, work, "b", lock_timeout_s=0)
    wait_until(lambda: b.exited() or len(runs(work)) > 1, "process B to be refused (or to run the tool itself)")
    (work / "release").touch()
    done_a, done_b = a.outcome(), b.outcome()
    # Then B is refused, naming the file and A's pid; the tool ran once, and A's turn completed
    assert done_b["status"] == "locked", done_b
    assert str(db) in done_b["error"] and f"in use by process {done_a['pid']}" in done_b["error"]
    assert runs(work) == [str(done_a["pid"])]
    assert done_a["status"] == "completed"


def test_in_one_process_a_second_store_on_the_file_is_refused_until_the_first_is_closed(work: Path) -> None:
    first = SQLiteStore(work / "june.db")
    with pytest.raises(StoreLockedError, match="already open in this process"):
        SQLiteStore(work / "june.db")
    first.close()
    second = SQLiteStore(work / "june.db")  # the file is free again
    second.close()
