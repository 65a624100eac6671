"""The two wait histograms on a real worker's ``/metrics``: the queue wait and the input (approval) wait.

``june_turn_queue_wait_seconds`` counts from the ``sent_at`` a producer put into ``june.turn`` (else from the
turn's record) to the worker opening the turn, once per turn: a re-send or a resume is no new wait.
``june_input_wait_seconds`` counts from the park (``june_sessions.parked_at``) to the answer applied. Both are
exposed at 0, per agent served, before any turn.

Fails on main (fec4082): neither histogram exists, and ``sent_at`` in a ``june.turn`` is refused as an unknown field.
"""

from __future__ import annotations

import time
import uuid

import pytest

from june_wire.ids import SENT_AT_HEADER

from .conftest import Proc, Stack, wait_for
from .test_metrics import Samples, _free_port, scrape

pytestmark = pytest.mark.integration

QUEUE_WAIT = "june_turn_queue_wait_seconds"
INPUT_WAIT = "june_input_wait_seconds"


@pytest.fixture(scope="module")
def worker(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> tuple[Proc, int]:
    stack.env["JUNE_AGENTS"] = "tests.integration.agents:ALL,tests.integration.observe_agents:ALL"
    port = _free_port()
    env = {"JUNE_METRICS_PORT": str(port), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path_factory.mktemp("wait-metrics"))}
    return stack.worker("wait-metrics", concurrency=1, env=env), port


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample of ``name`` with exactly these labels (None: not exposed)."""
    return samples.get(name, {}).get(tuple(sorted(labels.items())))


def scraped_when(port: int, name: str, expected: float, what: str, **labels: str) -> Samples:
    """The worker's samples once ``name`` with ``labels`` reads ``expected``."""

    def reached() -> Samples | None:
        samples = scrape(port)
        return samples if value(samples, name, **labels) == expected else None

    return wait_for(reached, timeout_s=30, every_s=0.5, what=what)


def test_both_wait_histograms_are_exposed_at_zero_before_any_turn(worker: tuple[Proc, int]) -> None:
    # Given a worker that has run nothing yet; When its /metrics is scraped
    samples = scrape(worker[1])
    # Then each wait histogram has a series per agent served (and per ending, for inputs), counting 0
    assert value(samples, f"{QUEUE_WAIT}_count", agent="metered") == 0
    for outcome in ("answered", "timed_out"):
        assert value(samples, f"{INPUT_WAIT}_count", agent="metered", outcome=outcome) == 0
        assert value(samples, f"{INPUT_WAIT}_bucket", agent="metered", outcome=outcome, le="+Inf") == 0


def test_the_queue_wait_counts_from_the_producers_sent_at_once_per_turn(stack: Stack, worker: tuple[Proc, int]) -> None:
    port = worker[1]
    before = scrape(port)
    count0 = value(before, f"{QUEUE_WAIT}_count", agent="metered") or 0.0
    sum0 = value(before, f"{QUEUE_WAIT}_sum", agent="metered") or 0.0
    # Given a turn its producer sent two minutes ago (it waited in the broker that long), stamped in its header
    session = f"qw-{uuid.uuid4().hex[:10]}"
    sent_at = time.time() - 120
    turn_id = f"t_{uuid.uuid4().hex}"
    payload = {"turn_id": turn_id, "agent": "metered", "session": session, "text": "hello"}
    stack.send("june.turn", payload, headers={SENT_AT_HEADER: repr(sent_at)})
    assert stack.wait_terminal("metered", session, turn_id)["type"] == "turn.completed"
    # When the same turn is sent again (as the sweeper re-sends one, its stamp in the payload), and a second one comes
    # from a producer
    stack.turn("metered", session, "hello", turn_id=turn_id, sent_at=sent_at)
    with stack.producer() as producer:
        second = producer.start_turn("metered", session, "hello")
    assert stack.wait_terminal("metered", session, second)["type"] == "turn.completed"
    # Then two waits were observed (the re-send is none), the first at least its two minutes in the queue
    samples = scraped_when(port, f"{QUEUE_WAIT}_count", count0 + 2, "the queue wait of both turns", agent="metered")
    assert (value(samples, f"{QUEUE_WAIT}_sum", agent="metered") or 0.0) - sum0 >= 120
    assert value(samples, f"{QUEUE_WAIT}_bucket", agent="metered", le="600.0") == count0 + 2
    assert (
        value(samples, f"{QUEUE_WAIT}_bucket", agent="metered", le="60.0")
        == (value(before, f"{QUEUE_WAIT}_bucket", agent="metered", le="60.0") or 0.0) + 1
    )  # the producer's turn: it waited seconds at most


