"""The sweeper's steps are isolated: one that fails is logged and the steps after it still run.

The host is a stand-in that records which steps ran (the steps themselves are tested against real
Postgres, Redis and workers in tests/integration); no store is touched.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from june_worker.errors import StoreUnavailableError
from june_worker.worker import sweeper
from june_worker.worker.retention import Pruned


class Queue:
    """The sweeper's queries: each records that it ran; those named in ``failing`` raise."""

    def __init__(self, failing: dict[str, BaseException]) -> None:
        self.failing = failing
        self.ran: list[str] = []

    def _run(self, name: str) -> list[Any]:
        self.ran.append(name)
        if name in self.failing:
            raise self.failing[name]
        return []

    def expired_parks(self, *, limit: int) -> list[Any]:
        return self._run("expired_parks")

    def pending_resets(self, *, limit: int) -> list[Any]:
        return self._run("pending_resets")

    def stranded(self, *, grace_s: float, limit: int) -> list[Any]:
        return self._run("stranded")

    def undelivered(self, *, grace_s: float, limit: int) -> list[Any]:
        return self._run("undelivered")

    def unrelayed(self, *, limit: int, after: Any = None) -> list[Any]:
        return self._run("unrelayed")

    def forget_dead_workers(self, *, older_than_s: float) -> int:
        self._run("forget_dead_workers")
        return 0


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The steps that are not queue queries (waking parents, looking for a Redis data loss, pruning), as they run."""
    ran: list[str] = []
    monkeypatch.setattr(sweeper, "wake_parents", lambda host, dispatch, *, limit: ran.append("wake_parents") or 0)
    monkeypatch.setattr(sweeper.losses, "pending_pass", lambda client, keys: ran.append("pending_pass") or None)
    monkeypatch.setattr(sweeper, "prune", lambda pool, sink, settings: ran.append("prune") or Pruned(events=3))
    return ran


def _host(queue: Queue) -> Any:
    return SimpleNamespace(
        queue=queue,
        settings=SimpleNamespace(sweep_s=1.0),
        store=SimpleNamespace(pool=None),
        sink=None,
        redis=None,
        keys=None,
    )


def test_a_step_that_fails_is_logged_and_every_step_after_it_still_runs(
    steps: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    queue = Queue({"expired_parks": RuntimeError("a park row nobody can read"), "stranded": ValueError("bad row")})

    summary = sweeper.sweep(_host(queue), lambda turn: None)

    assert queue.ran == [
        "expired_parks",
        "pending_resets",
        "stranded",
        "undelivered",
        "unrelayed",
        "forget_dead_workers",
    ]
    assert steps == ["wake_parents", "pending_pass", "prune"]
    assert summary["status"] == "swept" and summary["pruned"]["events"] == 3
    assert "sweep: expiring parks failed; the other steps go on" in caplog.text
    assert "sweep: re-sending stranded turns failed" in caplog.text and "bad row" in caplog.text


def test_the_store_being_unavailable_is_not_swallowed_the_task_is_retried(steps: list[str]) -> None:
    queue = Queue({"pending_resets": StoreUnavailableError("connection lost")})

    with pytest.raises(StoreUnavailableError):
        sweeper.sweep(_host(queue), lambda turn: None)
