"""Workers die at any line; the turn still ends as one clean run would (JUNE_LEASE_S=2, JUNE_SWEEP_S=0.5).

Each test kills workers it started itself: SIGKILL of the whole process group, as a machine
dying would. A turn already recorded is recovered through the lease expiring and the sweeper
(Celery beat) re-sending it. A message taken but not yet recorded can only come back from the
broker: RabbitMQ hands it out again when the dead worker's connection drops, Redis after the
visibility timeout, which is three lease lengths (not Celery's hour). Tests marked
``brokers`` run on both.
"""

from __future__ import annotations

import collections
import time
import uuid

import psycopg
import pytest

from .conftest import Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.modes("prefork", "threads")]

LEASE_S, SWEEP_S = 2.0, 0.5
RECOVERY_BOUND_S = LEASE_S + SWEEP_S + 10.0  # generous for a loaded CI machine; the benchmark measures it
# A message nobody recorded: the Redis broker's visibility timeout (3 leases) plus one look for it (a sixth of that).
UNRECORDED_BOUND_S = 3 * LEASE_S + LEASE_S / 2 + 10.0


@pytest.fixture(scope="module", autouse=True)
def beat(stack: Stack) -> None:
    stack.beat()


def _completed(stack: Stack, agent: str, session: str, turn_id: str) -> bool:
    """Completed in Postgres and published: the stream holds the turn's turn.completed."""
    if (stack.turn_row(agent, session, turn_id) or {}).get("status") != "completed":
        return False
    return any(e["type"] == "turn.completed" and e["turn_id"] == turn_id for e in stack.structural(agent, session))


def _assert_clean_stream(stack: Stack, agent: str, session: str) -> list[dict[str, object]]:
    events = stack.structural(agent, session)
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(1, len(seqs) + 1)), f"structural events not exactly once, in order: {seqs}"
    requested = {e["step"] for e in events if e["type"] == "action.requested"}
    for e in events:
        if e["type"] == "action.completed":
            assert e["step"] in requested
    return events


@pytest.mark.brokers("redis", "amqp")
@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_sigkill_mid_tool_step_another_worker_finishes_within_the_lease_bound(stack: Stack, pool: str) -> None:
    session, key = f"kill-tool-{pool}-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    doomed = stack.worker(f"doomed-{pool}-{key[:4]}", pool=pool)
    turn_id = stack.turn("ops", session, f"slow {key}")
    wait_for(lambda: stack.redis.llen(f"it:hold:{key}:log") == 1, what="the tool to start on the doomed worker")
    doomed.kill()
    killed_at = time.monotonic()
    rescuer = stack.worker(f"rescuer-{pool}-{key[:4]}", pool=pool)
    try:
        wait_for(lambda: _completed(stack, "ops", session, turn_id), timeout_s=RECOVERY_BOUND_S, what="recovery")
        recovered_s = time.monotonic() - killed_at
    finally:
        rescuer.stop()
    # The async tool ran again (at-least-once, by design), the turn completed once.
    assert stack.redis.lrange(f"it:hold:{key}:log", 0, -1)[1].endswith(":2")
    events = _assert_clean_stream(stack, "ops", session)
    assert [e["type"] for e in events].count("turn.completed") == 1
    assert recovered_s < RECOVERY_BOUND_S


@pytest.mark.brokers("redis", "amqp")
def test_a_prefork_parent_killed_between_taking_a_message_and_recording_it_loses_no_turn(stack: Stack) -> None:
    # Given a prefork worker whose main process dies (SIGKILL, with its pool) after a pool process
    # received a june.turn message and before the turn was recorded
    session = f"intake-kill-{uuid.uuid4().hex[:6]}"
    doomed = stack.worker(f"doomed-{session[-6:]}", env={"JUNE_CRASH_AT": "before-intake"})
    turn_id = stack.turn("ops", session, "order 3 washer")
    wait_for(lambda: doomed.popen.poll() is not None, what="the worker's main process to be killed")
    doomed.kill()  # whatever is left of its process group
    killed_at = time.monotonic()
    assert stack.turn_row("ops", session, turn_id) is None  # Postgres never heard of it: only the broker has it
    # When another worker is up
    rescuer = stack.worker(f"rescuer-{session[-6:]}")
    try:
        wait_for(lambda: _completed(stack, "ops", session, turn_id), timeout_s=UNRECORDED_BOUND_S, what="recovery")
        recovered_s = time.monotonic() - killed_at
    finally:
        rescuer.stop()
    # Then the broker handed the message out again within a few leases, and the turn ran once
    assert recovered_s < UNRECORDED_BOUND_S
    assert stack.sql("select qty from it_orders where turn_id = %s", turn_id) == [(3,)]
    assert [e["type"] for e in _assert_clean_stream(stack, "ops", session)].count("turn.started") == 1