def test_the_input_wait_counts_from_the_park_to_the_answer_and_a_resume_is_no_queue_wait(
    stack: Stack, worker: tuple[Proc, int]
) -> None:
    port = worker[1]
    # Given a turn parked on an answer, parked ten minutes ago (by the database's stamp)
    session = f"iw-{uuid.uuid4().hex[:10]}"
    turn_id = stack.turn("metered", session, "ask", sent_at=time.time())
    assert stack.wait_terminal("metered", session, turn_id)["type"] == "input.requested"
    stack.sql("update june_sessions set parked_at = parked_at - 600 where agent = 'metered' and session = %s", session)
    before = scrape(port)
    answered0 = value(before, f"{INPUT_WAIT}_count", agent="metered", outcome="answered") or 0.0
    queued0 = value(before, f"{QUEUE_WAIT}_count", agent="metered")
    # When it is answered and the turn goes on to its end
    payload = {"agent": "metered", "session": session, "turn_id": turn_id, "input_id": "confirm", "value": True}
    assert stack.send("june.resume", {**payload, "by": "op-1"}).get(timeout=60)["status"] == "accepted"
    wait_for(
        lambda: any(e["type"] == "turn.completed" for e in stack.events("metered", session)),
        timeout_s=60,
        what="the answered turn to complete",
    )
    # Then one answered wait of at least those ten minutes is counted, and the resumed run is no new queue wait
    samples = scraped_when(
        port, f"{INPUT_WAIT}_count", answered0 + 1, "the answered input wait", agent="metered", outcome="answered"
    )
    waited = (value(samples, f"{INPUT_WAIT}_sum", agent="metered", outcome="answered") or 0.0) - (
        value(before, f"{INPUT_WAIT}_sum", agent="metered", outcome="answered") or 0.0
    )
    assert 600 <= waited < 3600
    assert value(samples, f"{QUEUE_WAIT}_count", agent="metered") == queued0
    assert value(samples, f"{INPUT_WAIT}_count", agent="metered", outcome="timed_out") == 0


def test_a_park_timeout_counts_as_a_timed_out_input_wait_from_the_park(stack: Stack, worker: tuple[Proc, int]) -> None:
    port = worker[1]
    # Given a turn parked on a request with a timeout, parked (and so expired) ten minutes ago by the database's stamps
    session = f"to-{uuid.uuid4().hex[:10]}"
    parked = stack.turn("ops", session, "quick")
    assert stack.wait_terminal("ops", session, parked)["type"] == "input.requested"
    stack.sql(
        "update june_sessions set parked_at = parked_at - 600, park_expires_at = park_expires_at - 600"
        " where agent = 'ops' and session = %s",
        session,
    )
    before = scrape(port)
    timed_out0 = value(before, f"{INPUT_WAIT}_count", agent="ops", outcome="timed_out") or 0.0
    # When the next turn of the session comes (its intake applies the timeout: no sweeper runs here)
    stack.turn("ops", session, "hello")
    # Then one timed-out wait of at least those ten minutes is counted, and no answered one
    samples = scraped_when(
        port, f"{INPUT_WAIT}_count", timed_out0 + 1, "the timed-out input wait", agent="ops", outcome="timed_out"
    )
    waited = (value(samples, f"{INPUT_WAIT}_sum", agent="ops", outcome="timed_out") or 0.0) - (
        value(before, f"{INPUT_WAIT}_sum", agent="ops", outcome="timed_out") or 0.0
    )
    assert 600 <= waited < 3600
    assert value(samples, f"{INPUT_WAIT}_count", agent="ops", outcome="answered") == value(
        before, f"{INPUT_WAIT}_count", agent="ops", outcome="answered"
    )
