"""The fault matrix's and bench/chaos.py's check that a stream tells each structural event once, by meaning."""

from __future__ import annotations

from typing import Any

from bench._harness import repeated_events


def _turn(turn_id: str, first: int) -> list[dict[str, Any]]:
    call = {"id": "c1", "name": "order", "input": {}}
    return [
        {"type": "turn.started", "turn_id": turn_id, "seq": first, "trigger": {"kind": "proactive", "by": "x"}},
        {"type": "action.requested", "turn_id": turn_id, "seq": first + 1, "step": "model:1", "call": call},
        {"type": "input.requested", "turn_id": turn_id, "seq": first + 2, "request": {"id": "ok"}},
        {
            "type": "turn.started",
            "turn_id": turn_id,
            "seq": first + 3,
            "trigger": {"kind": "resume", "call_id": "c1", "input_id": "ok"},
        },
        {"type": "action.completed", "turn_id": turn_id, "seq": first + 4, "step": "model:1", "call": call},
        {"type": "message.completed", "turn_id": turn_id, "seq": first + 5, "step": "model:3", "text": "done"},
        {"type": "turn.completed", "turn_id": turn_id, "seq": first + 6, "text": "done"},
    ]


def test_a_turn_that_opens_parks_resumes_and_ends_once_repeats_nothing() -> None:
    assert repeated_events(_turn("t1", 1) + _turn("t2", 8)) == []


def test_the_same_event_committed_twice_under_two_seqs_is_a_repeat() -> None:
    events = _turn("t1", 1)
    twice = [
        *events,
        {**events[0], "seq": 8},
        {**events[4], "seq": 9},
        {**events[-1], "type": "turn.failed", "seq": 10},
    ]
    assert repeated_events(twice) == [
        "t1 turn.started: 2 times",
        "t1 action.completed model:1 c1: 2 times",
        "t1 terminal: 2 times",
    ]
