"""The shared fixtures of ../shared/scenarios.md: scripts, tools, models and a recorder."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from june_worker import Agent, Runtime, ToolContext, tool
from june_worker.engine.events import TurnEvent
from june_worker.engine.model import Done, ModelDelta, ModelRequest, TextChunk
from june_worker.engine.store import SessionStore
from june_worker.engine.tools import Tool
from june_worker.engine.types import Finish, ModelReply, UserMessage
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import MemoryStore, SQLiteStore

ORDER_SCRIPT = [
    Reply("Placing your order.", calls=[{"id": "c1", "name": "create_order", "input": {"item": "widget", "qty": 3}}]),
    Reply("Done — order placed."),
]

APPROVE_SCRIPT = [
    Reply("Let me check.", calls=[{"id": "c1", "name": "approve", "input": {}}]),
    Reply("Approved — refund sent."),
]

SLACK_EVENT: dict[str, Any] = {
    "source": "slack",
    "kind": "message",
    "channelId": "C1",
    "ts": "1.1",
    "user": {"id": "U1", "attested": True},
}


@dataclass
class Counter:
    runs: int = 0
    seen: list[Any] = field(default_factory=list)


def order_tool(counter: Counter | None = None) -> Tool:
    """create_order, sync: writes an ``orders`` row through the step's transaction (SQL stores)."""
    counter = counter if counter is not None else Counter()

    @tool
    def create_order(ctx: ToolContext, item: str, qty: int = 1) -> dict[str, Any]:
        """Place an order for an item."""
        counter.runs += 1
        ctx.store.execute("create table if not exists orders (item text, qty integer)")  # portable SQL
        ctx.store.execute("insert into orders (item, qty) values (?, ?)", item, qty)
        (count,) = ctx.store.query("select count(*) from orders")[0]
        return {"orderId": count, "item": item, "qty": qty}

    return create_order


def list_order_tool(orders: list[dict[str, Any]], counter: Counter | None = None) -> Tool:
    """create_order for the memory store: appends to a Python list (no transaction, no rollback)."""
    counter = counter if counter is not None else Counter()

    @tool
    def create_order(item: str, qty: int = 1) -> dict[str, Any]:
        """Place an order for an item."""
        counter.runs += 1
        orders.append({"item": item, "qty": qty})
        return {"orderId": len(orders), "item": item, "qty": qty}

    return create_order


def approve_tool(counter: Counter | None = None, input_id: str = "approve-1") -> Tool:
    counter = counter if counter is not None else Counter()

    @tool
    async def approve(ctx: ToolContext) -> dict[str, Any]:
        """Ask a human to approve the refund."""
        counter.runs += 1
        answer = await ctx.request_input(id=input_id, prompt="Approve the refund?")
        return {"approved": answer}

    return approve


def ask_tool(input_id: str, key: str = "ok", prompt: str = "?") -> Tool:
    @tool
    async def ask(ctx: ToolContext) -> dict[str, Any]:
        """Ask a human."""
        return {key: await ctx.request_input(id=input_id, prompt=prompt)}

    return ask


class Recorder:
    def __init__(self) -> None:
        self.events: list[TurnEvent] = []

    def __call__(self, event: TurnEvent) -> None:
        self.events.append(event)

    @property
    def types(self) -> list[str]:
        return [e.type for e in self.events]

    def of(self, type_: str) -> list[Any]:
        return [e for e in self.events if e.type == type_]


class DribblingModel:
    """First call: 1000 text deltas ~1 ms apart, then "stale answer"; later calls: "fresh answer" at once."""

    def __init__(self, stale: str = "stale answer", fresh: str = "fresh answer", deltas: int = 1000) -> None:
        self.calls = 0
        self.stale, self.fresh, self.deltas = stale, fresh, deltas

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        self.calls += 1
        if self.calls == 1:
            for _ in range(self.deltas):
                await asyncio.sleep(0.001)
                yield TextChunk(text="…")
            yield Done(reply=ModelReply(text=self.stale))
        else:
            yield Done(reply=ModelReply(text=self.fresh))


class FnModel:
    """A model from a plain async-generator function of the request."""

    def __init__(self, fn: Callable[[ModelRequest], AsyncIterator[ModelDelta]]) -> None:
        self.fn = fn
        self.calls = 0

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        self.calls += 1
        return self.fn(request)


