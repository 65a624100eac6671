"""Following a session stream: catch-up then live, one turn's events ending on its terminal event, other
turns filtered out, resuming from a stream id with nothing missed and nothing repeated, and timeouts;
for ``follow`` and ``afollow`` alike. Entries are written by the test in the worker's exact format.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from producers import FollowedEvent, JuneProducer

from .kit import WAIT_S, Event, add_event, script, write_script

pytestmark = pytest.mark.integration


@pytest.fixture
def stream(producer: JuneProducer, session_id: str) -> str:
    return producer.stream_key("ops", session_id)


def types(events: list[FollowedEvent]) -> list[str]:
    return [e.type for e in events]


def interleave(client: redis.Redis, stream: str, session: str, *turns: list[tuple[str, Event]]) -> None:
    """Write several turns' events alternately, numbering structural ones in one session-wide seq, as the store does."""
    seq = 0
    for group in zip(*turns, strict=True):
        for turn_id, (kind, old_seq, fields) in group:
            if old_seq is not None:
                seq += 1
            add_event(client, stream, "ops", session, kind, turn_id, seq if old_seq is not None else None, **fields)


@contextlib.contextmanager
def writer(write: Callable[[], None]) -> Iterator[threading.Event]:
    """Run ``write`` in a thread once the returned event is set; join it (and surface its error) on exit."""
    go = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            if go.wait(WAIT_S):
                write()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield go
    finally:
        go.set()
        thread.join(WAIT_S)
        if errors:
            raise errors[0]


