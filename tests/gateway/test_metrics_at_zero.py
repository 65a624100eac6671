"""The gateway's /metrics exposes its counters from the start, at 0: a panel shows 0 before the first request."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from june_worker.gateway import GatewaySettings, Principal, TokenTable, create_app

from .kit import ServedApp

TOKEN = f"metrics-token-{uuid.uuid4().hex}"


@pytest.fixture
def fresh_gateway(database_url: str, redis_url: str) -> Iterator[str]:
    settings = GatewaySettings(
        agents=("ops",), tokens=TokenTable.of({TOKEN: Principal("op-metrics", None, operator=True)}),
        database_url=database_url, redis_url=redis_url, key_prefix=f"june-metrics-{uuid.uuid4().hex[:8]}",
    )  # fmt: skip
    served = ServedApp(create_app(settings))
    try:
        yield served.url
    finally:
        served.stop()


def test_a_fresh_gateway_exposes_every_routes_request_counter_and_its_producers_counters_at_zero(
    fresh_gateway: str,
) -> None:
    # Given a gateway that has answered nothing yet
    # When /metrics is its first request
    text = httpx.get(f"{fresh_gateway}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    # Then each route's counter is there at 0, under its own success status, and so is its time histogram
    turns = (("method", "POST"), ("route", "/v1/agents/{agent}/sessions/{session}/turns"))
    assert samples[("june_gateway_requests_total", (*turns, ("status", "202")))] == 0
    assert samples[("june_gateway_request_duration_seconds_count", turns)] == 0
    pending = (("method", "GET"), ("route", "/v1/agents/{agent}/sessions/{session}/pending"), ("status", "200"))
    assert samples[("june_gateway_requests_total", pending)] == 0
    # and the counters of the producer it sends with
    assert ("june_producer_publish_retries_total", (("messages", "turn"),)) in samples
    assert ("june_producer_publish_retries_total", (("messages", "control"),)) in samples
    assert ("june_producer_durable_fallbacks_total", (("task", "june.turn"),)) in samples
