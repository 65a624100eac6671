"""The failure policy on real workers (issue 10): poison, guarded rejections, the relay, payloads, late cancels.

Each test names the rule it checks; every one of them failed on the worker before the failure
policy (5ac2ffb).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from june_worker.stores.postgres import PostgresStore
from tests._services import RedisServer

from .conftest import Stack, _database, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.modes("prefork", "threads")]

MAX_ATTEMPTS = 3


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> None:
    stack.worker("failures", env={"JUNE_MAX_ATTEMPTS": str(MAX_ATTEMPTS)})
    stack.beat()


def _structural_types(stack: Stack, agent: str, session: str, turn_id: str) -> list[str]:
    return [e["type"] for e in stack.structural(agent, session) if e["turn_id"] == turn_id]


# --- item 4: a tool that kills its process every time ---------------------------------------------


def test_a_tool_that_kills_its_process_every_time_ends_its_turn_failed_after_max_attempts(
    stack: Stack, session_id: str
) -> None:
    key = uuid.uuid4().hex
    turn_id = stack.turn("ops", session_id, f"die {key}")
    failed = stack.wait_terminal("ops", session_id, turn_id, timeout_s=90)
    assert failed["type"] == "turn.failed"
    assert (failed["error"]["type"], failed["phase"], failed["step"]) == ("PoisonTurnError", "tool", "tool:1:c1")
    assert f"given up after {MAX_ATTEMPTS} attempts" in failed["error"]["message"]
    row = stack.turn_row("ops", session_id, turn_id)
    assert row is not None and row["status"] == "failed" and row["attempts"] == MAX_ATTEMPTS
    assert int(stack.redis.get(f"it:die:{key}") or 0) == MAX_ATTEMPTS  # never redelivered past the limit
    # ... and the session serves its next turn.
    after = stack.turn("ops", session_id, "order 2 nut")
    assert stack.wait_terminal("ops", session_id, after)["type"] == "turn.completed"


# --- a retryable provider error that outlasts a step's retries -------------------------------------


def _dispatched_at(stack: Stack, agent: str, session: str, turn_id: str) -> Any:
    rows = stack.sql(
        "select dispatched_at from june_turns where agent = %s and session = %s and turn_id = %s",
        agent,
        session,
        turn_id,
    )
    return rows[0][0]


def test_a_retryable_provider_error_that_never_passes_ends_the_turn_as_poison_and_the_next_turn_runs(
    stack: Stack, session_id: str
) -> None:
    from june_worker.engine.failures import STEP_RETRIES

    key = uuid.uuid4().hex
    turn_id = stack.turn("overloaded", session_id, f"overloaded never {key}")
    after = stack.turn("overloaded", session_id, "hello")
    failed = stack.wait_terminal("overloaded", session_id, turn_id, timeout_s=60)
    assert failed["type"] == "turn.failed"
    assert (failed["error"]["type"], failed["phase"], failed["step"]) == ("PoisonTurnError", "model", "model:1")
    assert f"given up after {MAX_ATTEMPTS} attempts" in failed["error"]["message"]
    assert "overloaded" in failed["error"]["message"]  # the last error, for whoever reads the failure
    row = stack.turn_row("overloaded", session_id, turn_id)
    assert row is not None and row["status"] == "failed" and row["attempts"] == MAX_ATTEMPTS
    assert int(stack.redis.get(f"it:overloaded:{key}") or 0) == MAX_ATTEMPTS * (1 + STEP_RETRIES)
    # The worker retried the attempts itself, with backoff: nothing waited for the lease to lapse and a sweep.
    assert _dispatched_at(stack, "overloaded", session_id, turn_id) is None
    assert stack.wait_terminal("overloaded", session_id, after)["type"] == "turn.completed"


def test_a_retryable_provider_error_that_passes_on_a_later_attempt_completes_the_turn(
    stack: Stack, session_id: str
) -> None:
    from june_worker.engine.failures import STEP_RETRIES

    key = uuid.uuid4().hex
    fails = (MAX_ATTEMPTS - 1) * (1 + STEP_RETRIES)  # every attempt but the last fails, the last passes
    turn_id = stack.turn("overloaded", session_id, f"overloaded {fails} {key}")
    done = stack.wait_terminal("overloaded", session_id, turn_id, timeout_s=60)
    assert done["type"] == "turn.completed"
    row = stack.turn_row("overloaded", session_id, turn_id)
    assert row is not None and row["status"] == "completed" and row["attempts"] == MAX_ATTEMPTS
    assert int(stack.redis.get(f"it:overloaded:{key}") or 0) == fails + 1
    assert _dispatched_at(stack, "overloaded", session_id, turn_id) is None


def test_a_turn_whose_process_dies_at_every_start_before_the_runner_counts_it_ends_failed_after_max_attempts(
    own_db: str, redis_url: str, tmp_path: Path
) -> None:
    PostgresStore(own_db).close()
    dying = Stack(own_db, redis_url, tmp_path)
    try:
        # Every start of every turn is killed after the turn was picked and before the runner writes anything (as
        # an out-of-memory while loading the session would be): only the pick's own count can give the turn up.
        # (The first pick is the intake, which records and opens the turn in one statement; the later ones are
        # the sweeper's re-sends, each counted where it is picked.)
        env = {"JUNE_MAX_ATTEMPTS": str(MAX_ATTEMPTS), "JUNE_CRASH_AT": "before-start"}
        dying.worker("dying", env=env)
        dying.beat()
        session = f"dying-{uuid.uuid4().hex[:6]}"
        turn_id = dying.turn("ops", session, "hello")
        failed = dying.wait_terminal("ops", session, turn_id, timeout_s=90)
        assert failed["type"] == "turn.failed"
        assert (failed["error"]["type"], failed["phase"], failed["step"]) == ("PoisonTurnError", "model", "model:1")
        assert f"given up after {MAX_ATTEMPTS} attempts" in failed["error"]["message"]
        assert "each ended without a result" in failed["error"]["message"]
        row = dying.turn_row("ops", session, turn_id)
        assert row is not None and row["status"] == "failed" and row["attempts"] == MAX_ATTEMPTS
        # it opened (with its intake), and no step of it ever ran
        assert _structural_types(dying, "ops", session, turn_id) == ["turn.started", "turn.failed"]
    finally:
        dying.close()


# --- item 6: a rejected turn is never queued, so nothing can run it --------------------------------


@pytest.fixture
def status_log(stack: Stack) -> Iterator[None]:
    """Every status a june_turns row ever takes, in order (a trigger), for this module's database."""
    PostgresStore(stack.db_url).close()  # the schema, if no worker made it yet
    stack.sql("create table if not exists it_status_log (n bigserial, turn_id text, status text)")
    stack.sql(
        """
        create or replace function it_log_status() returns trigger language plpgsql as $$
        begin
            if tg_op = 'INSERT' or new.status is distinct from old.status then
                insert into it_status_log (turn_id, status) values (new.turn_id, new.status);
            end if;
            return new;
        end $$;
        drop trigger if exists it_log_status on june_turns;
        create trigger it_log_status after insert or update on june_turns for each row execute function it_log_status();
        """
    )
    yield
    stack.sql("drop trigger if exists it_log_status on june_turns")


