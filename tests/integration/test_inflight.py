"""Many turns in flight in one worker process (``june worker --turns-per-process N``), on real workers.

Every guarantee a turn has alone holds with hundreds beside it in one process: a SIGKILL of the process
mid-step loses no turn and repeats no committed write; a cancel reaches only its turn; a turn that kills its
process every time fails only itself; a tool that holds the shared event loop is reported by name, and no
other turn's lease is taken over meanwhile (the heartbeat does not need the loop).
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bench._harness import repeated_events

from .conftest import Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.modes("threads")]

MAX_ATTEMPTS = 5
IN_FLIGHT = 600


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> None:
    stack.sql("create table if not exists it_flight (turn_id text not null, call_id text not null)")
    env = {"JUNE_MAX_ATTEMPTS": str(MAX_ATTEMPTS), "JUNE_LOOP_BLOCKED_S": "0.5"}
    stack.worker("inflight", concurrency=IN_FLIGHT, queues=stack.queue, env=env)
    stack.worker("control", pool="prefork", concurrency=2, queues=stack.control_queue, env=env)
    stack.beat()


def _flights(stack: Stack, prefix: str, n: int, key: str) -> list[tuple[str, str]]:
    sent = []
    for i in range(n):
        session = f"{prefix}-{i:03d}"
        sent.append((session, stack.turn("flight", session, f"flight {key}")))
    return sent


def _lingering(stack: Stack, key: str) -> int:
    return int(stack.redis.get(f"it:flight:{key}:lingering") or 0)


def _statuses(stack: Stack, prefix: str) -> Counter[str]:
    rows = stack.sql("select status from june_turns where agent = 'flight' and session like %s", f"{prefix}-%")
    return Counter(r[0] for r in rows)


def _writes(stack: Stack, turn_ids: list[str]) -> Counter[str]:
    rows = stack.sql("select turn_id from it_flight where turn_id = any(%s)", turn_ids)
    return Counter(r[0] for r in rows)


def _turn_process(stack: Stack) -> int:
    """The worker process running the turns: the supervisor's child that is not the isolation worker."""
    proc = next(p for p in stack.procs if p.name == "inflight")
    for pid in proc.children():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"threads" in cmdline:
            return pid
    raise AssertionError(f"no threads worker under the supervisor {proc.pid}:\n{proc.tail()}")


def _assert_each_ended_once(stack: Stack, sent: list[tuple[str, str]], status: str = "turn.completed") -> None:
    """Each turn's stream holds its terminal event once, and repeats nothing (its events follow the commit that
    ended the row, so they are waited for)."""

    def terminal(session: str) -> list[str]:
        types = [e["type"] for e in stack.structural("flight", session)]
        return [t for t in types if t in ("turn.completed", "turn.failed", "turn.cancelled")]

    wait_for(lambda: all(terminal(s) for s, _ in sent), timeout_s=60, what="every terminal event in its stream")
    for session, _ in sent:
        events = stack.structural("flight", session)
        assert repeated_events(events) == [], (session, repeated_events(events))
        assert [e["type"] for e in events if e["type"].startswith("turn.") and e["type"] != "turn.started"] == [status]


def test_a_process_killed_with_200_turns_in_flight_mid_step_completes_each_once_and_commits_each_write_once(
    stack: Stack,
) -> None:
    key, prefix = uuid.uuid4().hex, f"kill-{uuid.uuid4().hex[:6]}"
    # Given 200 turns in flight in one process: each committed its sync write and waits in its async tool
    sent = _flights(stack, prefix, 200, key)
    wait_for(lambda: _lingering(stack, key) >= 200, timeout_s=120, what="200 turns to be in flight at once")
    assert _statuses(stack, prefix) == Counter({"running": 200})
    # When the process is SIGKILLed in the middle of their tool steps, and the turns may then go on
    os.kill(_turn_process(stack), signal.SIGKILL)
    stack.redis.set(f"it:flight:{key}:go", "1")
    # Then every one completes, once, and every sync write committed once
    wait_for(lambda: _statuses(stack, prefix) == Counter({"completed": 200}), timeout_s=240, what="200 completions")
    turn_ids = [t for _, t in sent]
    assert _writes(stack, turn_ids) == Counter({t: 1 for t in turn_ids})
    _assert_each_ended_once(stack, sent)


