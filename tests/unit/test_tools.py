"""Tools: declaration, classification, validation, and what happens when one throws."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import Field

from june_worker import Agent, FatalToolError, Tool, ToolContext, store_write, tool
from june_worker.engine.events import Failed
from june_worker.engine.model import ModelDelta, ModelRequest
from june_worker.engine.tools import ERROR_MAX_CHARS, format_tool_error, is_async_callable
from june_worker.engine.types import ToolMessage
from june_worker.errors import AgentDefinitionError, ConfigError, TurnFailedError
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import MemoryStore, SQLiteStore

from .kit import Counter, FnModel, Recorder, reply, runtime_with, transcript


def call(name: str, cid: str = "c1", **input: Any) -> dict[str, Any]:
    return {"id": cid, "name": name, "input": input}


def one_call(name: str, **input: Any) -> ScriptedModel:
    return ScriptedModel([Reply("", calls=[call(name, **input)]), Reply("after")])


# --- declaration ---------------------------------------------------------------------------------


def test_tool_builds_its_schema_from_type_hints_and_its_description_from_the_docstring() -> None:
    @tool
    def create_order(ctx: ToolContext, item: Annotated[str, Field(description="what to order")], qty: int = 1) -> dict:
        """Place an order for an item.

        Orders are final.
        """
        return {}

    assert create_order.name == "create_order"
    assert create_order.description == "Place an order for an item.\n\nOrders are final."
    schema = create_order.input_schema
    assert schema["required"] == ["item"]
    assert schema["properties"]["item"] == {"description": "what to order", "title": "Item", "type": "string"}
    assert schema["properties"]["qty"]["default"] == 1
    assert schema["additionalProperties"] is False
    assert not create_order.is_async


def test_a_tool_without_a_context_parameter_gets_only_its_input() -> None:
    @tool(name="add", requires_principal=True)
    async def adder(a: int, b: int) -> int:
        """Add."""
        return a + b

    assert adder.name == "add" and adder.is_async and adder.requires_principal
    assert set(adder.input_schema["properties"]) == {"a", "b"}


BAD_NAMES = ["", "create order", "créer_commande", "orders.create", "a" * 65, "tool/1", "emoji🙂"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_tool_name_the_api_would_refuse_is_refused_when_the_tool_is_defined(name: str) -> None:
    def run(_input: Any, _ctx: Any) -> None:
        return None

    with pytest.raises(ConfigError, match=r"\^\[a-zA-Z0-9_-\]\{1,64\}\$") as raised:
        Tool(name, run)
    assert repr(name) in str(raised.value)
    with pytest.raises(ConfigError, match="1-64"):
        tool(name=name)(run)


@pytest.mark.parametrize("name", ["create_order", "a" * 64, "get-Order-2", "X"])
def test_names_within_the_rule_are_accepted(name: str) -> None:
    assert Tool(name, lambda _input, _ctx: None).name == name


def test_an_agent_refuses_a_tool_whose_name_breaks_the_rule_naming_agent_tool_and_rule() -> None:
    lookup = tool(name="lookup")(LookupOrder("ord-"))
    lookup.name = "look up"  # renamed after it was defined
    with pytest.raises(AgentDefinitionError, match=r"agent ops: tool 'look up'.*\^\[a-zA-Z0-9_-\]\{1,64\}\$"):
        Agent(name="ops", model=ScriptedModel(["hi"]), tools=[lookup])


class LookupOrder:
    """Look an order up."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    async def __call__(self, ctx: ToolContext, order_id: str) -> dict[str, Any]:
        return {"order": f"{self.prefix}{order_id}", "turn": ctx.turn_id}


class CountItems:
    """Count items."""

    def __call__(self, items: list[str]) -> int:
        return len(items)


def test_a_tool_from_an_object_with_an_async_call_takes_the_context_after_self() -> None:
    lookup = tool(LookupOrder("ord-"))
    assert lookup.name == "LookupOrder" and lookup.is_async and lookup.description == "Look an order up."
    assert set(lookup.input_schema["properties"]) == {"order_id"} and lookup.input_schema["required"] == ["order_id"]
    count = tool(name="count_items")(CountItems())
    assert not count.is_async and set(count.input_schema["properties"]) == {"items"}