def test_a_turn_refused_at_intake_is_recorded_rejected_and_never_queued(
    stack: Stack, session_id: str, status_log: None
) -> None:
    parked = stack.turn("ops", session_id, "refund", event={"source": "slack", "user": {"id": "U1", "attested": True}})
    assert stack.wait_terminal("ops", session_id, parked)["type"] == "input.requested"
    refused = stack.turn("ops", session_id, "order 1 widget")
    assert stack.wait_terminal("ops", session_id, refused)["type"] == "turn.failed"
    statuses = [s for (s,) in stack.sql("select status from it_status_log where turn_id = %s order by n", refused)]
    assert statuses == ["rejected"]
    assert _structural_types(stack, "ops", session_id, refused) == ["turn.failed"]
    assert stack.sql("select count(*) from it_orders where turn_id = %s", refused) == [(0,)]


# --- item 10: payload strings the store cannot hold ------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("text", {"text": "caf\udce9 au lait"}),
        ("event.source", {"text": "hi", "event": {"source": "sl\udcffck"}}),
        ("trigger.by", {"text": "hi", "trigger": {"kind": "proactive", "by": "cron\x00daily"}}),
    ],
    ids=["text", "event-source", "trigger-by"],
)
def test_a_turn_whose_payload_cannot_be_stored_is_rejected_recorded_and_ends_its_stream(
    stack: Stack, session_id: str, field: str, value: dict[str, Any]
) -> None:
    turn_id = f"t_{uuid.uuid4().hex}"
    out = stack.outcome(stack.send("june.turn", {"turn_id": turn_id, "agent": "ops", "session": session_id, **value}))
    assert out["status"] == "rejected" and "cannot be stored" in out["reason"] and field in out["reason"]
    row = stack.turn_row("ops", session_id, turn_id)
    assert row is not None and row["status"] == "rejected"
    ended = stack.wait_terminal("ops", session_id, turn_id)
    assert ended["type"] == "turn.failed" and ended["phase"] == "intake" and field in ended["error"]["message"]
    after = stack.turn("ops", session_id, "hello")
    assert stack.wait_terminal("ops", session_id, after)["type"] == "turn.completed"