def test_follow_catches_up_then_reads_live_and_ends_after_the_turn_completes(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    events = script("t_1")
    ids = write_script(rclient, stream, "ops", session_id, "t_1", events[:3])
    seen: list[FollowedEvent] = []

    def write_rest() -> None:
        write_script(rclient, stream, "ops", session_id, "t_1", events[3:])

    with writer(write_rest) as go:
        for event in producer.follow("ops", session_id, turn_id="t_1", block_ms=200, timeout_s=WAIT_S):
            seen.append(event)
            if len(seen) == 3:
                go.set()  # the catch-up is read: now the rest arrives live

    assert types(seen) == [t for t, _, _ in events]
    assert seen[-1].type == "turn.completed" and seen[-1].terminal
    assert [e.stream_id for e in seen[:3]] == ids
    assert seen[0].data["trigger"]["kind"] == "inbound"
    assert seen[1].data == {
        "agent": "ops",
        "session": session_id,
        "turn_id": "t_1",
        "seq": None,
        "type": "message.delta",
        "step": "model:1",
        "text": "Let me ",
    }
    assert [e.seq for e in seen if not e.delta] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("end", ["turn.failed", "turn.cancelled", "input.requested"])
def test_follow_of_a_turn_ends_after_any_terminal_event(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str, end: str
) -> None:
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1", end=end))
    add_event(rclient, stream, "ops", session_id, "turn.started", "t_2", 7, trigger={"kind": "proactive", "by": "x"})

    seen = list(producer.follow("ops", session_id, turn_id="t_1", block_ms=100, timeout_s=WAIT_S))

    assert seen[-1].type == end
    assert {e.turn_id for e in seen} == {"t_1"}


def test_follow_of_a_turn_skips_other_turns_events(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    mine = script("t_mine")
    interleave(rclient, stream, session_id, [("t_other", e) for e in script("t_other")], [("t_mine", e) for e in mine])

    seen = list(producer.follow("ops", session_id, turn_id="t_mine", block_ms=100, timeout_s=WAIT_S))

    assert {e.turn_id for e in seen} == {"t_mine"}
    assert types(seen) == [t for t, _, _ in mine]


def test_a_parked_turn_continues_when_followed_again_from_its_input_request(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1", end="input.requested"))
    parked = list(producer.follow("ops", session_id, turn_id="t_1", timeout_s=WAIT_S))
    assert parked[-1].type == "input.requested"
    add_event(rclient, stream, "ops", session_id, "turn.started", "t_1", 7, trigger={"kind": "resume", "call_id": "c"})
    add_event(rclient, stream, "ops", session_id, "turn.completed", "t_1", 8, text="Refunded.")

    resumed = list(producer.follow("ops", session_id, turn_id="t_1", last_id=parked[-1].stream_id, timeout_s=WAIT_S))

    assert types(resumed) == ["turn.started", "turn.completed"]


def test_following_again_from_the_last_stream_id_misses_nothing_and_repeats_nothing(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1"))
    everything = list(producer.follow("ops", session_id, turn_id="t_1", timeout_s=WAIT_S))

    for cut in range(1, len(everything)):
        first: list[FollowedEvent] = []
        for event in producer.follow("ops", session_id, turn_id="t_1", timeout_s=WAIT_S):
            first.append(event)
            if len(first) == cut:
                break  # the connection "drops" here
        rest = list(producer.follow("ops", session_id, turn_id="t_1", last_id=first[-1].stream_id, timeout_s=WAIT_S))
        assert first + rest == everything, f"cut after {cut}"


def test_a_session_follow_sees_every_turn_and_ends_only_at_its_timeout(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1", 1))
    write_script(rclient, stream, "ops", session_id, "t_2", script("t_2", 7))

    started = time.monotonic()
    seen = list(producer.follow("ops", session_id, timeout_s=0.3, block_ms=100))

    assert time.monotonic() - started >= 0.3
    assert [e.turn_id for e in seen].count("t_1") == [e.turn_id for e in seen].count("t_2") == len(script("x"))
    assert [e.type for e in seen].count("turn.completed") == 2


def test_timeout_zero_reads_what_is_there_and_stops(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1")[:4])

    seen = list(producer.follow("ops", session_id, turn_id="t_1", timeout_s=0))

    assert types(seen) == ["turn.started", "message.delta", "message.delta", "message.completed"]


def test_a_turn_follow_with_a_timeout_stops_unfinished_when_the_turn_does_not_end(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1")[:2])

    seen = list(producer.follow("ops", session_id, turn_id="t_1", timeout_s=0.2, block_ms=50))

    assert types(seen) == ["turn.started", "message.delta"] and not seen[-1].terminal


def test_dollar_follows_only_what_comes_after_the_call(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    write_script(rclient, stream, "ops", session_id, "t_old", script("t_old"))
    events = producer.follow("ops", session_id, last_id="$", timeout_s=0)
    add_event(rclient, stream, "ops", session_id, "turn.started", "t_new", 7, trigger={"kind": "proactive", "by": "x"})

    assert [(e.turn_id, e.type) for e in events] == [("t_new", "turn.started")]


def test_a_structural_event_written_twice_is_yielded_once_and_deltas_can_be_left_out(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    events = script("t_1")
    write_script(rclient, stream, "ops", session_id, "t_1", events[:4])
    write_script(rclient, stream, "ops", session_id, "t_1", events[:1] + events[3:4])  # a rebuilt stream repeats
    write_script(rclient, stream, "ops", session_id, "t_1", events[4:])

    seen = list(producer.follow("ops", session_id, turn_id="t_1", include_deltas=False, timeout_s=WAIT_S))

    assert [e.seq for e in seen] == [1, 2, 3, 4, 5, 6]


def retried_step(turn_id: str) -> list[Event]:
    """A model step streamed by attempt 1, retried by attempt 2, with a late delta of the dead attempt 1."""
    return [
        ("turn.started", 1, {"trigger": {"kind": "proactive", "by": "x"}}),
        ("message.delta", None, {"step": "model:1", "text": "stale ", "attempt": 1}),
        ("message.delta", None, {"step": "model:1", "text": "fresh", "attempt": 2}),
        ("message.delta", None, {"step": "model:1", "text": "zombie", "attempt": 1}),
        ("message.completed", 2, {"step": "model:1", "text": "fresh"}),
        ("turn.completed", 3, {"text": "fresh"}),
    ]


def test_deltas_of_an_older_attempt_of_a_step_are_dropped_once_a_newer_one_was_seen(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    write_script(rclient, stream, "ops", session_id, "t_1", retried_step("t_1"))

    seen = list(producer.follow("ops", session_id, turn_id="t_1", timeout_s=WAIT_S))

    assert [(e.data["text"], e.attempt) for e in seen if e.delta] == [("stale ", 1), ("fresh", 2)]


def test_entries_that_do_not_decode_are_skipped(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    rclient.xadd(stream, {"type": "turn.started", "data": "{not json"})
    rclient.xadd(stream, {"unrelated": "field"})
    rclient.xadd(stream, {"type": "turn.started", "data": "[1, 2]"})
    add_event(rclient, stream, "ops", session_id, "turn.future", "t_1", 1, novel={"x": 1})
    add_event(rclient, stream, "ops", session_id, "turn.completed", "t_1", 2, text="ok")

    seen = list(producer.follow("ops", session_id, turn_id="t_1", timeout_s=WAIT_S))

    assert types(seen) == ["turn.future", "turn.completed"]  # an unknown type passes through as it came
    assert seen[0].data["novel"] == {"x": 1}


def test_a_bad_last_id_is_refused_before_reading(producer: JuneProducer, session_id: str) -> None:
    with pytest.raises(ValueError, match="last_id"):
        producer.follow("ops", session_id, last_id="yesterday")


# --- async -------------------------------------------------------------------------------------------


async def test_afollow_catches_up_then_reads_live_and_ends_after_the_turn_completes(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    events = script("t_1")
    write_script(rclient, stream, "ops", session_id, "t_1", events[:3])
    seen: list[FollowedEvent] = []

    async def write_rest() -> None:
        await asyncio.to_thread(write_script, rclient, stream, "ops", session_id, "t_1", events[3:])

    task: asyncio.Task[None] | None = None
    async for event in producer.afollow("ops", session_id, turn_id="t_1", block_ms=200, timeout_s=WAIT_S):
        seen.append(event)
        if len(seen) == 3:
            task = asyncio.create_task(write_rest())
    assert task is not None
    await task

    assert types(seen) == [t for t, _, _ in events]


async def test_afollow_resumes_from_the_last_stream_id_and_filters_other_turns(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    interleave(
        rclient, stream, session_id, [("t_other", e) for e in script("t_other")], [("t_1", e) for e in script("t_1")]
    )
    everything = [e async for e in producer.afollow("ops", session_id, turn_id="t_1", timeout_s=WAIT_S)]

    first: list[FollowedEvent] = []
    async with contextlib.aclosing(producer.afollow("ops", session_id, turn_id="t_1", timeout_s=WAIT_S)) as events:
        async for event in events:
            first.append(event)
            if len(first) == 4:
                break
    rest = [
        e
        async for e in producer.afollow("ops", session_id, turn_id="t_1", last_id=first[-1].stream_id, timeout_s=WAIT_S)
    ]

    assert {e.turn_id for e in everything} == {"t_1"}
    assert first + rest == everything


async def test_afollow_of_a_session_ends_at_its_timeout(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1"))

    seen = [e async for e in producer.afollow("ops", session_id, timeout_s=0.2, block_ms=50)]

    assert len(seen) == len(script("t_1"))


async def test_afollow_drops_deltas_of_an_older_attempt_of_a_step_too(
    producer: JuneProducer, rclient: redis.Redis, stream: str, session_id: str
) -> None:
    write_script(rclient, stream, "ops", session_id, "t_1", retried_step("t_1"))

    seen = [e async for e in producer.afollow("ops", session_id, turn_id="t_1", timeout_s=WAIT_S)]

    assert [e.data["text"] for e in seen if e.delta] == ["stale ", "fresh"]