def reply(text: str = "", finish: Finish | None = None, **kw: Any) -> Done:
    return Done(reply=ModelReply(text=text, **kw), finish=finish)


STORES = ["memory", "sqlite"]


POSTGRES_URL: list[str] = []
"""Set by tests/integration/test_engine_postgres.py: the URL (with its own schema) of the test's Postgres."""
OPENED: list[SessionStore] = []
"""Postgres stores made by :func:`make_store`, closed by the fixture that set :data:`POSTGRES_URL`."""


def make_store(kind: str, tmp_path: Any = None) -> SessionStore:
    if kind == "memory":
        return MemoryStore()
    if kind == "sqlite":
        return SQLiteStore(":memory:" if tmp_path is None else tmp_path / "june.db")
    if kind == "postgres":
        from june_worker.stores.postgres import PostgresStore

        store = PostgresStore(POSTGRES_URL[-1], max_size=2)
        OPENED.append(store)
        return store
    raise ValueError(kind)


def count_orders(store: SessionStore) -> int:
    """Rows in the app's ``orders`` table, read beside the engine (0 when the table was never made)."""
    if isinstance(store, SQLiteStore):
        conn = store._conn
        if not conn.execute("select 1 from sqlite_master where name = 'orders'").fetchone():
            return 0
        return int(conn.execute("select count(*) from orders").fetchone()[0])
    with store.pool.connection() as pg:  # type: ignore[attr-defined]
        if pg.execute("select to_regclass('orders')").fetchone()[0] is None:
            return 0
        return int(pg.execute("select count(*) from orders").fetchone()[0])


def runtime_with(store: SessionStore, model: Any, tools: list[Tool] | None = None, **agent_kw: Any) -> Runtime:
    return Runtime([Agent(name="ops", model=model, tools=tools or [], **agent_kw)], store)


def orders_in(store: SQLiteStore) -> int:
    conn = store._conn  # the app's table lives beside the engine's
    row = conn.execute("select count(*) from sqlite_master where name = 'orders'").fetchone()
    if not row[0]:
        return 0
    return int(conn.execute("select count(*) from orders").fetchone()[0])


def transcript(store: SessionStore, agent: str = "ops", session: str = "s1") -> list[Any]:
    from june_worker.engine.store import SessionRef

    return list(store.load(SessionRef(agent, session)).messages)


def scripted(script: Any, **kw: Any) -> ScriptedModel:
    return ScriptedModel(script, **kw)


class WindowModel:
    """A deterministic model with a context window, for the context policy.

    It reports a request's input tokens as its characters / 3 (plus ``extra_tokens``: what a real request
    carries that the transcript does not show, like tool schemas), refuses a request past ``refuse_over``
    tokens (its window by default) as the Anthropic API does, and answers a compaction step
    (``compact:<n>``) with a summary that says how many user messages it was given. Replies depend on the
    request only, so a replay gets the same ones.
    """

    def __init__(
        self, window: int = 2000, *, refuse_over: int | None = None, extra_tokens: int = 0, report_usage: bool = True
    ) -> None:
        self.context_window_tokens = window
        self.refuse_over = window if refuse_over is None else refuse_over
        self.extra_tokens = extra_tokens
        self.report_usage = report_usage
        self.requests: list[ModelRequest] = []
        self.refused = 0

    @property
    def summaries(self) -> int:
        """Compaction calls made (answered or not)."""
        return sum(1 for r in self.requests if r.step.startswith("compact:"))

    def tokens(self, request: ModelRequest) -> int:
        chars = len(request.system) + sum(len(m.model_dump_json()) for m in request.messages)
        return chars // 3 + self.extra_tokens

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        from june_worker.engine.types import Usage
        from june_worker.errors import ContextWindowExceededError

        self.requests.append(request)
        tokens = self.tokens(request)
        if tokens > self.refuse_over:
            self.refused += 1
            raise ContextWindowExceededError(f"prompt is too long: {tokens} tokens > {self.refuse_over} maximum", 400)
        usage = Usage(input_tokens=tokens, output_tokens=8) if self.report_usage else None
        if request.step.startswith("compact:"):
            given = request.messages[-1]
            count = given.text.count("User: ") if isinstance(given, UserMessage) else 0
            yield Done(reply=ModelReply(text=f"summary: {count} user messages so far"), usage=usage)
            return
        yield TextChunk(text="ok")
        yield Done(reply=ModelReply(text=f"ok, {len(request.messages)} messages seen"), usage=usage)