async def test_an_async_callable_object_tool_runs_in_a_turn_with_its_context_and_state() -> None:
    model = ScriptedModel([Reply("", calls=[call("lookup_order", order_id="42")]), Reply("found")])
    store = MemoryStore()
    rt = runtime_with(store, model, [tool(name="lookup_order")(LookupOrder("ord-"))])
    assert await rt.session("ops", "s1").turn("find 42", turn_id="t1") == "found"
    results = [m.result for m in transcript(store) if isinstance(m, ToolMessage)]
    assert results == [{"order": "ord-42", "turn": "t1"}]


class _AsyncCallable:
    async def __call__(self, ctx: ToolContext, x: int) -> int:
        return x


class _SyncCallable:
    def __call__(self, ctx: ToolContext, x: int) -> int:
        return x


def _sync_decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


async def _coro(ctx: ToolContext, x: int) -> int:
    return x


def _plain(ctx: ToolContext, x: int) -> int:
    return x


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (_coro, True),
        (_plain, False),
        (functools.partial(_coro), True),
        (functools.partial(functools.partial(_coro)), True),
        (_sync_decorator(_coro), True),
        (_sync_decorator(_plain), False),
        (_AsyncCallable(), True),
        (_SyncCallable(), False),
        (functools.partial(_AsyncCallable()), True),
    ],
    ids=[
        "async",
        "sync",
        "partial",
        "partial2",
        "decorated-async",
        "decorated-sync",
        "async-call",
        "sync-call",
        "partial-call",
    ],
)
def test_classification_sees_through_partial_decorators_and_callables(fn: Any, expected: bool) -> None:
    assert is_async_callable(fn) is expected
    assert Tool("t", fn).is_async is expected


def test_error_text_is_class_prefixed_unless_plain_and_cut_to_2000_chars() -> None:
    class QuotaError(Exception):
        pass

    assert format_tool_error(Exception("boom")) == "boom"
    assert format_tool_error(QuotaError("quota exceeded")) == "QuotaError: quota exceeded"
    assert format_tool_error(KeyError("k")) == "KeyError: 'k'"
    assert format_tool_error(ValueError()) == "ValueError"
    assert len(format_tool_error(ValueError("x" * 5000))) == ERROR_MAX_CHARS


# --- validation and unknown tools ------------------------------------------------------------------


async def test_invalid_input_is_a_tool_error_the_model_reads_and_nothing_runs() -> None:
    counter = Counter()

    @tool
    def create_order(item: str, qty: int) -> dict[str, Any]:
        """Order."""
        counter.runs += 1
        return {}

    store = MemoryStore()
    rt = runtime_with(store, one_call("create_order", item="widget", qty="many"), [create_order])
    assert await rt.session("ops", "s1").turn("go") == "after"
    result = [m for m in transcript(store) if isinstance(m, ToolMessage)][0]
    assert counter.runs == 0 and result.is_error
    assert result.result == {
        "error": "invalid input for create_order: qty: Input should be a valid integer, unable to parse string as an integer"
    }


async def test_an_unknown_tool_becomes_an_error_result_naming_it_and_the_turn_goes_on() -> None:
    # Replaces S29/S31 of the seed era: the model reads the error and can recover.
    store = MemoryStore()
    rt = runtime_with(store, one_call("nope"))
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    assert await s.turn("go", turn_id="t1") == "after"
    done = rec.of("action.completed")[0]
    assert done.error == "unknown tool nope" and done.result == {"error": "unknown tool nope"}
    assert done.step == "tool:1:c1"


# --- thrown errors -------------------------------------------------------------------------------------


