"""The isolation worker's queue (``june worker --turns-per-process``) belongs to the queue its workers serve."""

from __future__ import annotations

import pytest

from june_worker.worker.process import resend_target
from june_worker.worker.supervisor import isolation_queue


@pytest.mark.parametrize(
    ("env", "queues", "expected"),
    [
        ({}, None, "june.isolated"),
        ({"JUNE_QUEUE": "billing"}, None, "billing.isolated"),
        ({}, "june,june.control", "june.isolated"),
        ({"JUNE_ISOLATION_QUEUE": "mine"}, "billing", "mine"),
    ],
)
def test_the_isolation_queue_is_the_one_set_else_that_of_the_turn_queue(
    env: dict[str, str], queues: str | None, expected: str
) -> None:
    assert isolation_queue(env, queues) == expected


@pytest.mark.parametrize("queues", ["billing", "june.control,billing", " billing , june.control"])
def test_workers_started_on_a_queue_of_their_own_isolate_on_a_queue_of_their_own(queues: str) -> None:
    # Given workers of another queue than JUNE_QUEUE's (their agents, not the default queue's workers')
    # Then their isolation worker consumes a queue of theirs, not the default queue's isolation queue
    assert isolation_queue({"JUNE_QUEUE": "june"}, queues) == "billing.isolated"


# --- where a turn sent again goes (june_worker.worker.process.resend_target) ------------------------------


@pytest.mark.parametrize(
    ("consumed", "serves_agent", "expected", "who"),
    [
        (["billing"], True, "billing", "a worker of the turn's queue keeps it there"),
        (["june", "billing"], True, "billing", "a worker of several queues, the turn's among them"),
        (["june"], False, "billing", "a worker without the agent leaves it to the queue that serves it"),
        (["june"], True, "june", "a worker that serves the agent, not its queue, runs it on its own"),
        (["june.control", "june"], True, "june", "the control queue is not a turn queue"),
        (["june.control"], True, "june", "a control-only worker: JUNE_QUEUE"),
        (["billing.isolated"], True, "billing", "the isolation worker hands back to the queue it isolates for"),
    ],
)
def test_a_resent_turn_goes_to_its_queue_unless_this_worker_runs_its_agent_elsewhere(
    consumed: list[str], serves_agent: bool, expected: str, who: str
) -> None:
    got = resend_target(
        "billing",
        default="june",
        consumed=consumed,
        control="june.control",
        isolation="billing.isolated",
        serves_agent=serves_agent,
    )
    assert got == expected, who