def test_sigkill_mid_model_stream_replays_the_model_step_on_another_worker(stack: Stack) -> None:
    session = f"kill-model-{uuid.uuid4().hex[:6]}"
    doomed = stack.worker(f"doomed-model-{session[-4:]}", env={"JUNE_IT_DELTAS": "3000"})
    turn_id = stack.turn("dribble", session, "talk")
    wait_for(lambda: len(stack.events("dribble", session)) > 20, what="the model to stream")
    doomed.kill()
    rescuer = stack.worker(f"rescuer-model-{session[-4:]}", env={"JUNE_IT_DELTAS": "50"})
    try:
        wait_for(lambda: _completed(stack, "dribble", session, turn_id), timeout_s=RECOVERY_BOUND_S)
    finally:
        rescuer.stop()
    events = _assert_clean_stream(stack, "dribble", session)
    assert [e["type"] for e in events] == ["turn.started", "message.completed", "turn.completed"]
    assert events[-1]["text"] == "streamed 50"
    deltas = [e for e in stack.events("dribble", session) if e["type"] == "message.delta"]
    assert {d["step"] for d in deltas} == {"model:1"}  # both attempts' tokens carry the step id


@pytest.mark.parametrize(
    "crash_at",
    ["before-tool-commit@tool:1:c1", "after-tool-commit@tool:1:c1", "before-publish@tool:1:c1",
     "after-model-commit@model:1", "before-model-commit@model:3"],
)  # fmt: skip
def test_killed_at_a_commit_boundary_leaves_exactly_one_order_row_and_one_of_each_event(
    stack: Stack, crash_at: str
) -> None:
    session = f"crash-{crash_at.split('@')[0]}-{uuid.uuid4().hex[:6]}"
    # a solo worker: the crash hook's SIGKILL takes the whole worker down, as a dead machine would
    doomed = stack.worker(f"doomed-{session[-6:]}", pool="solo", env={"JUNE_CRASH_AT": crash_at})
    turn_id = stack.turn("ops", session, "order 2 bolt")
    wait_for(lambda: doomed.popen.poll() is not None, what="the worker to kill itself at the crash point")
    doomed.kill()
    rescuer = stack.worker(f"rescuer-{session[-6:]}")
    try:
        wait_for(lambda: _completed(stack, "ops", session, turn_id), timeout_s=RECOVERY_BOUND_S)
    finally:
        rescuer.stop()
    assert stack.sql("select count(*) from it_orders where turn_id = %s", turn_id) == [(1,)]
    events = _assert_clean_stream(stack, "ops", session)
    assert [e["type"] for e in events] == [
        "turn.started",
        "message.completed",
        "action.requested",
        "action.completed",
        "message.completed",
        "turn.completed",
    ]


