"""The demo agent, run in process on SQLite: ``june demo`` (or ``make demo``).

No server and no API key: a scripted model plays the assistant. With ``ANTHROPIC_API_KEY``
set (and the ``anthropic`` extra installed) the same agent runs on Claude instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from .engine import Agent, Runtime, ToolContext, tool
from .engine.agent import AnswerRequest
from .engine.events import (
    ActionCompleted,
    ActionRequested,
    InputRequested,
    MessageCompleted,
    MessageDelta,
    TurnCancelled,
    TurnCompleted,
    TurnEvent,
    TurnFailed,
    TurnStarted,
)
from .engine.model import Model, ModelRequest
from .engine.types import ProactiveTrigger, ToolMessage, TriggerMessage, UserMessage
from .models.scripted import Reply, ScriptedModel
from .stores.sqlite import SQLiteStore

__all__ = ["build_agent", "main", "render"]

DEMO_APPROVER = "U024BE7LH"
INSTRUCTIONS = """You are the operations assistant of a small shop.
Place orders with create_order. Refunds need a human's approval: use issue_refund."""


@tool
def create_order(ctx: ToolContext, item: str, qty: int = 1) -> dict[str, Any]:
    """Place an order for an item. Exactly once: the row commits with the step."""
    ctx.store.execute("create table if not exists orders (id integer primary key, item text not null, qty integer)")
    ctx.store.execute("insert into orders (item, qty) values (?, ?)", item, qty)
    (order_id,) = ctx.store.query("select max(id) from orders")[0]
    return {"order_id": order_id, "item": item, "qty": qty}


@tool
async def issue_refund(ctx: ToolContext, order_id: str, amount: float) -> dict[str, Any]:
    """Refund an order once a human approves it."""
    approved = await ctx.request_input(
        id="approve-refund",
        prompt=f"Refund ${amount:.2f} on order {order_id}?",
        schema={"type": "boolean"},
        answerers={"policy": "refund-approver"},
    )
    # The side effect goes after the answer: everything before request_input runs again on resume.
    return {"refunded": approved is True, "order_id": order_id}


def _script(request: ModelRequest) -> Reply:
    """Decide from the transcript alone, so a replay gets the same reply."""
    last = request.messages[-1]
    if isinstance(last, ToolMessage):
        if last.name == "create_order":
            r = last.result
            return Reply(f"Done: order #{r['order_id']} for {r['qty']} x {r['item']} is placed.")
        if last.result.get("refunded"):
            return Reply(f"The refund on order {last.result['order_id']} was approved and sent.")
        return Reply("The refund was not approved, so nothing was sent.")
    text = last.text.lower() if isinstance(last, (UserMessage, TriggerMessage)) else ""
    if "refund" in text:
        order = next((w for w in text.split() if w.isdigit()), "42")
        call = {"id": "call_refund", "name": "issue_refund", "input": {"order_id": order, "amount": 19.5}}
        return Reply(f"I'll ask for approval to refund order {order}.", calls=[call])
    if "order" in text:
        qty = next((int(w) for w in text.split() if w.isdigit()), 1)
        call = {"id": "call_order", "name": "create_order", "input": {"item": "widget", "qty": qty}}
        return Reply(f"Placing an order for {qty} widgets.", calls=[call])
    return Reply("I can place orders and refund them. Try: 'Order 3 widgets'.")


def build_model() -> Model:
    if os.environ.get("ANTHROPIC_API_KEY"):
        from .models.anthropic import AnthropicModel

        return AnthropicModel.from_env()
    return ScriptedModel(_script, delay_s=0.02)


def approvers() -> set[str]:
    """Who may approve refunds: ``JUNE_DEMO_APPROVERS`` (comma-separated ids), by default one demo user."""
    return {a.strip() for a in os.environ.get("JUNE_DEMO_APPROVERS", DEMO_APPROVER).split(",") if a.strip()}


def authorize_answer(request: AnswerRequest) -> bool:
    """The app's rule for ``{"policy": "refund-approver"}`` requests."""
    return request.policy == "refund-approver" and request.by in approvers()


def build_agent(model: Model | None = None) -> Agent:
    return Agent(
        name="ops",
        model=model or build_model(),
        instructions=INSTRUCTIONS,
        tools=[create_order, issue_refund],
        authorize_answer=authorize_answer,
    )


def render(event: TurnEvent, out: TextIO = sys.stdout) -> None:
    """Print one event the way a person watching a turn wants to see it."""
    if isinstance(event, MessageDelta):
        out.write(event.text)
    elif isinstance(event, MessageCompleted):
        out.write("\n")
    elif isinstance(event, ActionRequested):
        out.write(f"  -> {event.call.name} {json.dumps(event.call.input)}\n")
    elif isinstance(event, ActionCompleted):
        shown = f"error: {event.error}" if event.error else json.dumps(event.result)
        out.write(f"  <- {event.call.name} {shown}\n")
    elif isinstance(event, InputRequested):
        out.write(f"  .. parked, waiting for a human: {event.request.prompt}\n")
    elif isinstance(event, TurnStarted):
        trigger = event.trigger
        how = f"proactive, by {trigger.by}" if isinstance(trigger, ProactiveTrigger) else trigger.kind
        out.write(f"[{event.turn_id}] started ({how})\n")
    elif isinstance(event, TurnCompleted):
        out.write(f"[{event.turn_id}] completed\n")
    elif isinstance(event, TurnFailed):
        out.write(f"[{event.turn_id}] failed: {event.error.message}\n")
    elif isinstance(event, TurnCancelled):
        out.write(f"[{event.turn_id}] cancelled ({event.reason})\n")
    out.flush()


async def run_demo(db_path: Path, out: TextIO = sys.stdout) -> int:
    db_path.parent.mkdir(parents=True, exist_ok=True)
    store = SQLiteStore(db_path)
    runtime = Runtime([build_agent()], store)
    session = runtime.session("ops", f"demo-{int(time.time())}")
    session.observe(lambda e: render(e, out))
    out.write(f"june-worker demo: agent 'ops', session '{session.session_id}', store {db_path}\n\n")

    first = await session.start("Order 3 widgets")
    await session.result(first)

    out.write("\n")
    turn_id = await session.start("Please refund order 42")
    parked = await session.result(turn_id)
    if parked.status == "suspended":
        out.write(f"  (the turn is parked in {db_path}; approver {DEMO_APPROVER} answers: yes)\n")
        await session.resume(turn_id, parked.request.id, True, by=DEMO_APPROVER)
        await session.result(turn_id)

    def orders() -> int:
        return int(store._conn.execute("select count(*) from orders").fetchone()[0])

    before = orders()
    out.write(f"\nDelivering turn {first} again (as a broker would after a crash):\n")
    await session.start("Order 3 widgets", turn_id=first)
    again = await session.result(first)
    out.write(f"  same result ({again.status}), orders table still has {orders()} row(s) (was {before})\n")
    await runtime.aclose()
    store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    path = Path(argv[0]) if argv else Path(".june") / "demo.db"
    return asyncio.run(run_demo(path))
