"""The isolation worker's queue (``june worker --turns-per-process``) belongs to the queue its workers serve."""

from __future__ import annotations

import pytest

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
