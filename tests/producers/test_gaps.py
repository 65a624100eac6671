"""Gaps are told, never skipped: a follow whose start id was trimmed out of the session stream, or that meets a
jump in the structural ``seq``, raises StreamGapError naming the first missing seq and how to go on; the CLI
says so (a ``stream.gap`` line) and follows on after the gap.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from producers import FollowedEvent, JuneProducer, StreamGapError
from producers.cli import main

from .kit import WAIT_S, script, wait_until, write_script

pytestmark = pytest.mark.integration


def trimmed(rclient: redis.Redis, stream: str, session: str, keep: int = 3) -> tuple[list[str], list[Any]]:
    """``script("t_1")`` (seq 1-6 and deltas) written, then the stream trimmed to its last ``keep`` entries.

    Returns the ids the entries had, and the (id, fields) the stream still holds."""
    ids = write_script(rclient, stream, "ops", session, "t_1", script("t_1"))
    rclient.xtrim(stream, maxlen=keep, approximate=False)
    return ids, list(rclient.xrange(stream))


def seqs(events: list[FollowedEvent]) -> list[int | None]:
    return [e.seq for e in events if not e.delta]


def test_a_follow_from_a_trimmed_id_is_told_the_first_missing_seq_and_goes_on_after_a_reload(
    producer: JuneProducer, rclient: redis.Redis, session_id: str
) -> None:
    # Given a follower that got seq 1, and the stream trimmed since to seq 5 and 6 (and a delta before them)
    stream = producer.stream_key("ops", session_id)
    ids, held = trimmed(rclient, stream, session_id)
    # When it follows on from the id it got, saying it holds seq 1
    with pytest.raises(StreamGapError) as raised:
        list(producer.follow("ops", session_id, turn_id="t_1", last_id=ids[0], last_seq=1, timeout_s=0))
    # Then it is told: seq 2-4 are missing, the stream goes on at seq 5, reload from the gateway's log route
    gap = raised.value
    assert (gap.first_missing_seq, gap.next_seq, gap.after_id) == (2, 5, ids[0])
    assert "events seq 2-4 are missing" in str(gap) and f"/v1/agents/ops/sessions/{session_id}/log" in str(gap)
    # And following again from resume_id with last_seq=4 gives what the stream holds, from the delta on
    rest = list(producer.follow("ops", session_id, turn_id="t_1", last_id=gap.resume_id, last_seq=4, timeout_s=0))
    assert [e.stream_id for e in rest] == [i for i, _ in held]
    assert seqs(rest) == [5, 6]


def test_a_follow_from_the_start_of_a_trimmed_stream_is_told_that_seq_1_is_missing(
    producer: JuneProducer, rclient: redis.Redis, session_id: str
) -> None:
    trimmed(rclient, producer.stream_key("ops", session_id), session_id)

    with pytest.raises(StreamGapError) as raised:
        next(producer.follow("ops", session_id, timeout_s=0))

    assert (raised.value.first_missing_seq, raised.value.next_seq) == (1, 5)


def test_a_seq_jump_is_told_after_the_events_before_it(
    producer: JuneProducer, rclient: redis.Redis, session_id: str
) -> None:
    # Given seq 1-3 and then seq 6: seq 4 and 5 were lost (a stream rebuilt from a pruned store)
    events = script("t_1")
    stream = producer.stream_key("ops", session_id)
    write_script(rclient, stream, "ops", session_id, "t_1", [e for e in events if e[1] in (1, 2, 3, 6)])
    got: list[FollowedEvent] = []
    with pytest.raises(StreamGapError, match="seq 6 follows seq 3") as raised:
        for event in producer.follow("ops", session_id, timeout_s=0):
            got.append(event)
    assert seqs(got) == [1, 2, 3]
    assert (raised.value.first_missing_seq, raised.value.next_seq) == (4, 6)


def test_a_follow_from_an_id_still_held_is_no_gap_though_older_entries_were_trimmed(
    producer: JuneProducer, rclient: redis.Redis, session_id: str
) -> None:
    _, held = trimmed(rclient, producer.stream_key("ops", session_id), session_id)

    rest = list(producer.follow("ops", session_id, last_id=held[0][0], timeout_s=0))

    assert seqs(rest) == [5, 6]


async def test_afollow_is_told_of_a_trimmed_id_too(
    producer: JuneProducer, rclient: redis.Redis, session_id: str
) -> None:
    ids, _ = trimmed(rclient, producer.stream_key("ops", session_id), session_id)

    with pytest.raises(StreamGapError) as raised:
        async for _ in producer.afollow("ops", session_id, last_id=ids[0], timeout_s=0):
            pass

    assert (raised.value.first_missing_seq, raised.value.next_seq) == (None, 5)


def test_the_cli_says_so_with_a_stream_gap_line_and_follows_on_to_the_turns_end(
    producer: JuneProducer, rclient: redis.Redis, session_id: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], redis_url: str,
) -> None:  # fmt: skip
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JUNE_REDIS_URL", redis_url)
    monkeypatch.setenv("JUNE_KEY_PREFIX", producer.key_prefix)
    trimmed(rclient, producer.stream_key("ops", session_id), session_id)

    code = main(["follow", "ops", session_id, "--turn", "t_1", "--json", "--timeout", str(WAIT_S)])

    gap, *rest = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert gap["type"] == "stream.gap" and (gap["first_missing_seq"], gap["next_seq"]) == (1, 5)
    assert [e["type"] for e in rest] == ["message.delta", "message.completed", "turn.completed"]


def rebuilt_from_a_pruned_outbox(rclient: redis.Redis, stream: str, session: str) -> str:
    """``script("t_1")`` written and followed to its first event; the stream's keys then gone (expired) and the
    stream rebuilt, later, from an outbox that pruned seq 1-3 (new ids, nothing lost by the copy's own count).

    Returns the stream id the follower got (seq 1 of the old copy)."""
    ids = write_script(rclient, stream, "ops", session, "t_1", script("t_1"))
    rclient.delete(stream)
    wait_until(lambda: time.time() * 1000 > int(ids[-1].split("-")[0]) + 1, "the clock to pass the old copy's ids")
    write_script(rclient, stream, "ops", session, "t_1", [e for e in script("t_1") if (e[1] or 0) > 3])
    info: Any = rclient.xinfo_stream(stream)
    assert info["entries-added"] == info["length"]
    return ids[0]


def test_a_follow_from_an_id_of_an_earlier_copy_of_the_stream_is_told_where_the_copy_goes_on(
    producer: JuneProducer, rclient: redis.Redis, session_id: str
) -> None:
    # Given a follower that got seq 1, and the stream rebuilt since from an outbox pruned to seq 4-6
    seen = rebuilt_from_a_pruned_outbox(rclient, producer.stream_key("ops", session_id), session_id)
    # When it follows on from the id it got, without saying which seq it holds
    with pytest.raises(StreamGapError) as raised:
        list(producer.follow("ops", session_id, turn_id="t_1", last_id=seen, timeout_s=0))
    # Then it is told, before anything: the stream goes on at seq 4; reload from the gateway's log route
    gap = raised.value
    assert (gap.first_missing_seq, gap.next_seq, gap.after_id) == (None, 4, seen)
    assert f"/v1/agents/ops/sessions/{session_id}/log" in str(gap)
    # And following on from resume_id with last_seq=3 gives the rest of the turn
    rest = list(producer.follow("ops", session_id, turn_id="t_1", last_id=gap.resume_id, last_seq=3, timeout_s=0))
    assert seqs(rest) == [4, 5, 6]


async def test_afollow_is_told_of_an_id_of_an_earlier_copy_of_the_stream_too(
    producer: JuneProducer, rclient: redis.Redis, session_id: str
) -> None:
    seen = rebuilt_from_a_pruned_outbox(rclient, producer.stream_key("ops", session_id), session_id)

    with pytest.raises(StreamGapError) as raised:
        async for _ in producer.afollow("ops", session_id, last_id=seen, timeout_s=0):
            pass

    assert (raised.value.first_missing_seq, raised.value.next_seq) == (None, 4)
