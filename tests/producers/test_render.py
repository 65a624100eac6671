"""How june-produce draws events: the live rich view on a (fake) terminal, and the exit codes."""

from __future__ import annotations

import re
from io import StringIO
from typing import Any

import pytest
from rich.console import Console

from producers import FollowedEvent
from producers.cli import parse_value
from producers.render import LiveView, exit_code, resume_command, turn_status

from .kit import Event, script

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def followed(turn_id: str, events: list[Event], session: str = "s1") -> list[FollowedEvent]:
    out = []
    for i, (kind, seq, fields) in enumerate(events, start=1):
        data: dict[str, Any] = {"agent": "ops", "session": session, "turn_id": turn_id, "seq": seq, "type": kind}
        out.append(FollowedEvent(stream_id=f"{i}-0", type=kind, data={**data, **fields}))
    return out


def render(events: list[FollowedEvent]) -> tuple[str, str]:
    """(what a terminal got, the same without colour codes)."""
    buffer = StringIO()
    view = LiveView(Console(file=buffer, force_terminal=True, width=120, color_system="standard"), "ops", "s1")
    view.enqueued("t_1", "june")
    for event in events:
        view.show(event)
    view.finish(events[-1] if events else None)
    raw = buffer.getvalue()
    return raw, ANSI.sub("", raw)


def test_the_live_view_streams_text_shows_tools_and_the_final_status_on_a_terminal() -> None:
    raw, text = render(followed("t_1", script("t_1")))

    assert "\x1b[" in raw  # coloured: it is a terminal view
    lines = text.splitlines()
    assert lines[0] == "queued t_1 for ops:s1 on june"
    assert "▶ turn t_1 started (cli from U1)" in lines
    assert "Let me order it." in lines  # two deltas, typed onto one line
    assert text.count("Let me order it.") == 1  # message.completed does not print it again
    assert '→ create_order {"item":"book"}' in lines
    assert '← create_order {"item":"book"}' in lines
    assert "Done." in lines
    assert lines[-1] == "✓ completed (12 in / 5 out tokens)"


def test_the_live_view_shows_an_input_request_with_its_prompt_and_the_command_to_answer() -> None:
    _, text = render(followed("t_1", script("t_1", end="input.requested")))

    assert "⏸ waiting for input approve: Refund 5 on 42?" in text
    assert 'expects {"type":"boolean"}' in text
    assert "answer with: june-produce resume ops s1 t_1 approve true --by U9" in text


@pytest.mark.parametrize(
    ("end", "line"),
    [("turn.failed", "✗ failed in model: model overloaded"), ("turn.cancelled", "■ cancelled (requested)")],
)
def test_the_live_view_ends_with_failure_or_cancellation(end: str, line: str) -> None:
    _, text = render(followed("t_1", script("t_1", end=end)))
    assert text.splitlines()[-1] == line


def test_a_turn_rejected_at_intake_reads_rejected() -> None:
    events = followed("t_1", [("turn.failed", 1, {"error": {"message": "session is parked"}, "phase": "intake"})])
    _, text = render(events)
    assert text.splitlines()[-1] == "✗ rejected: session is parked"
    assert turn_status(events[-1]) == "rejected"


def test_text_from_a_turn_is_printed_verbatim_never_as_markup() -> None:
    events = followed(
        "t_1",
        [
            ("message.delta", None, {"step": "model:1", "text": "[bold red]not markup[/bold red]"}),
            ("message.completed", 1, {"step": "model:1", "text": "[bold red]not markup[/bold red]"}),
        ],
    )
    _, text = render(events)
    assert "[bold red]not markup[/bold red]" in text


def test_the_live_view_shows_what_the_person_said_under_the_line_of_the_turn_they_started() -> None:
    # Given a turn opened by a person's message (its inbound event holds what they typed, markup and all)
    trigger = {"kind": "inbound", "event": {"source": "cli", "user": {"id": "ann"}, "text": "Order [b]3[/b] widgets"}}
    events = followed("t_1", [("turn.started", 1, {"trigger": trigger})])
    # When it is shown
    _, text = render(events)
    # Then the person's words come right after the turn's start, verbatim
    lines = text.splitlines()
    at = lines.index("▶ turn t_1 started (cli from ann)")
    assert lines[at + 1] == "› Order [b]3[/b] widgets"


