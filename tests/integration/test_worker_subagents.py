"""Subagents as child turns on real workers (issue 17): a tool's ``ctx.delegate`` records a child turn that any
worker runs, the parent parks without holding a worker, and wakes with the child's result, even when the
worker that ended the child dies before answering (the sweeper answers).

Agents (tests/integration/agents.py): ``boss`` asks for ``n`` calls at once (``parallel_tools=4``), each
delegating ``scout <key> <i> <n>`` to ``scout``, whose tool waits until two siblings have started.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from june_worker.engine.children import child_session_id, child_turn_id
from june_worker.engine.store import SessionRef
from june_worker.stores.postgres import PostgresStore
from tests._budgets import PROCESS_START_S

from .conftest import Proc, Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.modes("prefork", "threads")]


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> None:
    PostgresStore(stack.db_url).close()  # the schema, before the test reads it
    stack.worker("kids-a", concurrency=1)
    stack.worker("kids-b", concurrency=1)
    stack.beat()


def child_session(session: str, turn_id: str, call_id: str) -> str:
    return child_session_id(session, child_turn_id(SessionRef("boss", session), turn_id, call_id), call_id)


def _status(stack: Stack, agent: str, session: str, turn_id: str) -> str | None:
    rows = stack.sql(
        "select status from june_turns where agent = %s and session = %s and turn_id = %s", agent, session, turn_id
    )
    return rows[0][0] if rows else None


def _ended(stack: Stack, agent: str, session: str, turn_id: str, timeout_s: float = 60) -> dict[str, Any]:
    wait_for(
        lambda: _status(stack, agent, session, turn_id) in ("completed", "failed", "cancelled"),
        timeout_s=timeout_s,
        what=f"turn {turn_id} of {agent}/{session} to end",
    )
    (result,) = stack.sql(
        "select result from june_turns where agent = %s and session = %s and turn_id = %s", agent, session, turn_id
    )[0]
    return result if isinstance(result, dict) else json.loads(result)


def _children(stack: Stack, session: str, turn_id: str) -> list[tuple[str, str, str]]:
    return [
        (s, t, st)
        for s, t, st in stack.sql(
            "select session, turn_id, status from june_turns where agent = 'scout' and session like %s "
            "and payload->'parent'->>'turn_id' = %s order by session",
            f"{session}:sub:%",
            turn_id,
        )
    ]


def _doomed(stack: Stack, session: str, turn_id: str, text: str, crash_at: str, **worker: Any) -> Proc:
    """A worker on a queue of its own (its child turns go there too) that dies at ``crash_at``, sent the turn."""
    queue = f"{stack.queue}.{session}"
    worker.setdefault("pool", "solo")
    doomed = stack.worker(
        f"doomed-{session[-6:]}", queues=queue, env={"JUNE_CRASH_AT": crash_at, "JUNE_QUEUE": queue}, **worker
    )
    stack.send("june.turn", {"turn_id": turn_id, "agent": "boss", "session": session, "text": text}, queue=queue)
    return doomed


def _log(stack: Stack, key: str) -> list[tuple[int, str, int]]:
    entries = stack.redis.lrange(f"it:scout:{key}:log", 0, -1)
    return [(int(pid), what, int(i)) for pid, what, i in (e.split(":") for e in entries)]


def test_four_children_run_in_parallel_on_two_workers_and_the_parent_completes_with_their_results(
    stack: Stack,
) -> None:
    key, session = uuid.uuid4().hex[:8], f"boss-{uuid.uuid4().hex[:8]}"
    # Given a parent turn whose model asks for four delegations at once
    turn_id = stack.turn("boss", session, f"delegate 4 {key}")

    # When it runs on two worker processes
    result = _ended(stack, "boss", session, turn_id)

    # Then it completed with the four children's answers, in call order
    assert result["status"] == "completed"
    for i in range(1, 5):
        assert f"'text': \"scouted {{'i': {i}}}\"" in result["text"] or f"scouted {{'i': {i}}}" in result["text"]
    # one child turn per call, each completed, each child's work done once
    children = _children(stack, session, turn_id)
    assert [(s, st) for s, _, st in children] == [
        (child_session(session, turn_id, f"c{i}"), "completed") for i in range(1, 5)
    ]
    assert {t for _, t, _ in children} == {
        child_turn_id(SessionRef("boss", session), turn_id, f"c{i}") for i in range(1, 5)
    }
    assert [int(stack.redis.get(f"it:scout:{key}:{i}") or 0) for i in range(1, 5)] == [1, 1, 1, 1]
    # and the children ran at the same time, on both processes: two had started before any ended
    log = _log(stack, key)
    first_end = next(n for n, (_, what, _) in enumerate(log) if what == "end")
    assert first_end >= 2
    assert len({pid for pid, what, _ in log if what == "start"}) == 2
    # the parent parked once, on all four children at once (several pending inputs), and resumed once, when
    # the last of them answered: no worker held it while they ran
    events = stack.structural("boss", session)
    parked = [e["request"]["id"] for e in events if e["type"] == "input.requested"]
    assert sorted(parked) == sorted(f"child:scout:{t}" for _, t, _ in children)
    assert [e["trigger"]["kind"] for e in events if e["type"] == "turn.started"] == ["proactive", "resume"]
    # the parent's events name each call's child turn (its agent, session and turn id)
    named = sorted(
        (e["child_agent"], e["child_session"], e["child_turn_id"])
        for e in events
        if e["type"] in ("input.requested", "action.completed")
    )
    assert named == sorted(2 * [("scout", s, t) for s, t, _ in children])
    assert all(e["batch_limit"] == 4 for e in events if e["type"] == "action.requested")
    # each child's opening names its parent and call
    for i in range(1, 5):
        started = [
            e
            for e in stack.structural("scout", child_session(session, turn_id, f"c{i}"))
            if e["type"] == "turn.started"
        ]
        assert started[0]["parent"]["turn_id"] == turn_id and started[0]["parent"]["call_id"] == f"c{i}"


def test_a_worker_killed_after_its_child_ended_before_answering_leaves_the_parent_to_the_sweeper(
    stack: Stack,
) -> None:
    key, session = uuid.uuid4().hex[:8], f"boss-kill-{uuid.uuid4().hex[:8]}"
    turn_id = f"t_{uuid.uuid4().hex}"
    child = child_turn_id(SessionRef("boss", session), turn_id, "c1")
    # Given a solo worker on a queue of its own (its child turns go there too) that dies right after the child
    # turn it ran ended, before it answers the parent
    doomed = _doomed(stack, session, turn_id, f"delegate 1 {key}", f"before-parent-answer@{child}")
    wait_for(lambda: doomed.popen.poll() is not None, timeout_s=60, what="the worker to die at the crash point")
    doomed.kill()
    assert _status(stack, "scout", child_session(session, turn_id, "c1"), child) == "completed"
    # nobody answered it: the worker died at the crash point before the answer (the parent may already be queued
    # again by now, running on another worker, or even done there, since the sweeper answers a parent parked on an
    # ended child at its next pass, 0.5 s here, and sends it to a queue whose workers are alive; a fresh-clone run
    # saw it completed already: the parent's second model step takes milliseconds)
    assert _status(stack, "boss", session, turn_id) in ("suspended", "queued", "running", "completed")

    # When the sweeper runs, Then the parent wakes with the child's result and completes on another worker
    result = _ended(stack, "boss", session, turn_id)
    assert result["status"] == "completed" and "scouted {'i': 1}" in result["text"]
    assert len(_children(stack, session, turn_id)) == 1  # one child for the call
    assert int(stack.redis.get(f"it:scout:{key}:1") or 0) == 1  # its work ran once


@pytest.mark.parametrize("point", ["after-child-start", "after-parent-answer"])
def test_a_worker_killed_at_a_child_commit_point_still_gives_one_child_per_call_and_a_parent_that_completes(
    stack: Stack, point: str
) -> None:
    key, session = uuid.uuid4().hex[:8], f"boss-{point[:11]}-{uuid.uuid4().hex[:6]}"
    turn_id = f"t_{uuid.uuid4().hex}"
    child = child_turn_id(SessionRef("boss", session), turn_id, "c1")
    # Given a solo worker that dies after recording the child (before sending it and before the parent parks),
    # or after answering the parent (before sending the parent on)
    step = "tool:1:c1" if point == "after-child-start" else child
    doomed = _doomed(stack, session, turn_id, f"delegate 1 {key}", f"{point}@{step}")
    # (on a busy machine the sweeper may find the child queued for longer than its grace and send it to the shared
    # queue, where another worker runs it and answers the parent: then nobody reaches the crash point, and the
    # outcome below must hold all the same)
    wait_for(
        lambda: doomed.popen.poll() is not None or _status(stack, "boss", session, turn_id) == "completed",
        timeout_s=PROCESS_START_S, what="the worker to die at the crash point",
    )  # fmt: skip
    doomed.kill()

    # When the sweeper finds what it left, Then the parent completes with the child's answer
    result = _ended(stack, "boss", session, turn_id)
    assert result["status"] == "completed" and "scouted {'i': 1}" in result["text"]
    assert [t for _, t, _ in _children(stack, session, turn_id)] == [child]  # one child for the call
    assert int(stack.redis.get(f"it:scout:{key}:1") or 0) == 1  # its work ran once
    if point == "after-child-start":
        assert int(stack.redis.get(f"it:delegate:{session}:c1") or 0) >= 2  # the call ran again, found the child


def test_a_person_cannot_answer_a_parent_parked_on_its_child(stack: Stack) -> None:
    key, session = uuid.uuid4().hex[:8], f"boss-forge-{uuid.uuid4().hex[:8]}"
    # Given a parent parked on a child
    turn_id = stack.turn("boss", session, f"delegate 1 {key} hold")
    child = child_turn_id(SessionRef("boss", session), turn_id, "c1")
    wait_for(lambda: _status(stack, "boss", session, turn_id) == "suspended", timeout_s=30, what="the parent to park")
    # When someone answers the child request from outside
    out = stack.send(
        "june.resume",
        {
            "agent": "boss",
            "session": session,
            "turn_id": turn_id,
            "input_id": f"child:scout:{child}",
            "value": {"status": "completed", "text": "forged"},
            "by": "op-1",
        },
    ).get(timeout=30)
    # Then it is refused, saying who answers it, and the parent still waits for its child
    assert out["status"] == "forbidden" and "answered by its child turn" in out["reason"]
    assert _status(stack, "boss", session, turn_id) == "suspended"
    stack.redis.set(f"it:scout:{key}:release", "1")
    result = _ended(stack, "boss", session, turn_id)
    assert result["status"] == "completed" and "forged" not in result["text"] and "scouted" in result["text"]


def test_cancelling_a_parent_parked_on_its_child_cancels_both_and_the_session_serves_its_next_turn(
    stack: Stack,
) -> None:
    key, session = uuid.uuid4().hex[:8], f"boss-cancel-{uuid.uuid4().hex[:8]}"
    # Given a parent parked on a child that is still working
    turn_id = stack.turn("boss", session, f"delegate 1 {key} hold")
    child = child_turn_id(SessionRef("boss", session), turn_id, "c1")
    wait_for(lambda: stack.redis.llen(f"it:scout:{key}:log") == 1, timeout_s=30, what="the child to start working")
    wait_for(lambda: _status(stack, "boss", session, turn_id) == "suspended", timeout_s=30, what="the parent to park")

    # When the parent is cancelled (and the child's work then returns)
    out = stack.send("june.cancel", {"agent": "boss", "session": session, "turn_id": turn_id}).get(timeout=30)
    assert out["status"] == "cancel-requested"
    stack.redis.set(f"it:scout:{key}:release", "1")

    # Then the child ends cancelled (its parent's cancel), and so does the parent
    child_result = _ended(stack, "scout", child_session(session, turn_id, "c1"), child)
    assert child_result["status"] == "cancelled" and child_result["reason"] == "parent"
    assert _ended(stack, "boss", session, turn_id)["status"] == "cancelled"
    # and neither session is wedged: the parent's serves its next turn
    assert stack.sql("select suspended from june_sessions where agent = 'boss' and session = %s", session) == [(None,)]
    nxt = stack.turn("boss", session, "hello again")
    assert _ended(stack, "boss", session, nxt)["text"] == "ok: hello again"


def test_a_childs_request_for_a_person_is_told_on_the_parents_stream_and_answering_it_wakes_both(
    stack: Stack,
) -> None:
    key, session = uuid.uuid4().hex[:8], f"boss-ask-{uuid.uuid4().hex[:8]}"
    # Given a parent whose child asks a person
    turn_id = stack.turn("boss", session, f"delegate 1 {key} ask")
    child = child_turn_id(SessionRef("boss", session), turn_id, "c1")

    # Then the parent's stream tells which child session and turn waits for whom, and for what
    def told() -> dict[str, Any] | None:
        found = [e for e in stack.structural("boss", session) if e["type"] == "child.input_requested"]
        return found[0] if found else None

    event = wait_for(told, timeout_s=30, what="child.input_requested on the parent's stream")
    assert (event["turn_id"], event["child_agent"], event["child_session"], event["child_turn_id"]) == (
        turn_id,
        "scout",
        child_session(session, turn_id, "c1"),
        child,
    )
    assert event["request"]["id"] == "go"
    assert _status(stack, "boss", session, turn_id) == "suspended"

    # When the person answers on the child's session
    out = stack.send(
        "june.resume",
        {
            "agent": "scout",
            "session": child_session(session, turn_id, "c1"),
            "turn_id": child,
            "input_id": "go",
            "value": True,
        },
    ).get(timeout=30)
    assert out["status"] == "accepted"

    # Then the child completes, and the parent with the child's answer
    result = _ended(stack, "boss", session, turn_id)
    assert result["status"] == "completed" and "scouted {'go': True}" in result["text"]


def test_resetting_a_parent_parked_on_its_child_cancels_the_child_and_archives_the_park(stack: Stack) -> None:
    key, session = uuid.uuid4().hex[:8], f"boss-reset-{uuid.uuid4().hex[:8]}"
    # Given a parent parked on a child that is still working
    turn_id = stack.turn("boss", session, f"delegate 1 {key} hold")
    child = child_turn_id(SessionRef("boss", session), turn_id, "c1")
    wait_for(lambda: stack.redis.llen(f"it:scout:{key}:log") == 1, timeout_s=30, what="the child to start working")
    wait_for(lambda: _status(stack, "boss", session, turn_id) == "suspended", timeout_s=30, what="the parent to park")

    # When the parent's session is reset (and the child's work then returns)
    out = stack.send("june.reset", {"agent": "boss", "session": session}).get(timeout=30)
    assert out["status"] == "reset"
    stack.redis.set(f"it:scout:{key}:release", "1")

    # Then the child ends cancelled, the parent's park was ended by the reset, and the session goes on
    child_result = _ended(stack, "scout", child_session(session, turn_id, "c1"), child)
    assert child_result["status"] == "cancelled" and child_result["reason"] == "parent"
    assert _ended(stack, "boss", session, turn_id)["status"] == "cancelled"
    nxt = stack.turn("boss", session, "fresh start")
    assert _ended(stack, "boss", session, nxt)["text"] == "ok: fresh start"


def test_a_child_that_ended_behind_another_open_request_is_answered_by_the_sweeper_after_its_worker_died(
    stack: Stack,
) -> None:
    key, session = uuid.uuid4().hex[:8], f"boss-more-{uuid.uuid4().hex[:8]}"
    turn_id = f"t_{uuid.uuid4().hex}"
    first = child_turn_id(SessionRef("boss", session), turn_id, "c1")
    second = child_turn_id(SessionRef("boss", session), turn_id, "c2")
    # Given a parent parked on two children, the first still working, on a worker whose process dies right after
    # the second child ended, before it answers the parent (its request is the park's second, in ``more``)
    doomed = _doomed(
        stack,
        session,
        turn_id,
        f"delegate 2 {key} mixed",
        f"before-parent-answer@{second}",
        pool="prefork",
        concurrency=2,
    )
    wait_for(
        lambda: _status(stack, "scout", child_session(session, turn_id, "c2"), second) == "completed",
        timeout_s=60,
        what="the second child to end",
    )

    # When the sweeper comes by, Then it answers the second child's request while the first is still open
    def open_requests() -> list[str]:
        (parked,) = stack.sql("select suspended from june_sessions where agent = 'boss' and session = %s", session)[0]
        parked = parked if isinstance(parked, dict) or parked is None else json.loads(parked)
        if parked is None:
            return []
        return [parked["request"]["id"], *(m["request"]["id"] for m in parked.get("more", []))]

    wait_for(lambda: open_requests() == [f"child:scout:{first}"], timeout_s=60, what="the sweeper to answer c2")
    # and once the first child ends, the parent completes with both answers
    stack.redis.set(f"it:scout:{key}:release", "1")
    result = _ended(stack, "boss", session, turn_id)
    assert (
        result["status"] == "completed"
        and "scouted {'i': 1}" in result["text"]
        and "scouted {'i': 2}" in result["text"]
    )
    assert len(_children(stack, session, turn_id)) == 2
    assert [int(stack.redis.get(f"it:scout:{key}:{i}") or 0) for i in (1, 2)] == [1, 1]
    doomed.kill()


def _open_requests(stack: Stack, agent: str, session: str) -> list[str]:
    (parked,) = stack.sql("select suspended from june_sessions where agent = %s and session = %s", agent, session)[0]
    parked = parked if isinstance(parked, dict) or parked is None else json.loads(parked)
    if parked is None:
        return []
    return [parked["request"]["id"], *(m["request"]["id"] for m in parked.get("more", []))]


def test_a_cancelled_parent_parked_on_a_child_and_a_person_ends_cancelled_when_the_child_ends(stack: Stack) -> None:
    key, session = uuid.uuid4().hex[:8], f"boss-cask-{uuid.uuid4().hex[:8]}"
    # Given a parent parked on a child that is still working and on a person's request
    turn_id = stack.turn("boss", session, f"delegate 1 {key} holdask")
    child = child_turn_id(SessionRef("boss", session), turn_id, "c1")
    wait_for(lambda: stack.redis.llen(f"it:scout:{key}:log") == 1, timeout_s=30, what="the child to start working")
    wait_for(lambda: len(_open_requests(stack, "boss", session)) == 2, timeout_s=30, what="the parent to park on both")

    # When the parent is cancelled (and the child's work then returns)
    out = stack.send("june.cancel", {"agent": "boss", "session": session, "turn_id": turn_id}).get(timeout=30)
    assert out["status"] == "cancel-requested" and out["child_turn_ids"] == [child]
    stack.redis.set(f"it:scout:{key}:release", "1")

    # Then the child ends cancelled, and the parent too, though nobody answered the person's request
    assert _ended(stack, "scout", child_session(session, turn_id, "c1"), child)["reason"] == "parent"
    assert _ended(stack, "boss", session, turn_id) == {"turn_id": turn_id, "status": "cancelled", "reason": "requested"}
    assert _open_requests(stack, "boss", session) == []
    nxt = stack.turn("boss", session, "hello again")
    assert _ended(stack, "boss", session, nxt)["text"] == "ok: hello again"


def test_a_worker_killed_right_after_a_cancelled_child_answered_its_parent_leaves_the_parent_cancelled(
    stack: Stack,
) -> None:
    key, session = uuid.uuid4().hex[:8], f"boss-cdie-{uuid.uuid4().hex[:8]}"
    turn_id = f"t_{uuid.uuid4().hex}"
    child = child_turn_id(SessionRef("boss", session), turn_id, "c1")
    # Given a parent parked on a working child, both on a worker that dies right after the child's answer commits
    # (the parent queued again, not yet sent on)
    doomed = _doomed(stack, session, turn_id, f"delegate 1 {key} hold", f"after-parent-answer@{child}")
    wait_for(lambda: stack.redis.llen(f"it:scout:{key}:log") == 1, timeout_s=60, what="the child to start working")
    assert _status(stack, "boss", session, turn_id) == "suspended"

    # When the parent is cancelled, the child's work returns, and the worker dies after the child's answer
    out = stack.send("june.cancel", {"agent": "boss", "session": session, "turn_id": turn_id}).get(timeout=30)
    assert out["status"] == "cancel-requested"
    stack.redis.set(f"it:scout:{key}:release", "1")
    wait_for(lambda: doomed.popen.poll() is not None, timeout_s=60, what="the worker to die at the crash point")
    doomed.kill()

    # Then the parent's cancel was stored with that answer: the sweeper sends it on, and it ends cancelled
    assert _status(stack, "scout", child_session(session, turn_id, "c1"), child) == "cancelled"
    assert _ended(stack, "boss", session, turn_id)["status"] == "cancelled"


def test_a_parent_that_fails_cancels_its_child_turns_on_the_workers(stack: Stack) -> None:
    key, session = uuid.uuid4().hex[:8], f"boss-fail-{uuid.uuid4().hex[:8]}"
    # Given a parent whose second call fails the turn while its first call's child works on another worker
    turn_id = stack.turn("boss", session, f"delegate 1 {key} holdfail")
    child = child_turn_id(SessionRef("boss", session), turn_id, "c1")

    # When the parent fails
    result = _ended(stack, "boss", session, turn_id)
    assert result["status"] == "failed" and "gives up" in result["error"]["message"]

    # Then the child is asked to stop, and ends cancelled once its work returns
    rows = stack.sql("select cancel_reason from june_turns where agent = 'scout' and turn_id = %s", child)
    assert rows == [("parent",)]
    stack.redis.set(f"it:scout:{key}:release", "1")
    child_result = _ended(stack, "scout", child_session(session, turn_id, "c1"), child)
    assert child_result == {"turn_id": child, "status": "cancelled", "reason": "parent"}
