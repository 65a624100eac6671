"""Agents routed to queues of their own: a turn sent again goes back to the queue it was sent on.

A deployment may send each agent to a queue of its own, served only by workers that load that agent
(``june worker -Q billing`` with the billing agents). Whoever re-sends a turn (here the sweeper, on a worker
of another queue) must send it to that queue: a worker of another queue does not serve its agent and would
reject it as unknown, an accepted turn lost. The queue is kept with the turn (``TurnPayload.queue``): the one a
durable producer chose, else the one the worker that recorded it received its message from.

The module's first worker consumes the first queue (the stack's ``JUNE_QUEUE``) and the control queue, so it
runs every sweep, and serves only ``echo``; each test starts workers of a second queue of its own that serve
only ``ops``. The broker's visibility timeout is long, so only the sweeper can bring back a lost message.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import pytest

from producers import JuneProducer
from tests._services import closed_port

from .conftest import Proc, Stack, wait_for

pytestmark = [pytest.mark.integration]

ONLY = {"JUNE_BROKER_VISIBILITY_S": "3600"}  # a message a dead worker held is not handed out again during a test
RECOVERY_S = 60.0  # a lease (2 s) and a sweep period (0.5 s), on a loaded machine


@pytest.fixture(scope="module", autouse=True)
def first_queue(stack: Stack) -> Iterator[Proc]:
    """The first queue's worker: ``echo`` only, on the stack's turn queue and its control queue (it sweeps)."""
    worker = stack.worker("first", env={**ONLY, "JUNE_AGENTS": "tests.integration.agents:ECHO_ONLY"})
    stack.beat()
    yield worker


def _second_queue(stack: Stack, queue: str, name: str) -> Proc:
    """A worker of ``queue`` only, serving ``ops`` only."""
    env = {**ONLY, "JUNE_AGENTS": "tests.integration.agents:OPS_ONLY", "JUNE_QUEUE": queue}
    return stack.worker(name, queues=queue, env=env)


def _stored_queue(stack: Stack, session: str, turn_id: str) -> str | None:
    rows = stack.sql("select payload->>'queue' from june_turns where session = %s and turn_id = %s", session, turn_id)
    return rows[0][0] if rows else None


@pytest.mark.brokers("redis", "amqp")
def test_a_durable_turn_whose_message_was_lost_is_re_sent_by_another_queues_sweeper_to_its_own_queue(
    stack: Stack,
) -> None:
    # Given a worker of a second queue serving ops, and an ops turn a durable producer recorded for that queue
    # while the broker did not answer (its message never reached it)
    key = uuid.uuid4().hex[:6]
    queue, session = f"{stack.queue}.billing-{key}", f"lost-{key}"
    second = _second_queue(stack, queue, f"second-{key}")
    down = f"redis://127.0.0.1:{closed_port()}/0" if stack.broker == "redis" else f"amqp://127.0.0.1:{closed_port()}//"
    producer = JuneProducer(
        stack.events_url,
        broker_url=down,
        queue=queue,
        control_queue=stack.control_queue,
        key_prefix=stack.prefix,
        database_url=stack.db_url,
        durable=True,
        publish_timeout_s=0.5,
        publish_retries=0,
    )
    with contextlib.closing(producer):
        turn_id = producer.start_turn("ops", session, "order 4 gear")
    try:
        # When the sweeper, on the first queue's worker (which does not serve ops), finds it stranded and sends it
        end = stack.wait_terminal("ops", session, turn_id, timeout_s=RECOVERY_S)
    finally:
        second.stop()
    # Then it went to the second queue, whose worker ran it: completed once, not rejected as an unknown agent
    assert end["type"] == "turn.completed", end
    assert (stack.turn_row("ops", session, turn_id) or {}).get("status") == "completed"
    assert stack.sql("select qty from it_orders where turn_id = %s", turn_id) == [(4,)]
    assert turn_id in second.log.read_text(errors="replace")
    assert _stored_queue(stack, session, turn_id) == queue  # the producer's choice, kept with the turn


def test_a_turn_whose_worker_died_mid_turn_is_re_sent_by_another_queues_sweeper_to_the_queue_it_came_from(
    stack: Stack,
) -> None:
    # Given an ops turn sent (without durable) to a second queue, recorded by that queue's worker, which is
    # SIGKILLed in the middle of the turn (its message stays with the dead worker: the broker does not hand it out)
    key = uuid.uuid4().hex[:6]
    queue, session = f"{stack.queue}.billing-{key}", f"killed-{key}"
    doomed = _second_queue(stack, queue, f"doomed-{key}")
    turn_id = f"t_{uuid.uuid4().hex}"
    stack.send(
        "june.turn", {"turn_id": turn_id, "agent": "ops", "session": session, "text": f"slow {key}"}, queue=queue
    )
    wait_for(lambda: stack.redis.llen(f"it:hold:{key}:log") == 1, what="the tool to start on the doomed worker")
    doomed.kill()
    rescuer = _second_queue(stack, queue, f"rescuer-{key}")
    try:
        # When its lease lapses and the sweeper, on the first queue's worker, sends it again
        end = stack.wait_terminal("ops", session, turn_id, timeout_s=RECOVERY_S)
    finally:
        rescuer.stop()
    # Then the second queue's other worker finished it
    assert end["type"] == "turn.completed", end
    assert stack.redis.lrange(f"it:hold:{key}:log", 0, -1)[1].endswith(":2")
    assert turn_id in rescuer.log.read_text(errors="replace")
    assert _stored_queue(stack, session, turn_id) == queue  # learned from the delivery of its first message


def test_a_child_turn_and_its_parents_wake_go_to_the_queue_of_the_parent_not_the_workers_default(
    stack: Stack,
) -> None:
    # Given workers started on a second queue (-Q only: their JUNE_QUEUE is still the first queue's) serving a
    # parent agent and its subagent
    key = uuid.uuid4().hex[:6]
    queue, session = f"{stack.queue}.desk-{key}", f"family-{key}"
    env = {**ONLY, "JUNE_AGENTS": "tests.integration.agents:BOSS_AND_SCOUT"}
    second = stack.worker(f"family-{key}", queues=queue, concurrency=2, env=env)
    ended = ("turn.completed", "turn.failed", "turn.cancelled")

    def parent_end() -> dict[str, object] | None:  # (it parks on its child first: the child's end wakes it)
        return next(
            (e for e in stack.structural("boss", session) if e["turn_id"] == turn_id and e["type"] in ended), None
        )

    try:
        # When a parent turn sent to that queue delegates to the subagent and waits for its child turn
        turn_id = f"t_{uuid.uuid4().hex}"
        payload = {"turn_id": turn_id, "agent": "boss", "session": session, "text": f"delegate 1 {key}"}
        stack.send("june.turn", payload, queue=queue)
        end = wait_for(parent_end, timeout_s=RECOVERY_S, what="the parent to end")
    finally:
        second.stop()
    # Then the child ran on the second queue (not on the first queue's worker, which serves neither), and the
    # parent, woken there, completed with its result
    assert end["type"] == "turn.completed", end
    children = stack.sql("select agent, status, payload->>'queue' from june_turns where agent = 'scout'")
    assert [c for c in children if c[2] == queue] == [("scout", "completed", queue)], children