def test_a_turn_whose_event_holds_no_text_shows_no_line_of_the_person() -> None:
    events = followed("t_1", [("turn.started", 1, {"trigger": {"kind": "proactive", "by": "cron:daily"}})])
    _, text = render(events)
    assert "▶ turn t_1 started (proactive, by cron:daily)" in text and "›" not in text


def test_a_message_caught_up_without_its_deltas_is_printed_whole() -> None:
    _, text = render(followed("t_1", [("message.completed", 1, {"step": "model:1", "text": "From the store."})]))
    assert "From the store." in text.splitlines()


def test_a_retried_step_replaces_the_dead_attempts_text_and_drops_its_late_deltas() -> None:
    # Given attempt 1 of model:1 typed "stale ", attempt 2 typed "fresh", then a late delta of attempt 1 came
    events = followed(
        "t_1",
        [
            ("message.delta", None, {"step": "model:1", "text": "stale ", "attempt": 1}),
            ("message.delta", None, {"step": "model:1", "text": "fresh", "attempt": 2}),
            ("message.delta", None, {"step": "model:1", "text": "zombie", "attempt": 1}),
            ("message.completed", 1, {"step": "model:1", "text": "fresh"}),
        ],
    )
    _, text = render(events)
    lines = text.splitlines()
    # Then the view says the step was retried, shows the new attempt's text once, and never the late delta
    assert "↻ model:1 retried (attempt 2); the text above was from a dead attempt" in lines
    assert lines.count("fresh") == 1 and "zombie" not in text
    assert "(final text of a retried step)" not in text  # what attempt 2 typed is the final text


def test_a_follow_that_stops_before_the_end_says_so() -> None:
    _, text = render(followed("t_1", script("t_1")[:2]))
    assert "stopped waiting; the turn has not ended" in text.splitlines()[-1]


def test_unknown_event_types_are_shown_not_dropped() -> None:
    _, text = render(followed("t_1", [("turn.future", 1, {"novel": 1})]))
    assert "· turn.future" in text


@pytest.mark.parametrize(
    ("end", "code"),
    [("turn.completed", 0), ("turn.failed", 1), ("turn.cancelled", 1), ("input.requested", 3)],
)
def test_exit_code_follows_the_terminal_event(end: str, code: int) -> None:
    assert exit_code(followed("t_1", script("t_1", end=end))[-1]) == code


def test_exit_code_of_an_unfinished_turn_is_four() -> None:
    assert exit_code(None) == 4
    assert exit_code(followed("t_1", script("t_1")[:1])[-1]) == 4


def test_resume_command_quotes_what_a_shell_would_split() -> None:
    event = followed(
        "t_1",
        [("input.requested", 1, {"request": {"id": "pick one", "prompt": "?", "answerers": {"user": "U 1"}}})],
        session="s1",
    )[0]
    assert resume_command("ops", "s1", event) == "june-produce resume ops s1 t_1 'pick one' VALUE --by 'U 1'"


@pytest.mark.parametrize(
    ("typed", "value"),
    [("true", True), ("42", 42), ('{"a": 1}', {"a": 1}), ('"42"', "42"), ("yes please", "yes please"), ("", "")],
)
def test_a_typed_answer_is_json_when_it_parses_else_a_string(typed: str, value: object) -> None:
    assert parse_value(typed) == value


def test_the_live_view_says_when_a_turn_compacted_its_context() -> None:
    compacted = ("context.compacted", 2, {"step": "compact:40", "at": 40, "kept_from": 31, "summarized": 30})
    _, text = render(followed("t_1", [("turn.started", 1, {"trigger": {"kind": "proactive"}}), compacted]))

    assert "⋯ context compacted: 30 older messages summarised, kept from 31" in text.splitlines()