async def test_a_throwing_tool_becomes_an_error_result_and_the_turn_completes() -> None:
    class QuotaError(Exception):
        pass

    @tool
    async def fetch(url: str) -> dict[str, Any]:
        """Fetch."""
        raise QuotaError("quota exceeded " + "x" * 3000)

    store = MemoryStore()
    rt = runtime_with(store, one_call("fetch", url="u"), [fetch])
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    assert await s.turn("go") == "after"
    completed = rec.of("action.completed")[0]
    assert completed.error.startswith("QuotaError: quota exceeded") and len(completed.error) == 2000
    assert "Traceback" not in completed.error
    msg = [m for m in transcript(store) if isinstance(m, ToolMessage)][0]
    assert msg.is_error and msg.result == {"error": completed.error}
    assert "turn.failed" not in rec.types


async def test_a_throwing_sync_tool_has_its_writes_rolled_back_before_the_error_is_recorded() -> None:
    @tool
    def create_order(ctx: ToolContext, item: str) -> dict[str, Any]:
        """Order."""
        store_write(ctx, "create table if not exists orders (item text)")
        store_write(ctx, "insert into orders (item) values (?)", item)
        raise ValueError("warehouse closed")

    store = SQLiteStore(":memory:")
    rt = runtime_with(store, one_call("create_order", item="widget"), [create_order])
    assert await rt.session("ops", "s1").turn("go") == "after"
    assert store._conn.execute("select count(*) from sqlite_master where name = 'orders'").fetchone()[0] == 0
    step = store.load(rt.session("ops", "s1").ref).steps["tool:1:c1"]
    assert step.data == {"result": {"error": "ValueError: warehouse closed"}, "error": "ValueError: warehouse closed"}


async def test_a_failed_call_is_not_run_again_on_replay() -> None:
    counter = Counter()

    @tool
    async def flaky() -> dict[str, Any]:
        """Fails."""
        counter.runs += 1
        raise RuntimeError("nope")

    store = MemoryStore()
    rt = runtime_with(store, one_call("flaky"), [flaky])
    await rt.session("ops", "s1").turn("go", turn_id="t1")
    rt2 = runtime_with(store, one_call("flaky"), [flaky])
    await rt2.session("ops", "s1").start("go", turn_id="t1")
    await rt2.session("ops", "s1").result("t1")
    assert counter.runs == 1


@pytest.mark.parametrize("is_async", [False, True])
async def test_fatal_tool_error_fails_the_turn_with_phase_and_step(is_async: bool) -> None:
    if is_async:

        @tool
        async def deploy() -> None:
            """Deploy."""
            raise FatalToolError("misconfigured deployment")
    else:

        @tool
        def deploy() -> None:
            """Deploy."""
            raise FatalToolError("misconfigured deployment")

    store = MemoryStore()
    rt = runtime_with(
        store, ScriptedModel([Reply("", calls=[call("deploy"), call("deploy", "c2")]), Reply("x")]), [deploy]
    )
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    with pytest.raises(TurnFailedError, match="misconfigured deployment"):
        await s.turn("go", turn_id="t1")
    failed = rec.events[-1]
    assert failed.type == "turn.failed" and failed.phase == "tool" and failed.step == "tool:1:c1"
    assert failed.error.type == "FatalToolError"
    # the batch is closed so the transcript stays valid, and the session takes the next turn
    tools = [m for m in transcript(store) if isinstance(m, ToolMessage)]
    assert [(m.call_id, m.is_error) for m in tools] == [("c1", True), ("c2", True)]
    assert await s.turn("again") == "x"


async def test_a_sync_tool_returning_an_awaitable_fails_the_step_instead_of_recording_empty() -> None:
    async def work() -> dict[str, Any]:
        return {"real": "result"}

    @tool
    def sneaky() -> Any:
        """Looks sync."""
        return work()

    store = MemoryStore()
    rt = runtime_with(store, one_call("sneaky"), [sneaky])
    # (the coroutine is closed: no "never awaited" RuntimeWarning, and warnings are errors here)
    with pytest.raises(TurnFailedError, match="declared with def but returned an awaitable"):
        await rt.session("ops", "s1").turn("go")
    assert not any(isinstance(m, ToolMessage) and m.result == {} for m in transcript(store))


# --- signals are never swallowed --------------------------------------------------------------------


