"""The failure policy (DESIGN.md "Failure classes"): every fault has a class, and no class wedges a session.

The storage tests here take ``sql_kind`` / ``store_kind`` and run on SQLite and memory here, and
on Postgres from tests/integration/test_engine_postgres.py.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from june_wire.storable import REPLACEMENT, storable_json, unstorable_reason
from june_worker import ToolContext, tool
from june_worker.engine.endings import CAUSE_CHAIN_MAX, error_info
from june_worker.engine.events import Cancelled, Completed, Failed
from june_worker.engine.failures import Failure, classify
from june_worker.engine.loop import TurnRunner
from june_worker.engine.signals import CrashInjected
from june_worker.engine.store import Commit, SessionRef, TurnPayload
from june_worker.engine.types import ModelReply
from june_worker.errors import (
    FatalToolError,
    MessageIndexTakenError,
    ModelProviderError,
    PayloadError,
    PoisonTurnError,
    StoreUnavailableError,
    TurnEndedError,
)
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import MemoryStore

from . import kit

# --- the classes, one place -----------------------------------------------------------------------


def test_a_store_fault_is_transient_wherever_it_is_raised() -> None:
    lost = StoreUnavailableError("connection lost")
    assert {classify(lost, phase=p) for p in ("model", "tool", "store")} == {Failure.TRANSIENT}


def test_an_exception_a_tool_raises_is_the_tools_own_even_a_network_error() -> None:
    assert classify(ConnectionError("api down"), phase="tool") is Failure.TOOL
    assert classify(TimeoutError(), phase="tool") is Failure.TOOL


def test_fatal_tool_error_fails_the_turn() -> None:
    assert classify(FatalToolError("misconfigured"), phase="tool") is Failure.FATAL


def test_a_retryable_provider_error_is_transient_and_any_other_model_error_fatal() -> None:
    assert classify(ModelProviderError("overloaded", status_code=529, retryable=True), phase="model") is (
        Failure.TRANSIENT
    )
    assert classify(ModelProviderError("bad request", status_code=400), phase="model") is Failure.FATAL
    assert classify(RuntimeError("api down"), phase="model") is Failure.FATAL


def test_a_turn_given_up_is_poison() -> None:
    assert classify(PoisonTurnError("gave up"), phase="store") is Failure.POISON


def test_a_commit_refused_for_a_taken_message_index_is_a_lost_race_not_a_failure() -> None:
    assert classify(MessageIndexTakenError("message index 1 is taken"), phase="store") is Failure.LOST_RACE


# --- values the store cannot hold (issue 10, item 3) ------------------------------------------------


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ itself fails")


def _chain(depth: int) -> Exception:
    exc: Exception = RuntimeError("cause 0")
    for n in range(1, depth):
        try:
            raise RuntimeError(f"cause {n}") from exc
        except RuntimeError as caught:
            exc = caught
    return exc


def test_an_error_report_is_storable_and_its_cause_chain_capped() -> None:
    info = error_info(_chain(20))
    assert len(info.cause_chain) == CAUSE_CHAIN_MAX
    info = error_info(FileNotFoundError("cannot read report-\udcff.txt"))
    assert info.message == f"cannot read report-{REPLACEMENT}.txt"
    assert error_info(_Unprintable()).message == "_Unprintable"
    assert unstorable_reason(info.model_dump()) is None


def test_storable_json_replaces_nul_and_lone_surrogates_in_strings_and_keys_and_keeps_clean_values() -> None:
    clean = {"a": ["x", 1, {"b": None}]}
    assert storable_json(clean) is clean
    assert storable_json({"k\x00": ["v\udcff"]}) == {f"k{REPLACEMENT}": [f"v{REPLACEMENT}"]}
    assert (
        unstorable_reason({"a": [{"b": "\udcff"}]})
        == "a[0].b: contains a lone surrogate (U+DCFF) at index 0, which cannot be stored"
    )


def _faulty_tools(counter: kit.Counter) -> list[Any]:
    @tool
    def odd_result(ctx: ToolContext) -> dict[str, Any]:
        """Writes a row, then returns what no store can hold as it is."""
        counter.runs += 1
        ctx.store.execute("create table if not exists orders (item text, qty integer)")
        ctx.store.execute("insert into orders (item, qty) values (?, ?)", "odd", 1)
        return {"name": "report-\udcff.txt", "nul": "a\x00b", "k\x00": 1}

    @tool
    def missing_file(ctx: ToolContext) -> dict[str, Any]:
        """Raises an OSError naming a file whose name is not UTF-8 (as os.fsdecode gives it)."""
        raise FileNotFoundError("cannot read " + os.fsdecode(b"report-\xff.txt"))

    @tool
    def unprintable(ctx: ToolContext) -> dict[str, Any]:
        """Raises an exception whose __str__ raises."""
        raise _Unprintable()

    @tool
    def deep(ctx: ToolContext) -> dict[str, Any]:
        """Raises with a long cause chain."""
        raise _chain(30)

    return [odd_result, missing_file, unprintable, deep]


async def test_unstorable_tool_values_are_made_storable_and_the_session_goes_on(sql_kind: str) -> None:
    counter = kit.Counter()
    calls = [
        {"id": f"c{n}", "name": name, "input": {}}
        for n, name in enumerate(["odd_result", "missing_file", "unprintable", "deep"])
    ]
    model = ScriptedModel([Reply("four calls\udcff", calls=calls), Reply("all done\x00"), Reply("next turn")])
    store = kit.make_store(sql_kind)
    rt = kit.runtime_with(store, model, _faulty_tools(counter))
    s = rt.session("ops", "s1")
    assert await s.turn("go") == f"all done{REPLACEMENT}"
    assert await s.turn("again") == "next turn"  # the session serves its next turn
    assert counter.runs == 1 and kit.count_orders(store) == 1  # the sync write committed exactly once
    results = {e.call.name: (e.result, e.error) for e in store.events(s.ref) if e.type == "action.completed"}
    assert results["odd_result"][0] == {
        "name": f"report-{REPLACEMENT}.txt",
        "nul": f"a{REPLACEMENT}b",
        f"k{REPLACEMENT}": 1,
    }
    assert results["missing_file"][1] == f"FileNotFoundError: cannot read report-{REPLACEMENT}.txt"
    assert results["unprintable"][1] == "_Unprintable"
    assert results["deep"][1] == "RuntimeError: cause 29"


def test_a_payload_the_store_cannot_hold_is_refused_before_anything_is_recorded() -> None:
    async def go() -> None:
        store = kit.make_store("sqlite")
        s = kit.runtime_with(store, ScriptedModel(["hi"])).session("ops", "s1")
        for bad in ({"text": "caf\udce9"}, {"text": "ok", "event": {"source": "sl\x00ck"}}):
            with pytest.raises(PayloadError, match="cannot be stored"):
                await s.start(turn_id="t1", **bad)
        assert store.get_turn(s.ref, "t1") is None

    asyncio.run(go())


# --- a sync tool that catches a failed statement (item 1) ----------------------------------------


async def test_a_sync_tool_that_catches_a_failed_statement_keeps_the_steps_transaction_usable(sql_kind: str) -> None:
    runs = kit.Counter()

    @tool
    def lookup(ctx: ToolContext, item: str) -> dict[str, Any]:
        """Writes, tries a table that does not exist, carries on, writes again."""
        runs.runs += 1
        ctx.store.execute("create table if not exists orders (item text)")
        ctx.store.execute("insert into orders (item) values (?)", item)
        try:
            ctx.store.query("select price from missing_table where item = ?", item)
            found = "yes"
        except Exception as exc:  # the tool's own decision: carry on without a price
            found = type(exc).__name__
        ctx.store.execute("insert into orders (item) values (?)", item + "-2")
        return {"item": item, "price": found}

    store = kit.make_store(sql_kind)
    script = [Reply("", calls=[{"id": "c1", "name": "lookup", "input": {"item": "w"}}]), Reply("after"), Reply("next")]
    s = kit.runtime_with(store, ScriptedModel(script), [lookup]).session("ops", "s1")
    assert await asyncio.wait_for(s.turn("go"), 20) == "after"
    assert await asyncio.wait_for(s.turn("again"), 20) == "next"  # the session serves its next turn
    assert runs.runs == 1 and kit.count_orders(store) == 2  # both writes, once: only the failed statement rolled back
    results = [e.result for e in store.events(s.ref) if e.type == "action.completed"]
    assert results == [{"item": "w", "price": {"postgres": "UndefinedTable", "sqlite": "OperationalError"}[sql_kind]}]


# --- guarded writes (item 6) ----------------------------------------------------------------------------


def test_a_turn_that_ended_keeps_its_status_whatever_commits_later(store_kind: str) -> None:
    store = kit.make_store(store_kind)
    ref = SessionRef("ops", "s1")
    store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    store.commit(
        ref, Commit(turn_id="t1", turn_status="cancelled", turn_result=Cancelled(turn_id="t1", reason="requested"))
    )
    with pytest.raises(TurnEndedError):
        store.commit(ref, Commit(turn_id="t1", turn_status="running"))
    rec = store.get_turn(ref, "t1")
    assert rec is not None and rec.status == "cancelled" and store.events(ref) == []


def test_a_rejected_turn_is_recorded_rejected_in_one_write_with_its_event(store_kind: str) -> None:
    store = kit.make_store(store_kind)
    ref = SessionRef("ops", "s1")
    rec, events = store.reject_turn(ref, "t1", TurnPayload(text="hi"), "session is parked")
    assert rec.status == "rejected" and rec.result is not None and rec.result.status == "rejected"
    assert [(e.type, e.seq, e.phase) for e in events] == [("turn.failed", 1, "intake")]
    assert store.unfinished_turns(ref) == []
    # again: nothing changes, no second event
    assert store.reject_turn(ref, "t1", TurnPayload(text="hi"), "again")[1] == []
    # a refused copy of a turn recorded already leaves that turn alone
    store.enqueue_turn(ref, "t2", TurnPayload(text="hi"))
    rec2, events2 = store.reject_turn(ref, "t2", TurnPayload(text="x"), "copy", new_only=True)
    assert rec2.status == "queued" and events2 == []


# --- a cancel that is stored but not yet signalled (item 7) --------------------------------------


async def test_the_opening_commit_refuses_a_turn_whose_cancel_is_stored(store_kind: str) -> None:
    store = kit.make_store(store_kind)
    model = ScriptedModel(["should never be asked"])
    rt = kit.runtime_with(store, model)
    ref = SessionRef("ops", "s1")
    rec, _ = store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    store.request_cancel(ref, "requested", turn_ids=["t1"])
    # The runner was handed the record before the cancel landed, and the signal never reached it.
    runner = TurnRunner(rt.agent("ops"), store, rt.fanout, ref, rec)
    result = await runner.run()
    assert isinstance(result, Cancelled) and result.reason == "requested"
    assert model.calls == 0
    assert [e.type for e in store.events(ref)] == ["turn.cancelled"]
    assert store.load(ref).messages == []


async def test_a_cancel_stored_whose_signal_was_lost_stops_the_turn_at_its_next_model_reply(store_kind: str) -> None:
    store = kit.make_store(store_kind)
    ref = SessionRef("ops", "s1")

    @tool
    def slow(ctx: ToolContext) -> dict[str, Any]:
        """Runs while another process cancels the turn; the signal never arrives."""
        store.request_cancel(ref, "requested", turn_ids=[ctx.turn_id])
        return {"ok": 1}

    model = ScriptedModel([Reply("", calls=[{"id": "c1", "name": "slow", "input": {}}]), Reply("too late")])
    rt = kit.runtime_with(store, model, [slow])
    s = rt.session("ops", "s1")
    assert await s.result(await s.start("go", turn_id="t1")) == Cancelled(turn_id="t1", reason="requested")
    tools = [(m.call_id, m.result) for m in kit.transcript(store) if m.role == "tool"]
    assert tools == [("c1", {"ok": 1})]  # the tool ran: its result stays
    assert [m.role for m in kit.transcript(store)] == ["user", "assistant", "tool"]  # no reply after the cancel


# --- one turn's failure reaches its own waiters only (item 8) ----------------------------------


async def test_a_turn_that_stops_without_a_result_fails_only_its_own_waiters() -> None:
    store = kit.make_store("sqlite")
    gate = asyncio.Event()
    crashes = {"n": 0}

    def crash_once(point: str, step: str) -> None:
        if point == "before-model-commit" and crashes["n"] == 0:
            crashes["n"] += 1
            raise CrashInjected(point, step)

    async def gated(request: Any) -> Any:
        await gate.wait()  # both waiters are registered before t1's first step ends
        yield kit.reply("ok")

    rt = kit.runtime_with(store, kit.FnModel(gated))
    rt.crash = crash_once
    s = rt.session("ops", "s1")
    t1 = await s.start("first", turn_id="t1")
    t2 = await s.start("second", turn_id="t2")
    first, second = asyncio.ensure_future(s.result(t1)), asyncio.ensure_future(s.result(t2))
    await asyncio.sleep(0.01)
    gate.set()
    with pytest.raises(CrashInjected):
        await first
    await asyncio.sleep(0.05)
    assert not second.done()  # t1's crash is not t2's
    assert isinstance(await s.result(t1), Completed)  # asking again replays t1 on a fresh drain
    assert isinstance(await asyncio.wait_for(second, 5), Completed)


# --- poison: a turn that never ends is given up (item 4, in process) ----------------------------


async def test_a_turn_whose_process_dies_every_time_ends_failed_after_max_attempts(sql_kind: str) -> None:
    store = kit.make_store(sql_kind)
    runs = kit.Counter()

    @tool
    def explode(ctx: ToolContext) -> dict[str, Any]:
        """Takes the process down with it, every time."""
        runs.runs += 1
        raise CrashInjected("in-tool", ctx.step)

    script = [Reply("calling", calls=[{"id": "c1", "name": "explode", "input": {}}]), Reply("next")]

    def fresh_runtime() -> Any:  # a new process over the same store
        rt = kit.runtime_with(store, ScriptedModel(script), [explode])
        rt.max_attempts = 3
        return rt.session("ops", "s1")

    with pytest.raises(CrashInjected):
        await fresh_runtime().turn("go", turn_id="t1")
    for _ in range(2):
        with pytest.raises(CrashInjected):
            await fresh_runtime().result("t1")
    result = await fresh_runtime().result("t1")
    assert isinstance(result, Failed)
    assert (result.error.type, result.phase, result.step) == ("PoisonTurnError", "tool", "tool:1:c1")
    assert "given up after 3 attempts" in result.error.message
    assert runs.runs == 3
    s = fresh_runtime()
    assert await s.turn("next turn", turn_id="t2") == "next"  # the session moved on
    assert [e.type for e in store.events(s.ref, turn_id="t1")][-1] == "turn.failed"


# --- a retryable provider error that outlasts a step's retries ------------------------------------


def _overloaded_model(fails: int | None) -> kit.FnModel:
    """A provider that answers 529 overloaded (retryable) to turn t1's first ``fails`` calls (None: all of them)."""
    seen = kit.Counter()

    async def stream(request: Any) -> Any:
        if request.turn_id == "t1":
            seen.runs += 1
            if fails is None or seen.runs <= fails:
                raise ModelProviderError("overloaded", status_code=529, retryable=True)
        yield kit.reply(f"answered {request.turn_id}")

    return kit.FnModel(stream)


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries at once: the backoff's length is not what these tests are about."""
    monkeypatch.setattr("june_worker.engine.loop.backoff_s", lambda *a, **k: 0.0)
    monkeypatch.setattr("june_worker.engine.session.backoff_s", lambda *a, **k: 0.0)