# --- item 9: events committed while Redis was down reach the stream however old -------------------


@pytest.fixture
def own_db(database_url: str) -> Iterator[str]:
    """A database of this test's own: no other test's sweeper relays or re-sends its sessions."""
    yield from _database(database_url)


@pytest.fixture
def split(
    own_db: str, redis_url: str, private_redis: RedisServer, tmp_path: Path
) -> Iterator[tuple[Stack, RedisServer]]:
    """Workers whose event Redis is a private one (stopped by the test); the broker stays on the shared Redis."""
    PostgresStore(own_db).close()  # the schema, before a worker makes it: the test reads the tables at once
    s = Stack(own_db, private_redis.url, tmp_path)
    s.sql("create table it_orders (turn_id text not null, call_id text not null, item text, qty integer)")
    s.env.update({"CELERY_BROKER_URL": redis_url, "CELERY_RESULT_BACKEND": redis_url})
    s.client = Celery("june-it-split", broker=redis_url, backend=redis_url)
    s.client.conf.update(
        task_serializer="json", accept_content=["json"], result_accept_content=["json"], task_default_queue=s.queue
    )
    s.client.conf.task_routes = {"june.sweep": {"queue": s.control_queue}}
    try:
        yield s, private_redis
    finally:
        s.stop()


def test_events_committed_while_redis_was_down_are_relayed_however_old_the_session(
    split: tuple[Stack, RedisServer],
) -> None:
    stack, events_redis = split
    session = f"dark-{uuid.uuid4().hex[:6]}"
    stack.worker("split", pool="solo")
    events_redis.stop()
    turn_id = stack.turn("ops", session, "order 3 bolt")

    def committed() -> bool:
        return (stack.turn_row("ops", session, turn_id) or {}).get("status") == "completed"

    wait_for(committed, timeout_s=30, what="the turn to complete in Postgres while Redis is down")
    # Long ago, by any recent-activity window: only an index of what is behind finds it now.
    stack.sql("update june_sessions set updated_at = updated_at - 86400 where session = %s", session)
    events_redis.start()
    stack.beat()
    wait_for(
        lambda: "turn.completed" in [e["type"] for e in stack.structural("ops", session)],
        timeout_s=30,
        what="the sweeper to relay the turn's events",
    )
    events = stack.structural("ops", session)
    assert [e["seq"] for e in events] == list(range(1, 7))  # started, message, action x2, message, completed
    assert stack.sql("select relayed_seq = event_seq from june_sessions where session = %s", session) == [(True,)]


