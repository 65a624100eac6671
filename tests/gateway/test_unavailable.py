"""When Redis or Postgres does not answer: /healthz says 503, routes answer 503 with a sentence, never a traceback."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from june_worker.gateway import create_app
from tests._services import closed_port

from .conftest import settings_for
from .kit import Gateway, ServedApp


@pytest.fixture
def broken(gateway: Gateway, request: pytest.FixtureRequest) -> Iterator[str]:
    down = {"redis": {"redis_url": f"redis://127.0.0.1:{closed_port()}/0"},
            "redis-cluster": {"redis_url": f"redis+cluster://127.0.0.1:{closed_port()}"},
            "postgres": {"database_url": f"postgresql://postgres@127.0.0.1:{closed_port()}/none"}}[request.param]  # fmt: skip
    served = ServedApp(create_app(settings_for(gateway.stack, gateway.app.state.settings.tokens, **down)))
    try:
        yield served.url
    finally:
        served.stop()


@pytest.mark.parametrize("broken", ["redis", "redis-cluster", "postgres"], indirect=True)
def test_a_service_that_does_not_answer_is_503(gateway: Gateway, broken: str, request: pytest.FixtureRequest) -> None:
    which = request.node.callspec.params["broken"].removesuffix("-cluster")
    health = httpx.get(f"{broken}/healthz", timeout=30)
    assert health.status_code == 503 and health.json()[which] == "unavailable"
    r = httpx.get(f"{broken}{gateway.path('ops', 's1', '/pending')}", headers=gateway.auth(), timeout=30)
    assert r.status_code == 503
    expected = "the event store is unavailable" if which == "redis" else "the database is unavailable"
    assert r.json() == {"detail": f"{expected}; retry later"}


@pytest.mark.parametrize("broken", ["redis", "redis-cluster"], indirect=True)
def test_the_console_feed_says_the_event_store_is_unavailable_when_redis_does_not_answer(
    gateway: Gateway, broken: str
) -> None:
    headers = {**gateway.auth("admin"), "Accept": "text/event-stream"}
    with httpx.stream("GET", f"{broken}/v1/console/events", headers=headers, timeout=30) as feed:
        assert feed.status_code == 200
        lines = list(feed.iter_lines())
    assert ": event store unavailable; reconnect" in lines


def test_a_reset_no_control_worker_answers_in_time_is_504_saying_it_was_withdrawn(gateway: Gateway) -> None:
    # Given a session, and a gateway whose control queue no worker serves
    session = f"s-{uuid.uuid4().hex[:12]}"
    made = gateway.client().post(gateway.path("ops", session, "/turns"), json={"text": "hello"}, params={"wait": 1})
    assert made.status_code == 200, made.text
    unserved = f"{gateway.stack.control_queue}.unserved-{uuid.uuid4().hex[:8]}"
    settings = settings_for(
        gateway.stack, gateway.app.state.settings.tokens, control_queue=unserved, control_timeout_s=2.0
    )
    served = ServedApp(create_app(settings))
    try:
        # When it is asked to reset the session
        r = httpx.post(f"{served.url}{gateway.path('ops', session, '/reset')}", headers=gateway.auth(), timeout=30)
    finally:
        served.stop()
        gateway.stack.redis.delete(unserved)
    # Then it answers 504: the reset expired unanswered and will not happen later
    assert r.status_code == 504
    assert r.json() == {"detail": "no june worker answered in time; the message was withdrawn and will not run"}
