"""The worker's transcript cache keeps what it is told to, least recently used out first, within its bounds."""

from __future__ import annotations

import pytest

from june_worker.engine.store import SessionRef
from june_worker.engine.types import Message, UserMessage
from june_worker.worker import transcripts
from june_worker.worker.transcripts import TranscriptCache, held_params


def _messages(n: int, turn: str = "t1") -> list[Message]:
    return [UserMessage(turn_id=turn, text=str(i)) for i in range(n)]


A, B, C = SessionRef("ops", "a"), SessionRef("ops", "b"), SessionRef("ops", "c")


def test_the_least_recently_used_session_goes_first_when_there_are_too_many() -> None:
    cache = TranscriptCache(max_sessions=2, max_messages=100)
    cache.put(A, 0, _messages(1))
    cache.put(B, 0, _messages(1))
    assert cache.get(A) is not None  # A is now the most recently used
    cache.put(C, 0, _messages(1))
    assert cache.get(B) is None and cache.get(A) is not None and cache.get(C) is not None


def test_sessions_go_until_the_messages_held_fit_and_a_transcript_too_long_is_not_kept() -> None:
    cache = TranscriptCache(max_sessions=10, max_messages=10)
    cache.put(A, 0, _messages(4))
    cache.put(B, 0, _messages(4))
    cache.put(C, 0, _messages(4))
    assert cache.get(A) is None and cache.messages == 8
    cache.put(B, 0, _messages(11))
    assert cache.get(B) is None and cache.messages == 4


def test_a_new_put_replaces_the_sessions_entry_and_zero_sessions_turns_it_off() -> None:
    cache = TranscriptCache(max_sessions=4, max_messages=100)
    cache.put(A, 0, _messages(3))
    cache.put(A, 1, _messages(2, "t9"))
    held = cache.get(A)
    assert held is not None and held.generation == 1 and cache.messages == 2
    assert held_params(held) == {"g": 1, "have": 2, "last": "t9"}
    off = TranscriptCache(max_sessions=0, max_messages=100)
    off.put(A, 0, _messages(1))
    assert off.get(A) is None and held_params(None) == {"g": -1, "have": 0, "last": ""}


def _json_size(messages: list[Message]) -> int:
    return sum(len(m.model_dump_json()) for m in messages)


def test_sessions_go_until_the_bytes_held_fit_and_a_transcript_too_large_is_not_kept() -> None:
    # Given a cache bounded by size only: room for two transcripts of 4 messages, not three
    four = _json_size(_messages(4))
    cache = TranscriptCache(max_sessions=10, max_messages=1000, max_bytes=2 * four + 10)
    cache.put(A, 0, _messages(4))
    cache.put(B, 0, _messages(4))
    cache.put(C, 0, _messages(4))
    # Then the least recently used went, and what is held is measured by its messages' JSON
    assert cache.get(A) is None and cache.bytes == 2 * four and cache.messages == 8
    # And a transcript larger than the bound alone is not kept (nor does it push the others out)
    big = [UserMessage(turn_id="t1", text="x" * (3 * four))]
    cache.put(A, 0, big)
    assert cache.get(A) is None and cache.bytes == 2 * four and len(cache) == 2


def test_a_transcript_that_grows_is_measured_by_what_was_added_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a held transcript of 100 messages
    measured: list[Message] = []

    def size(message: Message) -> int:
        measured.append(message)
        return len(message.model_dump_json())

    monkeypatch.setattr(transcripts, "_size", size)
    cache = TranscriptCache(max_sessions=4, max_messages=1000)
    first = _messages(100)
    cache.put(A, 0, first)
    measured.clear()
    # When the next turn puts it back with two messages more (the same objects first, as a turn leaves them)
    grown = [*first, *_messages(2, "t2")]
    cache.put(A, 0, grown)
    # Then only those two were measured, and the size is the whole list's
    assert measured == grown[100:] and cache.bytes == _json_size(grown)
    # But a put of another generation (a reset) is measured whole
    measured.clear()
    cache.put(A, 1, grown)
    assert len(measured) == 102 and cache.bytes == _json_size(grown)
