"""Write the golden files from a real run: ``python -m tests.golden.regenerate [v1|v2]``.

Only regenerate on purpose: the point of the files is that rows stored by an older version
keep loading (and resuming) in a newer one. Add new files beside old ones; never rewrite
a file to make a test pass.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from june_worker import Agent, Runtime, ToolContext, tool
from june_worker.engine.store import SessionRef
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import SQLiteStore

HERE = Path(__file__).parent


@tool
def create_order(ctx: ToolContext, item: str, qty: int = 1) -> dict[str, Any]:
    """Place an order for an item."""
    return {"orderId": 1, "item": item, "qty": qty}


@tool
async def issue_refund(ctx: ToolContext, order_id: str, amount: float) -> dict[str, Any]:
    """Refund an order once a human approves it."""
    ok = await ctx.request_input(
        id="approve-refund", prompt=f"Refund {amount} on {order_id}?", schema={"type": "boolean"}
    )
    return {"refunded": ok is True}


SCRIPT = [
    Reply("Placing your order.", calls=[{"id": "c1", "name": "create_order", "input": {"item": "widget", "qty": 3}}]),
    Reply(
        "Ordered. Now the refund.",
        calls=[{"id": "c2", "name": "issue_refund", "input": {"order_id": "42", "amount": 5}}],
        reasoning="needs approval",
    ),
    Reply("Refund sent."),
]


async def main() -> None:
    store = SQLiteStore(":memory:")
    rt = Runtime([Agent(name="ops", model=ScriptedModel(SCRIPT), tools=[create_order, issue_refund])], store)
    s = rt.session("ops", "s1")
    event = {"source": "slack", "kind": "message", "user": {"id": "U1", "attested": True}, "principal": {"id": "A"}}
    await s.start("Order 3 widgets and refund order 42", turn_id="t1", event=event)
    await s.result("t1")
    ref = SessionRef("ops", "s1")
    snap = store.load(ref)
    parked = {
        "messages": [m.model_dump(mode="json") for m in snap.messages],
        "steps": [st.model_dump(mode="json") for st in snap.steps.values()],
        "suspended": snap.suspended.model_dump(mode="json", by_alias=True) if snap.suspended else None,
        "turn": store.get_turn(ref, "t1").model_dump(mode="json", by_alias=True),  # type: ignore[union-attr]
        "events": [e.model_dump(mode="json", by_alias=True) for e in store.events(ref)],
    }
    (HERE / "v1_parked_session.json").write_text(json.dumps(parked, indent=1, ensure_ascii=False) + "\n")
    await s.resume("t1", "approve-refund", True, by="U1")
    await s.result("t1")
    done = {
        "events": [e.model_dump(mode="json", by_alias=True) for e in store.events(ref)],
        "turn": store.get_turn(ref, "t1").model_dump(mode="json", by_alias=True),  # type: ignore[union-attr]
    }
    (HERE / "v1_completed_turn.json").write_text(json.dumps(done, indent=1, ensure_ascii=False) + "\n")


async def compacted() -> None:
    """v2: a session compacted by its context policy (a summary message, a compact step, context.compacted)."""
    from tests.unit.kit import WindowModel

    store = SQLiteStore(":memory:")
    rt = Runtime([Agent(name="ops", model=WindowModel(2000, extra_tokens=1500))], store)
    s = rt.session("ops", "s1")
    await s.turn("hello", turn_id="t1")
    await s.turn("x" * 300, turn_id="t2")
    ref = SessionRef("ops", "s1")
    snap = store.load(ref)
    data = {
        "messages": [m.model_dump(mode="json") for m in snap.messages],
        "steps": [st.model_dump(mode="json") for st in snap.steps.values()],
        "turn": store.get_turn(ref, "t2").model_dump(mode="json", by_alias=True),  # type: ignore[union-attr]
        "events": [e.model_dump(mode="json", by_alias=True) for e in store.events(ref)],
    }
    (HERE / "v2_compacted_session.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    import sys

    asyncio.run(compacted() if sys.argv[1:] == ["v2"] else main())
