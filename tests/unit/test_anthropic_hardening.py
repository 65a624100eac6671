"""The Anthropic adapter through the engine, on recorded streams served by a local HTTP server.

Each test serves the real wire format (SSE) from :mod:`tests._anthropic_api` to the real SDK
client and runs a turn on SQLite: what the tools did, what was committed, what the SDK sent.
"""

from __future__ import annotations

from typing import Any

import pytest

from june_worker import Agent, Runtime, tool
from june_worker.engine.events import Failed, TurnEvent
from june_worker.engine.store import SessionRef
from june_worker.engine.types import AssistantMessage
from june_worker.models.anthropic import AnthropicModel
from june_worker.stores import SQLiteStore

from .._anthropic_api import AnthropicAPI, sse

pytest.importorskip("anthropic")


def order_agent(model: AnthropicModel, runs: list[dict[str, Any]]) -> Agent:
    @tool
    def create_order(item: str, qty: int = 1) -> dict[str, Any]:
        """Place an order for an item."""
        runs.append({"item": item, "qty": qty})
        return {"orderId": len(runs), "item": item, "qty": qty}

    return Agent(name="ops", model=model, instructions="You take orders.", tools=[create_order])


# --- a tool call cut off by max_tokens ------------------------------------------------------------------


async def test_a_tool_call_cut_off_by_max_tokens_never_runs_and_fails_the_model_step(
    api: AnthropicAPI, make_model: Any
) -> None:
    # Given a reply that ran out of tokens inside a tool call's JSON ({"item": "widget", "qty": 1 ... of 12)
    api.serve(sse("tool_use_max_tokens.sse"))
    store = SQLiteStore(":memory:")
    runs: list[dict[str, Any]] = []
    session = Runtime([order_agent(make_model(), runs)], store).session("ops", "s1")
    events: list[TurnEvent] = []
    session.observe(events.append)
    # When the turn runs
    result = await session.result(await session.start("Order 12 widgets", turn_id="t1"))
    # Then the call never ran, nothing of the reply was committed, and the turn failed in its model step
    assert runs == []
    assert isinstance(result, Failed) and (result.phase, result.step) == ("model", "model:1")
    assert "stopped abnormally — max_tokens" in result.error.message and "create_order" in result.error.message
    assert not any(isinstance(m, AssistantMessage) for m in store.load(SessionRef("ops", "s1")).messages)
    assert [e.type for e in events if e.type.startswith("action.")] == []
    store.close()