@pytest.mark.parametrize(
    "crash_at", ["before-compact-commit@compact:3", "after-compact-commit@compact:3", "before-publish@compact:3"]
)
def test_killed_in_a_compaction_step_the_turn_replays_to_one_summary_and_one_event(stack: Stack, crash_at: str) -> None:
    session = f"compact-{crash_at.split('@')[0]}-{uuid.uuid4().hex[:6]}"
    # Given a worker that dies at `crash_at` (the session's second turn compacts first: see agents.py "window")
    doomed = stack.worker(f"doomed-{session[-6:]}", pool="solo", env={"JUNE_CRASH_AT": crash_at})
    first = stack.turn("window", session, "hello")
    wait_for(lambda: _completed(stack, "window", session, first), what="the first turn")
    turn_id = stack.turn("window", session, "x" * 300)
    wait_for(lambda: doomed.popen.poll() is not None, what="the worker to kill itself in the compaction step")
    doomed.kill()
    # When another worker takes the turn over
    rescuer = stack.worker(f"rescuer-{session[-6:]}")
    try:
        wait_for(lambda: _completed(stack, "window", session, turn_id), timeout_s=RECOVERY_BOUND_S)
    finally:
        rescuer.stop()
    # Then the transcript holds one summary, its event was published once, and the answer came after it
    roles = stack.sql("select role from june_messages where session = %s order by idx", session)
    assert [r for (r,) in roles] == ["user", "assistant", "user", "summary", "assistant"]
    events = _assert_clean_stream(stack, "window", session)
    assert [e["type"] for e in events if e["turn_id"] == turn_id] == [
        "turn.started",
        "context.compacted",
        "message.completed",
        "turn.completed",
    ]


def test_postgres_connections_killed_mid_turn_reconnect_and_nothing_is_duplicated(stack: Stack) -> None:
    session, key = f"pgkill-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    worker = stack.worker(f"pgkill-{key[:4]}")
    try:
        turn_id = stack.turn("ops", session, f"slow {key}")
        wait_for(lambda: stack.redis.llen(f"it:hold:{key}:log") == 1, what="the tool to start")
        dbname = psycopg.conninfo.conninfo_to_dict(stack.db_url)["dbname"]
        killed = stack.sql(
            "select pg_terminate_backend(pid) from pg_stat_activity where datname = %s and pid <> pg_backend_pid()",
            dbname,
        )
        assert killed, "no worker connection was there to kill"
        stack.redis.set(f"it:hold:{key}:release", 1)
        wait_for(lambda: _completed(stack, "ops", session, turn_id), timeout_s=30)
        then = stack.turn("ops", session, "order 1 nut")
        wait_for(lambda: _completed(stack, "ops", session, then), timeout_s=30)
    finally:
        worker.stop()
    assert stack.sql("select count(*) from it_orders where turn_id = %s", then) == [(1,)]
    assert stack.redis.llen(f"it:hold:{key}:log") == 1  # the tool was not run again
    _assert_clean_stream(stack, "ops", session)


@pytest.mark.brokers("redis", "amqp")
def test_twenty_sessions_times_five_turns_run_in_order_one_at_a_time(stack: Stack) -> None:
    workers = [stack.worker(f"load-{i}", concurrency=2) for i in range(2)]
    try:
        sessions = [f"load-{uuid.uuid4().hex[:6]}-{i}" for i in range(20)]
        sent: dict[str, list[str]] = collections.defaultdict(list)
        for n in range(5):
            for s in sessions:
                sent[s].append(stack.turn("ops", s, f"turn {n}"))

        def all_done() -> bool:
            return all(
                stack.sql(
                    "select count(*) from june_turns where agent = 'ops' and session = %s and status = 'completed'", s
                )
                == [(5,)]
                for s in sessions
            )

        wait_for(all_done, timeout_s=90, every_s=0.2, what="100 turns")
    finally:
        for w in workers:
            w.stop()
    for s in sessions:
        events = stack.structural("ops", s)
        starts_and_ends = [(e["type"], e["turn_id"]) for e in events if e["type"] in ("turn.started", "turn.completed")]
        order = [t for kind, t in starts_and_ends if kind == "turn.started"]
        # one at a time: every start is followed by its own completion before the next start
        assert starts_and_ends == [pair for t in order for pair in (("turn.started", t), ("turn.completed", t))]
        positions = stack.sql(
            "select turn_id from june_turns where agent = 'ops' and session = %s order by position", s
        )
        assert order == [r[0] for r in positions]  # in arrival order
        assert sorted(order) == sorted(sent[s])