async def test_a_park_is_not_swallowed_by_a_tools_except_exception() -> None:
    @tool
    async def careful(ctx: ToolContext) -> dict[str, Any]:
        """Catches everything."""
        try:
            answer = await ctx.request_input(id="q", prompt="ok?")
        except Exception as exc:  # the tool author's catch-all must not eat the park
            return {"swallowed": str(exc)}
        return {"answer": answer}

    rt = runtime_with(MemoryStore(), one_call("careful"), [careful])
    s = rt.session("ops", "s1")
    await s.start("go", turn_id="t1")
    result = await s.result("t1")
    assert result.status == "suspended"


async def test_s73_request_input_from_a_sync_tool_fails_the_turn() -> None:
    @tool
    def bad(ctx: ToolContext) -> Any:
        """Sync tool that tries to park."""
        try:
            return ctx.request_input(id="q", prompt="?")
        except Exception:  # not even a catch-all hides the mistake
            return {"hidden": True}

    rt = runtime_with(MemoryStore(), one_call("bad"), [bad])
    s = rt.session("ops", "s1")
    await s.start("go", turn_id="t1")
    result = await s.result("t1")
    assert isinstance(result, Failed)
    assert result.phase == "tool" and result.step == "tool:1:c1"
    assert "runs sync (def); only an async tool can park" in result.error.message


async def test_store_write_refuses_on_the_memory_store_and_fails_the_turn() -> None:
    @tool
    def create_order(ctx: ToolContext, item: str) -> dict[str, Any]:
        """Order."""
        store_write(ctx, "insert into orders (item) values (?)", item)
        return {}

    rt = runtime_with(MemoryStore(), one_call("create_order", item="w"), [create_order])
    with pytest.raises(TurnFailedError, match="memory store has no transaction"):
        await rt.session("ops", "s1").turn("go")


async def test_store_write_refuses_in_an_async_tool() -> None:
    @tool
    async def create_order(ctx: ToolContext, item: str) -> dict[str, Any]:
        """Order."""
        store_write(ctx, "insert into orders (item) values (?)", item)
        return {}

    rt = runtime_with(SQLiteStore(":memory:"), one_call("create_order", item="w"), [create_order])
    with pytest.raises(TurnFailedError, match="no store handle"):
        await rt.session("ops", "s1").turn("go")


async def test_a_non_json_result_is_a_tool_error() -> None:
    @tool
    def weird() -> Any:
        """Returns a set."""
        return {1, 2}

    store = MemoryStore()
    rt = runtime_with(store, one_call("weird"), [weird])
    assert await rt.session("ops", "s1").turn("go") == "after"
    msg = [m for m in transcript(store) if isinstance(m, ToolMessage)][0]
    assert msg.is_error and msg.result["error"].startswith("TypeError: Object of type set is not JSON serializable")


async def test_a_tool_from_a_directory_module_loads(tmp_path: Path) -> None:
    from june_worker import Agent

    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "ping.py").write_text(
        "from june_worker import tool\n\n@tool\ndef ping() -> str:\n    '''Ping.'''\n    return 'pong'\n"
    )
    (tmp_path / "instructions.md").write_text("You are ops.")
    agent = Agent.from_dir(tmp_path, model=ScriptedModel(["x"]))
    assert [t.name for t in agent.tools] == ["ping"] and agent.instructions == "You are ops."


async def test_a_model_that_raises_after_partial_text_fails_with_phase_model() -> None:
    async def gen(_: ModelRequest) -> AsyncIterator[ModelDelta]:
        from june_worker.engine.model import TextChunk

        yield TextChunk(text="partial")
        raise ConnectionError("stream cut")

    rt = runtime_with(MemoryStore(), FnModel(gen))
    with pytest.raises(TurnFailedError, match="stream cut"):
        await rt.session("ops", "s1").turn("go")


async def test_a_model_stream_without_done_fails_clearly() -> None:
    async def gen(_: ModelRequest) -> AsyncIterator[ModelDelta]:
        if False:
            yield reply("never")

    rt = runtime_with(MemoryStore(), FnModel(gen))
    with pytest.raises(TurnFailedError, match="ended without a final reply"):
        await rt.session("ops", "s1").turn("go")
