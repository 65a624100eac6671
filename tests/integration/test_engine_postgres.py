"""The engine's storage rules on Postgres: the same replay and exactly-once tests as on memory and SQLite.

Each test gets its own schema on the test server (``search_path``), so the fixed session and
turn ids of the scenarios never collide.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from june_worker import ToolContext, store_write, tool
from june_worker.models import Reply, ScriptedModel
from tests.unit import kit
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