def test_a_turn_on_a_session_with_history_completes_while_the_events_redis_is_down_and_is_relayed_after(
    split: tuple[Stack, RedisServer],
) -> None:
    stack, events_redis = split
    session = f"dark-{uuid.uuid4().hex[:6]}"
    stack.worker("split", pool="solo")
    first = stack.turn("ops", session, "order 1 nut")
    assert stack.wait_terminal("ops", session, first)["type"] == "turn.completed"  # the session has events
    events_redis.stop()
    second = stack.turn("ops", session, "order 2 bolt")  # its holder cannot read the stream's marker

    def completed() -> bool:
        return (stack.turn_row("ops", session, second) or {}).get("status") == "completed"

    wait_for(completed, timeout_s=30, what="the turn to complete in Postgres while Redis is down")
    assert stack.sql("select count(*) from it_orders where turn_id = %s", second) == [(1,)]
    events_redis.start()  # empty: the sweeper rebuilds the stream from the outbox
    stack.beat()
    wait_for(
        lambda: [e["seq"] for e in stack.structural("ops", session)] == list(range(1, 13)),
        timeout_s=30,
        what="the sweeper to relay both turns' events",
    )
    assert [e["type"] for e in stack.structural("ops", session) if e["turn_id"] == second][-1] == "turn.completed"


@pytest.fixture
def host(own_db: str, redis_url: str) -> Iterator[Any]:
    """A worker host in this process (no Celery), on a database and key prefix of its own."""
    from june_worker.worker.host import WorkerHost
    from june_worker.worker.settings import WorkerSettings

    from .agents import ALL

    prefix = f"june-it-{uuid.uuid4().hex[:8]}"
    settings = WorkerSettings(database_url=own_db, redis_url=redis_url, key_prefix=prefix, lease_s=60, alive_s=1)
    h = WorkerHost(settings, {a.name: a for a in ALL()})
    try:
        yield h
    finally:
        h.close()


def _relay_marks(h: Any) -> list[tuple[str, int, int]]:
    with h.store.pool.connection() as conn:
        rows = conn.execute("select session, relayed_seq, event_seq from june_sessions order by session").fetchall()
    return [(str(s), int(r), int(e)) for s, r, e in rows]


def test_one_sweep_relays_every_session_behind_its_outbox_however_many_pages_they_fill(host: Any) -> None:
    from june_worker.engine.events import TurnStarted
    from june_worker.engine.store import Commit, SessionRef, TurnPayload
    from june_worker.engine.types import ProactiveTrigger
    from june_worker.worker.sweeper import sweep

    page = 3
    refs = [SessionRef("ops", f"behind-{i:02d}") for i in range(3 * page + 1)]  # past three full pages
    for ref in refs:  # committed, never published: a worker died between the commit and the publish
        host.store.enqueue_turn(ref, "t1", TurnPayload(text="hi"))
        host.store.commit(ref, Commit(events=[TurnStarted(turn_id="t1", trigger=ProactiveTrigger())]))
    assert all(relayed == 0 and committed == 1 for _, relayed, committed in _relay_marks(host))
    summary = sweep(host, lambda rec: None, limit=page)
    assert summary["relayed"] == len(refs)
    for ref in refs:
        entries = host.redis.xrange(host.keys.session_stream(ref))
        assert [json.loads(f[b"data"])["seq"] for _, f in entries] == [1], ref
    assert [(relayed, committed) for _, relayed, committed in _relay_marks(host)] == [(1, 1)] * len(refs)