def test_a_cancel_of_one_turn_among_500_in_flight_cancels_only_that_one(stack: Stack) -> None:
    key, prefix = uuid.uuid4().hex, f"cancel-{uuid.uuid4().hex[:6]}"
    sent = _flights(stack, prefix, 500, key)
    wait_for(lambda: _lingering(stack, key) >= 500, timeout_s=180, what="500 turns to be in flight at once")
    session, victim = sent[250]
    # When one of them is cancelled while all wait in their tool (a cancel takes effect at the next checkpoint:
    # once the tool returned, before the model is asked again), and the tools may then return
    out = stack.send("june.cancel", {"agent": "flight", "session": session, "turn_id": victim}).get(timeout=60)
    assert out["status"] == "cancel-requested" and out["turn_ids"] == [victim]
    stack.redis.set(f"it:flight:{key}:go", "1")
    # Then that one ends cancelled, and only that one
    assert stack.wait_terminal("flight", session, victim, timeout_s=120)["type"] == "turn.cancelled"
    wait_for(
        lambda: _statuses(stack, prefix) == Counter({"completed": 499, "cancelled": 1}),
        timeout_s=240,
        what="the other 499 to complete",
    )
    _assert_each_ended_once(stack, [s for s in sent if s[1] != victim])
    _assert_each_ended_once(stack, [(session, victim)], "turn.cancelled")


def test_a_turn_that_kills_its_process_every_time_among_many_fails_only_itself(stack: Stack) -> None:
    key, prefix = uuid.uuid4().hex, f"poison-{uuid.uuid4().hex[:6]}"
    sent = _flights(stack, prefix, 40, key)
    wait_for(lambda: _lingering(stack, key) >= 40, timeout_s=120, what="40 turns to be in flight")
    # When a poison turn joins them (its tool SIGKILLs its process, every time), and the others may go on
    poison_session = f"{prefix}-poison"
    poison = stack.turn("ops", poison_session, f"die {key}")
    wait_for(lambda: int(stack.redis.get(f"it:die:{key}") or 0) >= 1, timeout_s=60, what="the first death")
    stack.redis.set(f"it:flight:{key}:go", "1")
    # Then the poison turn is given up after its attempts, and it alone fails
    failed = stack.wait_terminal("ops", poison_session, poison, timeout_s=300)
    assert failed["type"] == "turn.failed" and failed["error"]["type"] == "PoisonTurnError"
    wait_for(lambda: _statuses(stack, prefix) == Counter({"completed": 40}), timeout_s=240, what="the others")
    _assert_each_ended_once(stack, sent)
    turn_ids = [t for _, t in sent]
    assert _writes(stack, turn_ids) == Counter({t: 1 for t in turn_ids})
    attempts = stack.sql("select max(attempts) from june_turns where turn_id = any(%s)", turn_ids)[0][0]
    assert attempts < MAX_ATTEMPTS
    # ... and the session of the poison turn serves its next turn
    after = stack.turn("ops", poison_session, "order 2 nut")
    assert stack.wait_terminal("ops", poison_session, after, timeout_s=60)["type"] == "turn.completed"


def test_a_tool_that_holds_the_loop_for_2s_is_reported_and_no_other_turn_is_taken_over(stack: Stack) -> None:
    key, prefix = uuid.uuid4().hex, f"hold-{uuid.uuid4().hex[:6]}"
    sent = _flights(stack, prefix, 50, key)
    wait_for(lambda: _lingering(stack, key) >= 50, timeout_s=120, what="50 turns to be in flight")
    pid = _turn_process(stack)
    holder_session = f"holder-{prefix}"
    holder = stack.turn("flight", holder_session, "hold 2.5")
    # While the tool holds the loop, the process's liveness and its sessions' leases stay current: other workers
    # would take a lapsed one over (JUNE_ALIVE_S is 1 s here, the lease 2 s)
    margins: list[tuple[float, float]] = []

    def held_and_done() -> bool:
        rows = stack.sql(
            "select (select min(alive_until) from june_workers where owner like %s) - extract(epoch from clock_timestamp()),"
            " (select min(lease_expires) from june_sessions where session like %s) - extract(epoch from clock_timestamp())",
            f"%:{pid}:%",
            f"{prefix}-0%",
        )
        margins.append((float(rows[0][0]), float(rows[0][1])))
        return any(
            e["type"] == "turn.completed" and e["turn_id"] == holder for e in stack.structural("flight", holder_session)
        )

    wait_for(held_and_done, timeout_s=60, every_s=0.05, what="the holding turn to end")
    assert len(margins) > 10 and min(a for a, _ in margins) > 0 and min(b for _, b in margins) > 0, margins
    stack.redis.set(f"it:flight:{key}:go", "1")
    wait_for(lambda: _statuses(stack, prefix) == Counter({"completed": 50}), timeout_s=120, what="the others")
    # the held loop was named: its tool, its turn, how long
    log = next(p for p in stack.procs if p.name == "inflight").log.read_text(errors="replace")
    held = re.findall(rf'event loop was held for ([0-9.]+)s by tool "hold_the_loop" of turn {holder}', log)
    assert held and float(held[0]) >= 2.0, log[-3000:]
    # and every turn started once (a takeover counts another start)
    turn_ids = [t for _, t in sent]
    rows: list[Any] = stack.sql("select max(attempts) from june_turns where turn_id = any(%s)", turn_ids)
    assert rows[0][0] == 1
