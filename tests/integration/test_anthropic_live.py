"""One real call to Anthropic's API: a two-step tool turn (model → tool → model) through the Runtime.

Opt-in: skipped unless ``ANTHROPIC_API_KEY`` is set (``ANTHROPIC_MODEL`` picks another model).
Run it alone with ``pytest -m live``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from june_worker import Agent, Runtime, tool
from june_worker.engine.events import Completed
from june_worker.engine.store import SessionRef
from june_worker.engine.types import AssistantMessage, ToolMessage
from june_worker.stores import SQLiteStore

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(not os.environ.get("ANTHROPIC_API_KEY"), reason="ANTHROPIC_API_KEY is not set"),
]


async def test_a_two_step_tool_turn_runs_against_the_real_api() -> None:
    pytest.importorskip("anthropic")
    from june_worker.models.anthropic import AnthropicModel

    calls: list[dict[str, Any]] = []

    @tool
    def add(a: int, b: int) -> dict[str, Any]:
        """Add two integers and return their sum."""
        calls.append({"a": a, "b": b})
        return {"sum": a + b}

    model = AnthropicModel.from_env(max_tokens=1024)
    agent = Agent(
        name="calc",
        model=model,
        instructions="You are a calculator. Always use the add tool for additions; never add numbers yourself.",
        tools=[add],
    )
    store = SQLiteStore(":memory:")
    try:
        session = Runtime([agent], store).session("calc", "live")
        result = await session.result(await session.start("What is 1234 + 4321? Use the add tool.", turn_id="t1"))
        assert isinstance(result, Completed), result
        assert "5555" in result.text.replace(",", "")
        assert calls and calls[0] == {"a": 1234, "b": 4321}
        messages = store.load(SessionRef("calc", "live")).messages
        assert isinstance(messages[1], AssistantMessage) and messages[1].tool_calls
        assert any(isinstance(m, ToolMessage) for m in messages)
        assert isinstance(messages[-1], AssistantMessage) and not messages[-1].tool_calls
        assert result.usage is not None and result.usage.input_tokens > 0 and result.usage.output_tokens > 0
    finally:
        await model.aclose()
        store.close()
