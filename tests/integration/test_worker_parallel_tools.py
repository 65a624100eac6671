"""Parallel async tool calls on real workers (issue 17): a batch runs together in one worker process, each
call's result commits as it finishes, and a worker killed mid-batch re-runs only the calls whose results
had not committed.

The ``fan`` agent (tests/integration/agents.py) asks for n async calls at once; on their first run the
even-numbered ones wait until this test kills the process, the odd-numbered ones return at once.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from june_worker.stores.postgres import PostgresStore

from .conftest import Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.modes("prefork", "threads")]


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> None:
    PostgresStore(stack.db_url).close()  # the schema, before the test reads it
    stack.worker("parallel", concurrency=1)
    stack.beat()


def _log(stack: Stack, key: str) -> list[tuple[int, str, int]]:
    entries = stack.redis.lrange(f"it:fan:{key}:log", 0, -1)
    return [(int(pid), what, int(i)) for pid, what, i in (e.split(":") for e in entries)]


def _runs(stack: Stack, key: str, n: int) -> list[int]:
    return [int(stack.redis.get(f"it:fan:{key}:{i}") or 0) for i in range(1, n + 1)]


def test_a_batch_runs_together_and_a_worker_killed_mid_batch_reruns_only_the_calls_not_committed(
    stack: Stack,
) -> None:
    key, session = uuid.uuid4().hex[:8], f"fan-{uuid.uuid4().hex[:8]}"
    # Given a turn whose model asks for six async calls at once
    turn_id = stack.turn("fan", session, f"fan 6 {key}")

    # When all six have started in one process and the three odd ones have committed their results
    def committed() -> set[str]:
        rows = stack.sql("select step_id from june_steps where session = %s and step_id like 'tool:%%'", session)
        return {step.rsplit(":", 1)[1] for (step,) in rows}

    wait_for(lambda: committed() == {"c1", "c3", "c5"}, timeout_s=30, what="the odd calls to commit")
    first = _log(stack, key)
    starts = [(pid, i) for pid, what, i in first if what == "start"]
    assert sorted(i for _, i in starts) == [1, 2, 3, 4, 5, 6]
    assert len({pid for pid, _ in starts}) == 1
    # ... all six were running before any ended: they ran together, not one after another
    first_end = next(n for n, (_, what, _) in enumerate(first) if what == "end")
    assert first_end >= 6
    # only c1's result is in the transcript: c3's and c5's wait there behind c2's, in call order
    in_transcript = "select body->>'call_id' from june_messages where session = %s and role = 'tool' order by idx"
    assert stack.sql(in_transcript, session) == [("c1",)]
    # and the worker process is killed while the even ones still wait
    os.kill(starts[0][0], signal.SIGKILL)

    # Then the turn completes on another process, the odd calls having run once and the even ones twice
    ended = stack.wait_terminal("fan", session, turn_id, timeout_s=60)
    assert ended["type"] == "turn.completed"
    assert _runs(stack, key, 6) == [1, 2, 1, 2, 1, 2]
    # the model read the six results in call order, each from the run that committed it
    assert ended["text"] == "fanned: " + str([{"i": i, "run": 1 if i % 2 else 2} for i in range(1, 7)])
    assert [c for (c,) in stack.sql(in_transcript, session)] == [f"c{i}" for i in range(1, 7)]
    # and the stream tells each call's result once
    completed = [e["call"]["id"] for e in stack.structural("fan", session) if e["type"] == "action.completed"]
    assert sorted(completed) == [f"c{i}" for i in range(1, 7)]
    requested = [e for e in stack.structural("fan", session) if e["type"] == "action.requested"]
    assert {tuple(e["batch"]) for e in requested} == {tuple(f"c{i}" for i in range(1, 7))}
