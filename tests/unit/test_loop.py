"""The loop: model step, tool steps, until the model answers without a tool call (scenarios A, C, E, F)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from june_worker.engine.events import Completed, Failed
from june_worker.engine.loop import TurnRunner
from june_worker.engine.model import Done, ModelDelta, ModelRequest, TextChunk
from june_worker.engine.sink import NullSink
from june_worker.engine.store import SessionRef, SessionSnapshot, TurnPayload
from june_worker.engine.types import (
    AssistantMessage,
    Finish,
    MessageAdapter,
    ModelReply,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from june_worker.errors import TurnFailedError
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import MemoryStore, SQLiteStore

from .kit import ORDER_SCRIPT, Counter, FnModel, Recorder, list_order_tool, order_tool, runtime_with, transcript


async def test_step_ids_follow_transcript_indexes(sqlite_store: SQLiteStore) -> None:
    # Given ORDER_SCRIPT: [0 user, 1 assistant(call c1), 2 tool, 3 assistant]
    rt = runtime_with(sqlite_store, ScriptedModel(ORDER_SCRIPT), [order_tool()])
    await rt.session("ops", "s1").turn("Order 3 widgets", turn_id="t1")
    steps = sqlite_store.load(SessionRef("ops", "s1")).steps
    assert {"model:1", "tool:1:c1", "model:3"} <= set(steps)
    assert steps["model:1"].data["finish"]["reason"] == "tool_calls"


async def test_s4_s9_step_keys_are_per_session(sqlite_store: SQLiteStore) -> None:
    # Given one store, sessions alice and bob; When each runs turn t1
    rt = runtime_with(sqlite_store, ScriptedModel(ORDER_SCRIPT), [order_tool()])
    for who in ("alice", "bob"):
        assert await rt.session("ops", who).turn("Order 3 widgets", turn_id="t1") == "Done — order placed."
    # Then each transcript holds exactly one turn (no cross-session cache hit)
    for who in ("alice", "bob"):
        msgs = transcript(sqlite_store, session=who)
        assert [m.role for m in msgs] == ["user", "assistant", "tool", "assistant"]
        assert {m.turn_id for m in msgs} == {"t1"}


async def test_s7_loop_over_sqlite_writes_the_order_in_the_step() -> None:
    store = SQLiteStore(":memory:")
    rt = runtime_with(store, ScriptedModel(ORDER_SCRIPT), [order_tool()])
    assert await rt.session("ops", "s1").turn("Order 3 widgets", turn_id="t1") == "Done — order placed."
    snap = store.load(SessionRef("ops", "s1"))
    assert snap.steps["tool:1:c1"].data["result"] == {"orderId": 1, "item": "widget", "qty": 3}
    assert snap.status == "done"


async def test_s12_two_stores_with_identical_step_ids_do_not_interfere() -> None:
    stores = [SQLiteStore(":memory:"), SQLiteStore(":memory:")]
    for store in stores:
        rt = runtime_with(store, ScriptedModel(ORDER_SCRIPT), [order_tool()])
        await rt.session("ops", "self").turn("Order 3 widgets", turn_id="t1")
    for store in stores:
        assert store._conn.execute("select count(*) from orders").fetchone()[0] == 1


async def test_s21_structured_event_order_for_a_tool_turn() -> None:
    orders: list[dict[str, Any]] = []
    rt = runtime_with(MemoryStore(), ScriptedModel(ORDER_SCRIPT), [list_order_tool(orders)])
    rec = Recorder()
    session = rt.session("ops", "s1")
    session.observe(rec)
    await session.turn("Order 3 widgets", turn_id="t1")
    structural = [e for e in rec.events if not e.type.endswith(".delta")]
    assert [e.type for e in structural] == [
        "turn.started",
        "message.completed",
        "action.requested",
        "action.completed",
        "message.completed",
        "turn.completed",
    ]
    started, _, requested, completed, _, last = structural
    assert started.trigger.kind == "inbound" and started.trigger.event.source == "api"
    assert requested.call.name == "create_order"
    assert completed.call.name == "create_order" and completed.result["orderId"] == 1
    assert (last.type, last.turn_id, last.text) == ("turn.completed", "t1", "Done — order placed.")
    assert [e.seq for e in structural] == [1, 2, 3, 4, 5, 6]


async def test_a_turn_typed_in_process_opens_with_the_persons_message_as_an_api_inbound_event() -> None:
    # Given an in-process session
    rt = runtime_with(MemoryStore(), ScriptedModel(ORDER_SCRIPT), [list_order_tool([])])
    session = rt.session("ops", "s1")
    rec = Recorder()
    session.observe(rec)
    # When a turn is started with text only
    await session.turn("Order 3 widgets", turn_id="t1")
    # Then it opened as a message given to the API, with what was typed, not as a proactive turn
    started = rec.of("turn.started")[0]
    assert started.trigger.model_dump(exclude_none=True) == {
        "kind": "inbound",
        "event": {"source": "api", "kind": "message", "text": "Order 3 widgets"},
    }


async def test_a_turn_started_in_process_as_proactive_stays_proactive() -> None:
    rt = runtime_with(MemoryStore(), ScriptedModel(ORDER_SCRIPT), [list_order_tool([])])
    session = rt.session("ops", "s1")
    rec = Recorder()
    session.observe(rec)
    await session.turn("Order 3 widgets", turn_id="t1", trigger={"kind": "proactive", "by": "cron:daily"})
    assert rec.of("turn.started")[0].trigger.model_dump() == {"kind": "proactive", "by": "cron:daily"}


async def test_s23_done_is_terminal_and_the_stream_is_closed() -> None:
    closed: list[bool] = []

    async def gen(_: ModelRequest) -> AsyncIterator[ModelDelta]:
        try:
            yield TextChunk(text="Hi")
            yield Done(reply=ModelReply(text="Hi"))
            raise RuntimeError("after done")
        finally:
            closed.append(True)

    rt = runtime_with(MemoryStore(), FnModel(gen))
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    assert await s.turn("hello", turn_id="t1") == "Hi"
    assert "turn.failed" not in rec.types
    assert rec.events[-1].type == "turn.completed"
    assert closed == [True]  # aclose() ran the generator's cleanup


async def test_anything_a_stream_yields_after_done_is_ignored() -> None:
    async def gen(_: ModelRequest) -> AsyncIterator[ModelDelta]:
        yield Done(reply=ModelReply(text="first"))
        yield TextChunk(text="late")
        yield Done(reply=ModelReply(text="second"))

    rt = runtime_with(MemoryStore(), FnModel(gen))
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    assert await s.turn("hello") == "first"
    assert "message.delta" not in rec.types


async def test_s24_an_inbound_event_becomes_the_trigger() -> None:
    rt = runtime_with(MemoryStore(), ScriptedModel(["ok"]))
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    event = {"source": "slack", "kind": "app_mention", "channelId": "C1", "ts": "1.1", "raw": {"secret": "x"}}
    await s.turn("hi", turn_id="t1", event=event)
    first = rec.events[0]
    assert first.type == "turn.started"
    assert first.trigger.kind == "inbound"
    assert first.trigger.event.source == "slack"
    assert first.trigger.event.raw is None  # the channel's raw payload is never stored or sent


async def test_s25_start_returns_at_once_and_result_awaits() -> None:
    orders: list[dict[str, Any]] = []
    rt = runtime_with(MemoryStore(), ScriptedModel(ORDER_SCRIPT, delay_s=0.001), [list_order_tool(orders)])
    s = rt.session("ops", "s1")
    turn_id = await s.start("Order 3 widgets", turn_id="t1")
    assert turn_id == "t1"
    assert orders == []  # start did not wait for the turn
    result = await s.result("t1")
    assert isinstance(result, Completed) and result.text == "Done — order placed."


async def test_s26_result_answers_twice_from_the_durable_log() -> None:
    orders: list[dict[str, Any]] = []
    rt = runtime_with(MemoryStore(), ScriptedModel(ORDER_SCRIPT), [list_order_tool(orders)])
    s = rt.session("ops", "s1")
    await s.start("Order 3 widgets", turn_id="t1")
    first = await s.result("t1")
    second = await s.result("t1")
    assert first == second
    assert isinstance(second, Completed) and second.text == "Done — order placed."


async def test_s27_observe_with_replay_folds_the_committed_events() -> None:
    # DESIGN.md: our log holds every structural event, so the replay starts with turn.started
    # (the seed's fold skipped it because it had no log of it).
    orders: list[dict[str, Any]] = []
    rt = runtime_with(MemoryStore(), ScriptedModel(ORDER_SCRIPT), [list_order_tool(orders)])
    s = rt.session("ops", "s1")
    await s.turn("Order 3 widgets", turn_id="t1")
    rec = Recorder()
    s.observe(rec, turn_id="t1", replay=True)
    assert rec.types == [
        "turn.started",
        "message.completed",
        "action.requested",
        "action.completed",
        "message.completed",
        "turn.completed",
    ]
    assert rec.events[-1].text == "Done — order placed."
    folded = rec.of("action.completed")[0]
    assert folded.call.name == "create_order" and folded.call.input == {"item": "widget", "qty": 3}


async def test_s28_replay_of_an_empty_final_text_still_ends_with_turn_completed() -> None:
    rt = runtime_with(MemoryStore(), ScriptedModel([Reply("")]))
    s = rt.session("ops", "s1")
    await s.turn("hi", turn_id="t1")
    rec = Recorder()
    s.observe(rec, turn_id="t1", replay=True)
    assert rec.types == ["turn.started", "turn.completed"]  # no message.completed for an empty text
    assert rec.events[-1].text == ""


async def test_replay_then_live_delivers_nothing_twice() -> None:
    rt = runtime_with(MemoryStore(), ScriptedModel(["one", "two"]))
    s = rt.session("ops", "s1")
    await s.turn("a", turn_id="t1")
    rec = Recorder()
    s.observe(rec, replay=True)
    await s.turn("b", turn_id="t2")
    seqs = [e.seq for e in rec.events if e.seq is not None]
    assert seqs == sorted(set(seqs)) and seqs[0] == 1


async def test_s37_abnormal_finish_with_content_completes() -> None:
    model = ScriptedModel([Reply("partial ans", finish=Finish(reason="max_tokens", raw="max_tokens"))])
    rt = runtime_with(MemoryStore(), model)
    assert await rt.session("ops", "s1").turn("t") == "partial ans"


@pytest.mark.parametrize("finish", [Finish(reason="stop", raw="end_turn"), None])
async def test_s40_s41_normal_or_missing_finish_with_empty_reply_completes(finish: Finish | None) -> None:
    async def gen(_: ModelRequest) -> AsyncIterator[ModelDelta]:
        yield Done(reply=ModelReply(text=""), finish=finish)

    rt = runtime_with(MemoryStore(), FnModel(gen))
    assert await rt.session("ops", "s1").turn("t") == ""


@pytest.mark.parametrize("reason", ["max_tokens", "content_filter", "refusal", "malformed_tool_call", "other"])
async def test_s42_an_empty_abnormal_stop_fails_before_it_commits(reason: str) -> None:
    store = MemoryStore()
    rt = runtime_with(store, ScriptedModel([Reply("", finish=Finish(reason=reason))]))  # type: ignore[arg-type]
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    with pytest.raises(TurnFailedError, match=f"stopped abnormally — {reason} — and returned an empty reply$"):
        await s.turn("t", turn_id="t1")
    failed = rec.events[-1]
    assert failed.type == "turn.failed" and failed.phase == "model" and failed.step == "model:1"
    assert not any(isinstance(m, AssistantMessage) for m in transcript(store))  # nothing committed


@pytest.mark.parametrize("text", ["\n\n", " ", "\t \n"])
async def test_b39_an_abnormal_stop_with_only_whitespace_counts_as_empty_and_fails(text: str) -> None:
    store = MemoryStore()
    rt = runtime_with(store, ScriptedModel([Reply(text, finish=Finish(reason="refusal", raw="refusal"))]))
    with pytest.raises(TurnFailedError, match="stopped abnormally — refusal"):
        await rt.session("ops", "s1").turn("t", turn_id="t1")
    assert not any(isinstance(m, AssistantMessage) for m in transcript(store))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("max_tokens", "model stopped abnormally — max_tokens — and returned an empty reply"),
        (
            "model_context_window_exceeded",
            "model stopped abnormally — max_tokens (provider: model_context_window_exceeded) — and returned an empty reply",
        ),
    ],
)
async def test_s36_an_empty_abnormal_stop_says_it_returned_an_empty_reply(raw: str, expected: str) -> None:
    rt = runtime_with(MemoryStore(), ScriptedModel([Reply("", finish=Finish(reason="max_tokens", raw=raw))]))
    s = rt.session("ops", "s1")
    result = await s.result(await s.start("t", turn_id="t1"))
    assert isinstance(result, Failed) and result.error.message == expected


async def test_an_empty_abnormal_stop_names_the_provider_value() -> None:
    rt = runtime_with(MemoryStore(), ScriptedModel([Reply("", finish=Finish(reason="other", raw="pause_turn"))]))
    with pytest.raises(TurnFailedError, match=r"stopped abnormally — other \(provider: pause_turn\)"):
        await rt.session("ops", "s1").turn("t")


@pytest.mark.parametrize("reason", ["max_tokens", "malformed_tool_call"])
async def test_a_reply_cut_off_inside_its_only_tool_call_never_runs_it_and_the_model_step_fails(reason: str) -> None:
    # Given a reply of nothing but a call it stopped inside (on max_tokens: its input parsed, but short)
    orders: list[dict[str, Any]] = []
    calls = [{"id": "c1", "name": "create_order", "input": {"item": "widget", "qty": 1}}]
    cut = Reply("", calls=calls, cut=["c1"], finish=Finish(reason=reason, raw=reason))  # type: ignore[arg-type]
    model = ScriptedModel([cut, Reply("Ordered.")])
    store = MemoryStore()
    rt = runtime_with(store, model, [list_order_tool(orders)])
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    # When the turn runs, Then it fails in the model step, the call never ran and nothing of the reply committed
    with pytest.raises(
        TurnFailedError, match=f"stopped abnormally — {reason} while writing a tool call \\(create_order\\)"
    ):
        await s.turn("order 12 widgets", turn_id="t1")
    assert orders == []
    failed = rec.events[-1]
    assert failed.type == "turn.failed" and (failed.phase, failed.step) == ("model", "model:1")
    assert not any(isinstance(m, AssistantMessage) for m in transcript(store))


async def test_deltas_are_emitted_live_and_never_stored() -> None:
    store = SQLiteStore(":memory:")
    rt = runtime_with(store, ScriptedModel(["three word answer"], delay_s=0.0001))
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    await s.turn("t", turn_id="t1")
    deltas = rec.of("message.delta")
    assert "".join(d.text for d in deltas) == "three word answer"
    assert {d.step for d in deltas} == {"model:1"}
    assert all(e.type not in ("message.delta", "reasoning.delta") for e in store.events(s.ref))


async def test_reasoning_deltas_are_emitted_and_the_blocks_stored_on_the_message() -> None:
    store = MemoryStore()
    rt = runtime_with(store, ScriptedModel([Reply("answer", reasoning="thinking hard")]))
    rec = Recorder()
    s = rt.session("ops", "s1")
    s.observe(rec)
    await s.turn("t")
    assert [d.text for d in rec.of("reasoning.delta")] == ["thinking hard"]
    assistant = transcript(store)[-1]
    assert isinstance(assistant, AssistantMessage) and assistant.reasoning[0].text == "thinking hard"


async def test_s55_two_sessions_never_share_a_minted_turn_id() -> None:
    rt = runtime_with(MemoryStore(), ScriptedModel(["hi"]))
    ids = []
    for name in ("s1", "s2"):
        rec = Recorder()
        s = rt.session("ops", name)
        s.observe(rec)
        await s.turn("hello")
        ids.append(rec.events[0].turn_id)
    assert ids[0] != ids[1] and all(i.startswith("t_") and len(i) == 28 for i in ids)


async def test_s58_a_programmatic_turn_opens_with_a_user_message() -> None:
    store = MemoryStore()
    rt = runtime_with(store, ScriptedModel(["ok"]))
    await rt.session("ops", "s1").turn("hi", turn_id="t1")
    assert transcript(store)[0] == UserMessage(turn_id="t1", text="hi")


async def test_a_batch_of_calls_runs_in_order_and_each_result_is_its_own_step() -> None:
    seen: list[str] = []
    counter = Counter()
    from june_worker import tool

    @tool
    def echo(word: str) -> dict[str, str]:
        """Echo a word."""
        counter.runs += 1
        seen.append(word)
        return {"word": word}

    calls = [{"id": f"c{i}", "name": "echo", "input": {"word": w}} for i, w in enumerate(["a", "b", "c"])]
    store = MemoryStore()
    rt = runtime_with(store, ScriptedModel([Reply("", calls=calls), Reply("done")]), [echo])
    assert await rt.session("ops", "s1").turn("go") == "done"
    assert seen == ["a", "b", "c"]
    tools = [m for m in transcript(store) if isinstance(m, ToolMessage)]
    assert [m.call_id for m in tools] == ["c0", "c1", "c2"]


def test_the_unit_tier_refuses_network_calls() -> None:
    import socket

    with pytest.raises(PermissionError, match="no network calls in the unit tier"):
        socket.create_connection(("203.0.113.7", 443), timeout=0.1)


class _CountingLoads(SQLiteStore):
    loads = 0

    def load(self, ref: SessionRef) -> SessionSnapshot:
        self.loads += 1
        return super().load(ref)


async def test_a_runner_given_the_sessions_snapshot_does_not_read_the_store() -> None:
    # Given a session with one finished turn, read once by the host
    store = _CountingLoads(":memory:")
    rt = runtime_with(store, ScriptedModel(ORDER_SCRIPT * 2), [order_tool()])
    await rt.session("ops", "s1").turn("Order 3 widgets", turn_id="t1")
    ref = SessionRef("ops", "s1")
    snapshot = store.load(ref)
    rec, _ = store.enqueue_turn(ref, "t2", TurnPayload(text="Order 3 more"))
    loads = store.loads
    # When a runner is given that snapshot
    result = await TurnRunner(rt.agents["ops"], store, NullSink(), ref, rec, snapshot=snapshot).run()
    # Then it runs the turn on it, after the first turn's messages, and never loads
    assert isinstance(result, Completed) and result.text == "Done — order placed."
    assert store.loads == loads
    assert [m.turn_id for m in transcript(store)] == ["t1"] * 4 + ["t2"] * 4


def test_s39_a_done_made_without_a_finish_has_no_finish_key_when_dumped() -> None:
    bare = Done(reply=ModelReply(text="hi"))
    assert "finish" not in bare.model_dump() and '"finish"' not in bare.model_dump_json()
    finished = Done(reply=ModelReply(text="hi"), finish=Finish(reason="stop", raw="end_turn"))
    assert finished.model_dump()["finish"] == {"reason": "stop", "raw": "end_turn"}
    assert Done.model_validate(bare.model_dump()) == bare and Done.model_validate(finished.model_dump()) == finished


async def test_s43_a_tool_calls_provider_state_round_trips_through_the_stored_transcript(tmp_path: Any) -> None:
    # Given a model that attaches an opaque value to its call, and records what it is sent back
    state = {"signature": "EqQBsig-c1", "caller": {"type": "direct"}}
    seen: list[list[Any]] = []

    async def gen(request: ModelRequest) -> AsyncIterator[ModelDelta]:
        seen.append(list(request.messages))
        if isinstance(request.messages[-1], UserMessage):
            call = ToolCall(id="c1", name="create_order", input={"item": "widget"}, provider_state=state)
            yield Done(reply=ModelReply(text="", tool_calls=[call]))
        else:
            yield Done(reply=ModelReply(text="placed"))

    store = SQLiteStore(tmp_path / "june.db")
    rt = runtime_with(store, FnModel(gen), [list_order_tool([])])
    # When a turn runs, then a later turn runs on a new runtime over the same database
    assert await rt.session("ops", "s1").turn("order", turn_id="t1") == "placed"
    store.close()
    reopened = SQLiteStore(tmp_path / "june.db")
    later = runtime_with(reopened, FnModel(gen), [list_order_tool([])])
    assert await later.session("ops", "s1").turn("again", turn_id="t2") == "placed"
    # Then every request after the call, in and after the turn, carried the call's state unchanged
    calls = [c for m in seen[-1] if isinstance(m, AssistantMessage) for c in m.tool_calls]
    assert [c.provider_state for c in calls] == [state, state]  # t1's call and t2's call
    assert [c.provider_state for m in seen[1] if isinstance(m, AssistantMessage) for c in m.tool_calls] == [state]
    reopened.close()


def test_a_tool_call_without_provider_state_dumps_as_before_and_old_rows_load() -> None:
    old = {"role": "assistant", "turn_id": "t1", "text": "", "tool_calls": [{"id": "c1", "name": "a", "input": {}}]}
    message = MessageAdapter.validate_python(old)
    assert isinstance(message, AssistantMessage) and message.tool_calls[0].provider_state is None
    assert MessageAdapter.dump_python(message, mode="json") == {**old, "reasoning": []}


class _DeltaSink(NullSink):
    def __init__(self) -> None:
        self.deltas: list[Any] = []

    def publish_delta(self, ref: SessionRef, event: Any) -> None:
        self.deltas.append(event)


async def test_a_runner_stamps_the_attempt_its_host_gives_it_on_every_delta() -> None:
    # Given a host (the worker) that counts this as the turn's third attempt
    store = MemoryStore()
    ref = SessionRef("ops", "s1")
    rec, _ = store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
    agent = runtime_with(store, ScriptedModel(["Hello there, friend."])).agents["ops"]
    sink = _DeltaSink()
    # When the runner streams the model's reply
    await TurnRunner(agent, store, sink, ref, rec, attempt=3).run()
    # Then every delta says attempt 3 (without the parameter, the record's attempts + 1: 1 here)
    assert sink.deltas and {(d.type, d.attempt) for d in sink.deltas} == {("message.delta", 3)}
