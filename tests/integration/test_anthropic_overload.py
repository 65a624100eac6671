"""One retry budget per model call, on a real worker process (issue 24, item 6).

A worker serving :mod:`.overload_agents` talks to a local stand-in of the Messages API
(:mod:`tests._anthropic_api`) that answers every request with ``529 overloaded`` and a ``retry-after``; the
stand-in counts what arrives. The worker's attempts (``JUNE_MAX_ATTEMPTS``) and the step's retries must not
multiply the adapter's budget.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from .._anthropic_api import AnthropicAPI, api_error
from .conftest import Stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def api() -> Iterator[AnthropicAPI]:
    with AnthropicAPI() as server:
        yield server


@pytest.fixture(scope="module")
def worker(stack: Stack, api: AnthropicAPI) -> Stack:
    env = {"JUNE_AGENTS": "tests.integration.overload_agents:ALL", "JUNE_IT_ANTHROPIC_URL": api.url}
    stack.worker("overload", env=env)
    return stack


def test_a_turn_against_an_overloaded_api_makes_max_retries_plus_one_requests_on_a_worker(
    worker: Stack, api: AnthropicAPI
) -> None:
    # Given an API that answers every request with a 529 (and a retry-after), and a model allowed two retries
    api.serve(*[api_error(529, "overloaded_529.json") for _ in range(80)])
    session = f"busy-{uuid.uuid4().hex[:10]}"
    # When a turn runs on a worker
    turn_id = worker.turn("overloaded", session, "hello")
    ended = worker.wait_terminal("overloaded", session, turn_id, timeout_s=60)
    # Then the model call was sent three times in all, and the turn failed on its first attempt saying why
    assert len(api.requests) == 3
    assert ended["type"] == "turn.failed" and ended["phase"] == "model"
    assert "gave up after 2 of 2 retries" in ended["error"]["message"]
    row = worker.turn_row("overloaded", session, turn_id)
    assert row is not None and (row["status"], row["attempts"]) == ("failed", 1)
