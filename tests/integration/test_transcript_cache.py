"""A worker keeps the transcripts it ran lately and reads only what is newer, and never uses one that went stale.

Two :class:`WorkerHost` objects in this process are two workers to Postgres and Redis (two owners, two
pools, two caches). Every turn here is the ``echo`` agent's: its model answers with a digest of the
transcript it was sent, so the stored transcript says, reply by reply, whether the model saw exactly
what was stored before it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from june_worker.engine.crash import CrashAt
from june_worker.engine.signals import CrashInjected
from june_worker.engine.store import SessionRef, TurnPayload
from june_worker.engine.types import AssistantMessage, Message
from june_worker.stores.postgres import PostgresStore
from june_worker.worker import control, retention
from june_worker.worker.host import WorkerHost
from june_worker.worker.payloads import ResetMessage
from june_worker.worker.queue import Lease
from june_worker.worker.settings import WorkerSettings

from .agents import ALL, transcript_digest
from .conftest import Stack, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def hosts(fresh_db: str, redis_url: str) -> Iterator[tuple[WorkerHost, WorkerHost]]:
    settings = WorkerSettings(
        database_url=fresh_db, redis_url=redis_url, key_prefix=f"june-it-{uuid.uuid4().hex[:8]}", lease_s=30
    )
    a = WorkerHost(settings, {x.name: x for x in ALL()})
    b = WorkerHost(settings, {x.name: x for x in ALL()})
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _session() -> SessionRef:
    return SessionRef("echo", f"cache-{uuid.uuid4().hex[:8]}")


def _turn(host: WorkerHost, ref: SessionRef, text: str) -> Lease:
    """Run one turn on ``host``; check it started from the stored transcript and its model saw exactly that."""
    before = host.store.load(ref).messages
    turn_id = f"t_{uuid.uuid4().hex}"
    got, ran = host.intake(ref, turn_id, TurnPayload(text=text))
    assert got.lease is not None and got.lease.snapshot is not None and ran[turn_id].status == "completed"
    assert got.lease.snapshot.messages == before  # what the turn ran on is what was stored
    assert _unechoed(host.store.load(ref).messages) == []
    return got.lease


def _unechoed(messages: list[Message]) -> list[str]:
    """The echo replies whose digest is not that of the stored transcript before them."""
    return [
        f"reply {i}: {m.text!r}, but {transcript_digest(messages[:i])!r} was stored before it"
        for i, m in enumerate(messages)
        if isinstance(m, AssistantMessage) and m.text != transcript_digest(messages[:i])
    ]


def test_two_workers_alternating_on_one_session_with_a_reset_between_never_use_a_stale_transcript(
    hosts: tuple[WorkerHost, WorkerHost],
) -> None:
    a, b = hosts
    ref = _session()
    # Given two workers that take turns on one session, each holding what it ran
    assert _turn(a, ref, "tick one").read_from == 0  # nothing held yet
    assert _turn(b, ref, "two").read_from == 0
    # When a runs again after b committed: it reads only what it does not hold
    assert _turn(a, ref, "tick three").read_from == 4  # held: one (4 messages); read: b's two and its own
    assert _turn(b, ref, "four").read_from == 6
    # And after a reset (a performs it), b still holds the old generation: it must not be used
    assert control.reset(a, ResetMessage(agent=ref.agent, session=ref.session), lambda rec: None)["status"] == "reset"
    assert b.transcripts.get(ref) is not None
    assert _turn(b, ref, "tick five").read_from == 0  # refused: the session is in its next generation
    assert len(b.store.load(ref).messages) == 4
    assert _turn(a, ref, "six").read_from == 0  # a dropped what it held when it reset the session
    assert _turn(b, ref, "seven").read_from == 4  # b holds generation 1 again: only a's turn is read
    assert len(a.store.load(ref).messages) == 8


def test_pruned_step_records_of_ended_turns_do_not_matter_to_a_holder(
    hosts: tuple[WorkerHost, WorkerHost],
) -> None:
    a, _ = hosts
    ref = _session()
    _turn(a, ref, "tick one")
    _turn(a, ref, "tick two")
    # Given retention deleting every ended turn with its step records
    settings = WorkerSettings(turn_retention_s=0, outbox_retention_s=0, archive_retention_s=0)
    while retention.prune(a.store.pool, None, settings):
        pass
    assert a.store.load(ref).steps == {}
    # When the holder runs the next turn on what it holds
    lease = _turn(a, ref, "tick three")
    # Then it read only the new messages, and nothing it needed was gone
    assert lease.read_from == 8
    assert lease.snapshot is not None and lease.snapshot.steps == {}
    assert sorted(a.store.load(ref).steps) == ["model:11", "model:9", "tool:9:c1"]


def test_a_run_that_raised_after_a_rolled_back_commit_leaves_nothing_held(
    hosts: tuple[WorkerHost, WorkerHost],
) -> None:
    a, _ = hosts
    ref = _session()
    _turn(a, ref, "two")
    assert a.transcripts.get(ref) is not None
    # Given a turn whose sync tool step dies inside its transaction (rolled back with it)
    a.crash = CrashAt("before-tool-commit")
    turn_id = f"t_{uuid.uuid4().hex}"
    with pytest.raises(CrashInjected):
        a.intake(ref, turn_id, TurnPayload(text="tick"))
    # Then the worker holds nothing of the session any more, and the replay reads it whole
    assert a.transcripts.get(ref) is None
    before = a.store.load(ref).messages
    got, ran = a.intake(ref, turn_id, TurnPayload(text="tick"))
    assert got.lease is not None and got.lease.read_from == 0 and got.lease.snapshot is not None
    assert got.lease.snapshot.messages == before and ran[turn_id].status == "completed"
    assert _unechoed(a.store.load(ref).messages) == []


def test_the_second_turn_of_a_drain_reads_only_what_the_first_one_did_not_leave(
    hosts: tuple[WorkerHost, WorkerHost],
) -> None:
    a, b = hosts
    ref = _session()
    _turn(a, ref, "one")
    # Given two turns queued behind a lease b holds
    lease = b.queue.take(ref, b.owner)
    assert lease is not None
    first, second = f"t_{uuid.uuid4().hex}", f"t_{uuid.uuid4().hex}"
    a.store.enqueue_turn(ref, first, TurnPayload(text="tick two"))
    a.store.enqueue_turn(ref, second, TurnPayload(text="three"))
    reads: list[int] = []
    read = a.queue.read

    def counted(ref: SessionRef, *, held: object = None) -> object:
        snapshot, read_from = read(ref, held=held)  # type: ignore[arg-type]
        reads.append(read_from)
        return snapshot, read_from

    a.queue.read = counted  # type: ignore[method-assign]
    assert b.queue.release(ref, lease.fence, force=True)
    # When a drains the session
    ran = a.drain(ref)
    # Then each turn read only what a did not hold, and every reply saw the stored transcript
    assert [ran[t].status for t in (first, second)] == ["completed", "completed"]
    assert reads == [2, 6]
    assert _unechoed(a.store.load(ref).messages) == []


def test_two_worker_processes_taking_turns_on_one_session_around_a_reset_answer_on_the_stored_transcript(
    stack: Stack,
) -> None:
    # Given two Celery workers, each on a queue of its own, and one session whose turns go to each in turn
    first, second = f"{stack.queue}.a", f"{stack.queue}.b"
    stack.worker("cache-a", queues=f"{first},{stack.control_queue}")
    stack.worker("cache-b", queues=f"{second},{stack.control_queue}")
    session = f"cache-{uuid.uuid4().hex[:8]}"
    texts = ["tick one", "two", "tick three", "reset", "four", "tick five", "six"]
    # When each turn is sent after the last one ended (and a reset between them)
    for i, text in enumerate(texts):
        if text == "reset":
            stack.send("june.reset", {"agent": "echo", "session": session}, queue=stack.control_queue)
            wait_for(
                lambda: stack.sql("select generation from june_sessions where session = %s", session) == [(1,)],
                what="the reset",
            )
            continue
        turn_id = f"t_{uuid.uuid4().hex}"
        payload = {"turn_id": turn_id, "agent": "echo", "session": session, "text": text}
        stack.send("june.turn", payload, queue=first if i % 2 == 0 else second)
        assert stack.wait_terminal("echo", session, turn_id)["type"] == "turn.completed"
    # Then every reply was made on the transcript stored before it, in both generations
    store = PostgresStore(stack.db_url, max_size=1)
    try:
        messages = store.load(SessionRef("echo", session)).messages
    finally:
        store.close()
    assert len(messages) == 2 + 4 + 2  # the new generation: four, tick five, six
    assert _unechoed(messages) == []
    archived = stack.sql("select count(*) from june_archived_messages where session = %s", session)
    assert archived == [(4 + 2 + 4,)]