def test_a_turn_cancelled_while_its_worker_is_dead_is_still_cancelled_after_recovery(stack: Stack) -> None:
    session = f"dead-cancel-{uuid.uuid4().hex[:6]}"
    doomed = stack.worker(f"doomed-dc-{session[-4:]}", env={"JUNE_IT_DELTAS": "3000"})
    turn_id = stack.turn("dribble", session, "talk")
    wait_for(lambda: len(stack.events("dribble", session)) > 5, what="the model to stream")
    doomed.kill()
    # The cancel is recorded in Postgres while nobody runs the turn
    control = stack.worker(f"control-dc-{session[-4:]}", queues=stack.control_queue, pool="solo")
    out = stack.send("june.cancel", {"agent": "dribble", "session": session, "turn_id": turn_id}).get(timeout=30)
    assert out["turn_ids"] == [turn_id]
    rescuer = stack.worker(f"rescuer-dc-{session[-4:]}", queues=stack.queue)
    try:
        end = stack.wait_terminal("dribble", session, turn_id, timeout_s=RECOVERY_BOUND_S)
    finally:
        rescuer.stop()
        control.stop()
    assert (end["type"], end["reason"]) == ("turn.cancelled", "requested")
    assert "message.completed" not in [e["type"] for e in stack.structural("dribble", session)]


# --- delivery to a turn's target: at least once ------------------------------------------------------


def _delivery(stack: Stack, session: str, turn_id: str) -> tuple[bool, int]:
    """(deliver_due, delivery_attempts) of the turn; a turn not recorded yet counts as (True, 0)."""
    row = stack.sql(
        "select deliver_due, delivery_attempts from june_turns where agent = 'ops' and session = %s and turn_id = %s",
        session,
        turn_id,
    )
    return (bool(row[0][0]), int(row[0][1])) if row else (True, 0)


def test_a_worker_killed_before_delivering_a_turn_leaves_it_for_another_worker_to_deliver(stack: Stack) -> None:
    # Given a worker that dies after the turn's ending commit, before its deliver hook runs
    session = f"deliver-kill-{uuid.uuid4().hex[:6]}"
    doomed = stack.worker(f"doomed-{session[-6:]}", pool="solo", env={"JUNE_CRASH_AT": "before-deliver"})
    turn_id = stack.turn("ops", session, "digest", target={"channel": "C-ops"})
    wait_for(lambda: doomed.popen.poll() is not None, what="the worker to kill itself before delivering")
    doomed.kill()
    assert _completed(stack, "ops", session, turn_id)  # the turn ended; only its delivery is owed
    assert stack.redis.lrange(f"it:delivered:{session}", 0, -1) == []
    # When another worker and the sweeper are up
    rescuer = stack.worker(f"rescuer-{session[-6:]}")
    try:
        wait_for(lambda: _delivery(stack, session, turn_id) == (False, 2), timeout_s=RECOVERY_BOUND_S, what="delivery")
    finally:
        rescuer.stop()
    # Then the turn was delivered once, by the second attempt (the first died with its worker)
    delivered = stack.redis.lrange(f"it:delivered:{session}", 0, -1)
    assert len(delivered) == 1 and delivered[0].startswith("C-ops|"), delivered
    assert _delivery(stack, session, turn_id) == (False, 2)


def test_a_failing_deliver_hook_is_tried_again_by_the_sweeper_then_given_up(stack: Stack) -> None:
    session = f"deliver-fail-{uuid.uuid4().hex[:6]}"
    worker = stack.worker(f"deliver-fail-{session[-6:]}", env={"JUNE_DELIVERY_ATTEMPTS": "3"})
    try:
        turn_id = stack.turn("ops", session, "digest", target={"channel": "broken"})
        # (not due before the turn ends, either: wait for the attempts to be spent)
        wait_for(lambda: _delivery(stack, session, turn_id) == (False, 3), timeout_s=60, what="delivery given up")
    finally:
        worker.stop()
    assert _completed(stack, "ops", session, turn_id)
    assert stack.redis.llen(f"it:delivery-failed:{session}") == 3  # the first try and two re-sends, no more
    assert _delivery(stack, session, turn_id) == (False, 3)
    assert "gave up delivering turn" in worker.log.read_text(errors="replace")