async def test_a_retryable_provider_error_that_never_passes_ends_the_turn_as_poison_and_the_session_goes_on(
    sql_kind: str, no_backoff: None
) -> None:
    store = kit.make_store(sql_kind)
    rt = kit.runtime_with(store, _overloaded_model(None))
    rt.max_attempts = 3
    s = rt.session("ops", "s1")
    t1 = await s.start("first", turn_id="t1")
    t2 = await s.start("second", turn_id="t2")
    first = await asyncio.wait_for(s.result(t1), 20)
    assert isinstance(first, Failed) and first.error.type == "PoisonTurnError"
    assert (first.phase, first.step) == ("model", "model:1")
    assert "given up after 3 attempts" in first.error.message and "overloaded" in first.error.message
    rec = store.get_turn(s.ref, "t1")
    assert rec is not None and (rec.status, rec.attempts) == ("failed", 3)
    second = await asyncio.wait_for(s.result(t2), 20)  # the next turn of the session runs
    assert isinstance(second, Completed) and second.text == "answered t2"


async def test_a_retryable_provider_error_that_passes_on_a_later_attempt_completes_the_turn(
    sql_kind: str, no_backoff: None
) -> None:
    from june_worker.engine.failures import STEP_RETRIES

    store = kit.make_store(sql_kind)
    # Two whole attempts fail (each tries the step 1 + STEP_RETRIES times), the third passes.
    rt = kit.runtime_with(store, _overloaded_model(2 * (STEP_RETRIES + 1)))
    rt.max_attempts = 3
    s = rt.session("ops", "s1")
    result = await asyncio.wait_for(s.result(await s.start("first", turn_id="t1")), 20)
    assert isinstance(result, Completed) and result.text == "answered t1"
    rec = store.get_turn(s.ref, "t1")
    assert rec is not None and (rec.status, rec.attempts) == ("completed", 3)


