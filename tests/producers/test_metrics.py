"""A producer's own counters (producers/metrics.py): at 0 from its start, then publish retries and durable fallbacks.

They live in prometheus_client's default registry, shared by the whole test process: each test reads how much a
counter moved, never its absolute value.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from producers import BrokerUnavailable, JuneProducer
from tests._services import closed_port

from .test_durable import db

__all__ = ["db"]  # the fixture, imported for pytest

pytestmark = pytest.mark.integration


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


@pytest.fixture
def down(redis_url: str) -> Iterator[JuneProducer]:
    """A producer whose broker nothing listens on: every send fails, after one more try."""
    broker = f"redis://127.0.0.1:{closed_port()}/0"
    with JuneProducer(redis_url, broker_url=broker, publish_timeout_s=0.5, publish_retries=1) as producer:
        yield producer


def test_the_counters_are_exposed_at_zero_as_soon_as_a_producer_exists(redis_url: str) -> None:
    # Given a producer, which has sent nothing
    with JuneProducer(redis_url):
        # Then every series of its counters is exposed (at 0 in a process where nothing failed yet)
        for messages in ("turn", "control"):
            assert value("june_producer_publish_retries_total", messages=messages) is not None
        for task in ("june.turn", "june.proactive"):
            assert value("june_producer_durable_fallbacks_total", task=task) is not None


def test_each_failed_try_that_another_follows_is_a_publish_retry(down: JuneProducer) -> None:
    # Given a producer that tries a send twice (publish_retries=1) to a broker that is down
    before = value("june_producer_publish_retries_total", messages="turn") or 0.0
    # When a turn cannot be sent
    with pytest.raises(BrokerUnavailable):
        down.start_turn("ops", "s-retries", "hello")
    # Then one retry is counted, under the turn messages
    assert value("june_producer_publish_retries_total", messages="turn") == before + 1


def test_a_durable_turn_the_broker_did_not_take_is_a_durable_fallback(redis_url: str, db: str) -> None:
    # Given a durable producer whose broker is down
    broker = f"redis://127.0.0.1:{closed_port()}/0"
    before = value("june_producer_durable_fallbacks_total", task="june.turn") or 0.0
    with JuneProducer(redis_url, broker_url=broker, database_url=db, publish_timeout_s=0.5, publish_retries=0) as p:
        # When a turn is recorded in Postgres but its message cannot be sent
        p.start_turn("ops", "s-fallback", "recorded only", durable=True)
    # Then it is counted as a fallback: the sweeper, not this call, sends it
    assert value("june_producer_durable_fallbacks_total", task="june.turn") == before + 1