def test_a_holder_marks_what_its_publishes_relayed_so_the_sweeper_need_not_look(host: Any) -> None:
    from june_worker.engine.store import SessionRef, TurnPayload

    ref = SessionRef("ops", f"marked-{uuid.uuid4().hex[:6]}")
    host.store.enqueue_turn(ref, "t1", TurnPayload(text="order 2 nut"))
    assert host.drain(ref)["t1"].status == "completed"
    # No sweeper runs here: the holder's heartbeat writes the mark its publishes' replies confirmed.
    wait_for(
        lambda: _relay_marks(host) == [(ref.session, 6, 6)],
        timeout_s=10,
        what="the holder to mark its session relayed",
    )
    assert len([f for _, f in host.redis.xrange(host.keys.session_stream(ref)) if b"delta" not in f[b"type"]]) == 6


# --- item 7: a cancel signal that arrives while the next turn is being picked -------------------------


def test_a_cancel_signalled_while_the_worker_picks_the_turn_is_not_missed(
    own_db: str, redis_url: str, session_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    from june_worker.engine.events import TurnStarted
    from june_worker.engine.store import Commit, SessionRef, TurnPayload
    from june_worker.engine.types import AssistantMessage, ProactiveTrigger, ToolCall, UserMessage
    from june_worker.worker.host import WorkerHost
    from june_worker.worker.settings import WorkerSettings

    from .agents import ALL

    prefix = f"june-it-{uuid.uuid4().hex[:8]}"
    # A long lease: its heartbeat, which also re-reads the cancel, stays out of the picture.
    settings = WorkerSettings(database_url=own_db, redis_url=redis_url, key_prefix=prefix, lease_s=60, alive_s=2)
    host = WorkerHost(settings, {a.name: a for a in ALL()})
    try:
        ref = SessionRef("ops", session_id)
        # A turn opened by an earlier attempt (its worker died) whose next step is a tool: the next holder
        # replays it. A tool's result is not guarded by the stored cancel (what ran keeps its result), so only
        # the signal, kept while the turn was being picked, can stop the replay before the tool runs.
        call = ToolCall(id="c1", name="create_order", input={"item": "bolt", "qty": 1})
        host.store.enqueue_turn(ref, "t1", TurnPayload(text="order 1 bolt"))
        host.store.commit(
            ref,
            Commit(
                messages=[
                    (0, UserMessage(turn_id="t1", text="order 1 bolt")),
                    (1, AssistantMessage(turn_id="t1", text="Placing it.", tool_calls=[call])),
                ],
                events=[TurnStarted(turn_id="t1", trigger=ProactiveTrigger())],
                status="running",
                turn_id="t1",
                turn_status="running",
            ),
        )
        take = host.queue.take

        def take_then_get_signalled(r: SessionRef, owner: str) -> Any:
            lease = take(r, owner)  # the turn is read without a cancel...
            host.store.request_cancel(r, "requested", turn_ids=["t1"])  # ...which lands right after, signalled
            host.signal_cancel(r, ["t1"], "requested")
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and not getattr(host._running.get(r), "signalled", None):
                time.sleep(0.01)  # let the control listener hear it (the window the test opens)
            return lease

        monkeypatch.setattr(host.queue, "take", take_then_get_signalled)
        ran = host.drain(ref)
        assert ran["t1"].status == "cancelled"
        types = [e.type for e in host.store.events(ref, turn_id="t1")]
        assert types == ["turn.started", "turn.cancelled"]  # no tool's action, no model reply
        with psycopg.connect(own_db, autocommit=True) as conn:
            orders = conn.execute("select to_regclass('it_orders') is not null").fetchone()
        assert orders == (False,)  # the tool never ran (it makes its table on its first run)
        stream = host.redis.xrange(host.keys.session_stream(ref))
        assert [f[b"type"] for _, f in stream if f[b"type"] == b"message.delta"] == []  # the model was never asked
    finally:
        host.close()