def test_a_model_reply_the_store_cannot_hold_is_made_storable() -> None:
    from june_worker.engine._runner_base import _storable_reply

    reply = ModelReply(text="ok", tool_calls=[{"id": "c\x00", "name": "t", "input": {"p": "\udcff"}}])
    clean = _storable_reply(reply)
    assert clean.tool_calls[0].id == f"c{REPLACEMENT}" and clean.tool_calls[0].input == {"p": REPLACEMENT}
    fine = ModelReply(text="ok")
    assert _storable_reply(fine) is fine


# --- a transient fault at an async tool's commit ---------------------------------------------------------


class _FlakyStore(MemoryStore):
    """Refuses, once, the first commit of a tool's result, as a database whose connection just dropped would."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def commit(self, ref: SessionRef, commit: Any, *, fence: int | None = None) -> Any:
        if isinstance(commit, Commit) and any(m.role == "tool" for _, m in commit.messages) and not self.refused:
            self.refused += 1
            raise StoreUnavailableError("the database connection was lost")
        return super().commit(ref, commit, fence=fence)


async def test_an_async_tools_result_whose_commit_meets_a_transient_fault_is_committed_without_calling_it_again() -> (
    None
):
    calls = kit.Counter()

    @tool
    async def charge(ctx: ToolContext) -> dict[str, Any]:
        """A side effect that must not happen twice in one run."""
        calls.runs += 1
        return {"charged": True}

    store = _FlakyStore()
    model = ScriptedModel([Reply("", calls=[{"id": "c1", "name": "charge", "input": {}}]), Reply("charged")])
    s = kit.runtime_with(store, model, [charge]).session("ops", "s1")
    assert await s.turn("go") == "charged"
    assert store.refused == 1 and calls.runs == 1  # the step ran again from the store; the tool did not


def test_a_statement_that_met_a_concurrent_schema_change_is_transient_and_other_internal_errors_are_not() -> None:
    # `june migrate --partitions` drops and re-creates the function june_intake and the tables' row types in one
    # transaction; a statement that resolved them just before it commits fails with "cache lookup failed" and
    # runs fine again: a transient fault (the task's autoretry), not the turn's failure.
    from psycopg import errors as pg_errors

    from june_worker.stores._pg_conn import is_unavailable

    assert is_unavailable(pg_errors.InternalError_("cache lookup failed for type 26332"))
    assert not is_unavailable(pg_errors.InternalError_("unexpected chunk number 3"))
    assert not is_unavailable(pg_errors.UniqueViolation("duplicate key"))


def test_only_a_lost_connection_a_shutdown_a_serialization_failure_a_deadlock_or_too_many_connections_is_unavailable() -> (
    None
):
    import psycopg
    from psycopg import errors as pg_errors

    from june_worker.stores._pg_conn import is_unavailable

    for lost in (
        psycopg.OperationalError("consuming input failed: server closed the connection unexpectedly"),
        psycopg.InterfaceError("the connection is closed"),
        pg_errors.ConnectionFailure("08006"),
        pg_errors.AdminShutdown("terminating connection due to administrator command"),
        pg_errors.CrashShutdown("57P02"),
        pg_errors.CannotConnectNow("the database system is starting up"),
        pg_errors.TooManyConnections("sorry, too many clients already"),
        pg_errors.SerializationFailure("could not serialize access"),
        pg_errors.DeadlockDetected("deadlock detected"),
    ):
        assert is_unavailable(lost), type(lost).__name__
    # the statement's own, though psycopg files them under OperationalError: they would fail the same way again
    for own in (
        pg_errors.QueryCanceled("canceling statement due to statement timeout"),
        pg_errors.LockNotAvailable("could not obtain lock on row"),
        pg_errors.ProgramLimitExceeded("index row size exceeds maximum"),
    ):
        assert isinstance(own, psycopg.OperationalError) and not is_unavailable(own), type(own).__name__
