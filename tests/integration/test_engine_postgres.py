"""The engine's storage rules on Postgres: the same replay and exactly-once tests as on memory and SQLite.

Each test gets its own schema on the test server (``search_path``), so the fixed session and
turn ids of the scenarios never collide.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from june_worker import ToolContext, store_write, tool
from june_worker.engine.events import Failed
from june_worker.models import Reply, ScriptedModel
from tests.unit import kit
from tests.unit.test_context_policy import (  # noqa: F401 - collected here, on Postgres
    test_a_session_far_past_the_window_keeps_working,
    test_a_turn_replayed_after_a_crash_at_any_point_of_its_compaction_stores_one_summary,
    test_reported_usage_past_the_threshold_makes_the_next_turn_compact_before_its_request,
)
from tests.unit.test_failure_policy import (  # noqa: F401 - collected here, on Postgres
    no_backoff,
    test_a_rejected_turn_is_recorded_rejected_in_one_write_with_its_event,
    test_a_retryable_provider_error_that_never_passes_ends_the_turn_as_poison_and_the_session_goes_on,
    test_a_retryable_provider_error_that_passes_on_a_later_attempt_completes_the_turn,
    test_a_sync_tool_that_catches_a_failed_statement_keeps_the_steps_transaction_usable,
    test_a_turn_that_ended_keeps_its_status_whatever_commits_later,
    test_a_turn_whose_process_dies_every_time_ends_failed_after_max_attempts,
    test_the_opening_commit_refuses_a_turn_whose_cancel_is_stored,
    test_unstorable_tool_values_are_made_storable_and_the_session_goes_on,
)
from tests.unit.test_parallel_tools import (  # noqa: F401 - collected here, on Postgres
    test_a_crash_anywhere_in_a_parallel_batch_reruns_only_calls_without_a_committed_result,
    test_a_fatal_call_cancels_the_rest_of_the_batch_and_fails_the_turn_with_a_valid_transcript,
    test_each_call_commits_its_result_as_it_finishes_and_the_events_say_which_run_together,
    test_sync_calls_of_a_parallel_batch_run_one_at_a_time_each_in_its_transaction,
)
from tests.unit.test_replay import (  # noqa: F401 - collected here, on Postgres
    test_a_cached_model_step_emits_no_delta_on_replay,
    test_a_crash_mid_batch_resumes_only_the_calls_still_owed,
    test_a_redelivered_finished_turn_reports_its_own_result_after_later_turns,
    test_async_tool_crashed_before_commit_runs_twice_at_least_once,
    test_crash_at_each_boundary_replays_to_the_clean_transcript,
    test_redelivery_never_appends_the_opening_twice,
    test_s8_sync_tool_crashed_after_commit_leaves_one_row_and_runs_once,
    test_sync_tool_crashed_before_commit_rolls_back_and_leaves_one_row_after_replay,
)
from tests.unit.test_several_inputs import (  # noqa: F401 - collected here, on Postgres
    test_a_crash_at_the_park_replays_to_one_park_on_both_requests,
    test_a_partial_answer_rewrites_the_turns_stored_result_to_the_requests_still_open,
    test_a_request_that_expires_is_answered_with_a_timeout_and_the_turn_waits_for_the_other,
    test_an_answer_made_from_an_older_checkpoint_is_refused_by_the_store,
    test_each_request_is_answered_on_its_own_and_the_turn_goes_on_after_the_last,
    test_many_answers_landing_at_once_all_apply_however_often_each_loses_a_race,
    test_two_parallel_calls_park_the_turn_on_both_requests,
)

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def own_schema(database_url: str) -> Iterator[str]:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'create schema "{schema}"')
    kit.POSTGRES_URL.append(psycopg.conninfo.make_conninfo(database_url, options=f"-c search_path={schema}"))
    try:
        yield schema
    finally:
        for store in kit.OPENED:
            store.close()
        kit.OPENED.clear()
        kit.POSTGRES_URL.pop()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'drop schema "{schema}" cascade')


@pytest.fixture
def store_kind() -> str:
    return "postgres"


@pytest.fixture
def sql_kind() -> str:
    return "postgres"


async def test_a_throwing_sync_tool_has_its_writes_rolled_back_on_postgres() -> None:
    @tool
    def create_order(ctx: ToolContext, item: str) -> dict[str, Any]:
        """Order, then fail."""
        store_write(ctx, "create table if not exists orders (item text)")
        store_write(ctx, "insert into orders (item) values (?)", item)
        raise ValueError("warehouse closed")

    store = kit.make_store("postgres")
    script = [Reply("", calls=[{"id": "c1", "name": "create_order", "input": {"item": "w"}}]), Reply("after")]
    rt = kit.runtime_with(store, ScriptedModel(script), [create_order])
    assert await rt.session("ops", "s1").turn("go") == "after"
    assert kit.count_orders(store) == 0
    events = store.events(rt.session("ops", "s1").ref)
    assert [e.error for e in events if e.type == "action.completed"] == ["ValueError: warehouse closed"]


# --- the failure policy on Postgres: a tool's failed statement, a lost connection, one clock (issue 10) ---


async def test_a_tool_that_swallows_a_failed_statement_on_the_raw_connection_fails_its_turn_not_the_session() -> None:
    @tool
    def careless(ctx: ToolContext) -> dict[str, Any]:
        """Runs a bad statement on the raw connection and swallows the error without a savepoint."""
        conn = ctx.store.unwrap()
        try:
            conn.execute("select * from missing_table")
        except Exception:
            pass
        return {"ok": True}

    store = kit.make_store("postgres")
    script = [Reply("", calls=[{"id": "c1", "name": "careless", "input": {}}]), Reply("next")]
    s = kit.runtime_with(store, ScriptedModel(script), [careless]).session("ops", "s1")
    result = await asyncio.wait_for(s.result(await s.start("go", turn_id="t1")), 20)
    assert isinstance(result, Failed) and result.phase == "tool" and result.step == "tool:1:c1"
    assert "aborted" in result.error.message and "conn.transaction()" in result.error.message
    assert await asyncio.wait_for(s.turn("again"), 20) == "next"


async def test_a_connection_lost_inside_a_sync_tool_runs_the_step_again_never_as_the_tools_result() -> None:
    runs = kit.Counter()

    @tool
    def order(ctx: ToolContext, item: str) -> dict[str, Any]:
        """Writes a row; on its first run the database connection is killed under it, and it swallows that."""
        runs.runs += 1
        store_write(ctx, "create table if not exists orders (item text)")
        store_write(ctx, "insert into orders (item) values (?)", item)
        if runs.runs == 1:
            try:
                ctx.store.query("select pg_terminate_backend(pg_backend_pid())")
            except Exception as exc:  # a tool that reports whatever went wrong as its own result
                return {"error": f"{type(exc).__name__}: {exc}"}
        return {"ordered": item}

    store = kit.make_store("postgres")
    script = [Reply("", calls=[{"id": "c1", "name": "order", "input": {"item": "w"}}]), Reply("placed")]
    s = kit.runtime_with(store, ScriptedModel(script), [order]).session("ops", "s1")
    assert await asyncio.wait_for(s.turn("go"), 20) == "placed"
    assert runs.runs == 2  # the step ran again...
    assert kit.count_orders(store) == 1  # ...and its write committed exactly once
    assert [e.result for e in store.events(s.ref) if e.type == "action.completed"] == [{"ordered": "w"}]


@pytest.mark.parametrize("fault", ["statement_timeout", "lock_nowait"])
async def test_a_statement_a_sync_tool_does_not_catch_is_the_tools_error_even_of_the_operational_family(
    fault: str,
) -> None:
    runs = kit.Counter()

    @tool
    def report(ctx: ToolContext) -> dict[str, Any]:
        """Writes, then runs a statement the server cancels (its own timeout) or refuses (a lock it will not wait
        for); catches nothing."""
        runs.runs += 1
        store_write(ctx, "create table if not exists orders (item text)")
        store_write(ctx, "insert into orders (item) values (?)", "w")
        if fault == "statement_timeout":
            ctx.store.execute("set local statement_timeout = '50ms'")
            ctx.store.query("select pg_sleep(5)")
        else:
            ctx.store.query("select * from it_locked for update nowait")
        return {"ok": True}

    store = kit.make_store("postgres")
    url = kit.POSTGRES_URL[-1]
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute("create table it_locked (id integer)")
        setup.execute("insert into it_locked values (1)")
    with psycopg.connect(url) as holder:  # another transaction holds the row for the whole turn
        holder.execute("select * from it_locked for update")
        script = [Reply("", calls=[{"id": "c1", "name": "report", "input": {}}]), Reply("read it"), Reply("next")]
        s = kit.runtime_with(store, ScriptedModel(script), [report]).session("ops", "s1")
        assert await asyncio.wait_for(s.turn("go"), 20) == "read it"  # the model read the error; the turn completed
        holder.rollback()
    assert runs.runs == 1  # never taken for a lost step and run again
    assert kit.count_orders(store) == 0  # the tool raised: its writes rolled back with it
    errors = [e.error for e in store.events(s.ref) if e.type == "action.completed"]
    expected = {"statement_timeout": "QueryCanceled", "lock_nowait": "LockNotAvailable"}[fault]
    assert len(errors) == 1 and errors[0] is not None and errors[0].startswith(expected)
    assert await asyncio.wait_for(s.turn("again"), 20) == "next"


def test_the_sweeper_finds_stranded_turns_and_expired_parks_by_the_databases_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose clock is a minute off neither re-sends a brand-new turn nor expires a park early."""
    import time as real_time

    from june_worker.engine.store import Commit, SessionRef, SuspendedCheckpoint, TurnPayload
    from june_worker.engine.types import InputRequest
    from june_worker.worker.queue import SessionQueue

    store = kit.make_store("postgres")
    queue = SessionQueue(store.pool, lease_s=30)  # type: ignore[attr-defined]
    fresh, parked = SessionRef("ops", "fresh"), SessionRef("ops", "parked")
    store.enqueue_turn(fresh, "t1", TurnPayload(text="on its way"))
    store.enqueue_turn(parked, "t2", TurnPayload(text="ask"))
    wall = real_time.time
    # The parking worker's clock is a minute slow: its own idea of the expiry is already past.
    monkeypatch.setattr(real_time, "time", lambda: wall() - 60)
    request = InputRequest(id="q", prompt="?", timeout_s=30, expires_at=real_time.time() + 30)
    checkpoint = SuspendedCheckpoint(turn_id="t2", request=request, call_id="c1", opening_text="ask")
    store.commit(parked, Commit(suspended=checkpoint, status="suspended", turn_id="t2", turn_status="suspended"))
    # The sweeping worker's clock is a minute fast.
    monkeypatch.setattr(real_time, "time", lambda: wall() + 60)
    assert queue.stranded(grace_s=10, limit=10) == []  # recorded a moment ago by the database's clock
    assert queue.expired_parks(limit=10) == []  # 30 s from now by the database's clock
    pending = store.pending(parked)
    assert pending is not None and pending.request.expires_at is not None
    assert abs(pending.request.expires_at - (wall() + 30)) < 5  # the store's stamp, not the parking worker's
