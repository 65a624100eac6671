"""Slack payloads as inbound turns and answers (section N/O, the inbound half): pure parsing, no network."""

from __future__ import annotations

import json
from typing import Any

import pytest

from june_worker.channels.slack import SlackPayloadError, parse_actions, parse_event


def message(text: str = "order 3 widgets", ts: str = "111.1", **event: Any) -> dict[str, Any]:
    return {
        "type": "event_callback", "team_id": "T1", "event_id": "Ev1",
        "event": {"type": "message", "channel": "C1", "user": "U1", "text": text, "ts": ts, **event},
    }  # fmt: skip


def click(action_id: str = "june_input:yes", **value: Any) -> dict[str, Any]:
    return {
        "type": "block_actions",
        "team": {"id": "T1"},
        "user": {"id": "U2"},
        "container": {"type": "message", "channel_id": "C1", "message_ts": "9.9", "thread_ts": "5.5"},
        "actions": [{"action_id": action_id, "value": json.dumps({"turn_id": "t1", "input_id": "approve-1", **value})}],
    }


def test_a_message_is_a_turn_in_its_thread_with_an_attested_speaker_and_source_slack() -> None:
    turn = parse_event(message(thread_ts="100.0"))
    assert turn is not None
    assert turn.session == "slack:C1:100.0" and turn.text == "order 3 widgets"
    assert turn.event.source == "slack" and turn.event.kind == "message"
    assert turn.event.user is not None and turn.event.user.id == "U1" and turn.event.user.attested
    assert turn.event.model_dump()["channel_id"] == "C1" and turn.event.model_dump()["ts"] == "111.1"
    assert turn.target == {"channel": "slack", "channel_id": "C1", "thread_ts": "100.0", "team_id": "T1", "user": "U1"}


def test_a_message_outside_a_thread_opens_one_at_its_own_ts() -> None:
    turn = parse_event(message())
    assert turn is not None and turn.session == "slack:C1:111.1" and turn.target["thread_ts"] == "111.1"


def test_the_turn_id_is_derived_from_the_message_so_retries_and_a_mention_copy_are_the_same_turn() -> None:
    first = parse_event(message())
    retried = parse_event({**message(), "event_id": "Ev1"})
    mention = parse_event({**message(), "event_id": "Ev2", "event": {**message()["event"], "type": "app_mention",
                                                                   "text": "<@UBOT> order 3 widgets"}})  # fmt: skip
    assert first is not None and retried is not None and mention is not None
    assert first.turn_id == retried.turn_id == mention.turn_id == "slack:T1:C1:111.1"
    assert mention.text == "order 3 widgets" and mention.event.kind == "mention"


@pytest.mark.parametrize(
    "extra",
    [{"bot_id": "B1"}, {"subtype": "message_changed"}, {"subtype": "bot_message"}, {"subtype": "message_deleted"},
     {"subtype": "channel_join"}],
    ids=str,
)  # fmt: skip
def test_bot_posts_and_edits_start_no_turn(extra: dict[str, Any]) -> None:
    assert parse_event(message(**extra)) is None


@pytest.mark.parametrize(
    "extra",
    [{"subtype": "file_share", "files": [{"id": "F1", "name": "invoice.pdf"}]},
     {"subtype": "thread_broadcast", "thread_ts": "100.0"}],
    ids=lambda extra: extra["subtype"],
)  # fmt: skip
def test_a_persons_file_share_or_thread_broadcast_starts_a_turn_like_a_message(extra: dict[str, Any]) -> None:
    turn = parse_event(message("what does this say?", **extra))
    assert turn is not None and turn.text == "what does this say?" and turn.turn_id == "slack:T1:C1:111.1"
    assert turn.session == f"slack:C1:{extra.get('thread_ts', '111.1')}" and turn.event.kind == "message"


def test_a_reaction_is_a_turn_in_the_session_of_the_message_reacted_to_not_of_its_thread() -> None:
    # Slack's reaction_added names the message (channel, ts), not its thread: a reaction to a reply at 222.2 inside
    # the thread 100.0 is the session of 222.2 (docs/slack.md, "Limits"), and its answer goes to that reply's ts
    reaction = {
        "type": "event_callback", "team_id": "T1", "event_id": "Ev7",
        "event": {"type": "reaction_added", "user": "U1", "reaction": "eyes",
                  "item": {"type": "message", "channel": "C1", "ts": "222.2"}},
    }  # fmt: skip
    turn = parse_event(reaction, respond_to=("reaction_added",))
    assert turn is not None and turn.session == "slack:C1:222.2" and turn.target["thread_ts"] == "222.2"
    assert turn.text == ":eyes:"


def test_s170_replace_in_flight_applies_to_messages_not_reactions() -> None:
    reaction = {
        "type": "event_callback", "team_id": "T1", "event_id": "Ev9",
        "event": {"type": "reaction_added", "user": "U1", "reaction": "+1", "item": {"channel": "C1", "ts": "111.1"}},
    }  # fmt: skip
    respond_to = ("message", "reaction_added")
    got = [parse_event(p, respond_to=respond_to, replace_in_flight=True) for p in (message(), reaction)]
    assert [t.replace if t else None for t in got] == [True, False]
    assert got[1] is not None and got[1].turn_id == "slack:T1:Ev9" and got[1].event.kind == "reaction"


def test_an_event_type_not_subscribed_starts_nothing() -> None:
    assert parse_event(message(), respond_to=("app_mention",)) is None


@pytest.mark.parametrize(
    "payload, named",
    [
        ({"type": "event_callback", "team_id": "T1"}, "event"),
        (message(channel=["C1"]), "event.channel"),
        (message(text=None), "event.text"),
        ({**message(), "team_id": "T 1"}, "team_id"),
    ],
)
def test_a_malformed_event_names_what_is_wrong(payload: dict[str, Any], named: str) -> None:
    with pytest.raises(SlackPayloadError, match=named.replace(".", r"\.")):
        parse_event(payload)


def test_s183_a_click_is_an_answer_by_the_clicker_in_the_thread_it_was_made_in() -> None:
    (answer,) = parse_actions(click())
    assert (answer.session, answer.turn_id, answer.input_id, answer.value, answer.by) == (
        "slack:C1:5.5", "t1", "approve-1", True, "U2",
    )  # fmt: skip
    assert answer.reply_to == {"channel": "slack", "channel_id": "C1", "thread_ts": "5.5", "user": "U2"}
    (deny,) = parse_actions(click("june_input:no", session="slack:C-ops:daily"))
    assert deny.value is False and deny.session == "slack:C-ops:daily"


def test_s193_only_the_exact_june_input_actions_are_ours() -> None:
    assert parse_actions(click("june_input_v2")) == []
    assert parse_actions(click("june_input:maybe")) == []
    assert parse_actions({**click(), "type": "view_submission"}) == []


def test_a_click_whose_value_is_not_ours_is_malformed() -> None:
    payload = click()
    payload["actions"][0]["value"] = "not json"
    with pytest.raises(SlackPayloadError, match="value"):
        parse_actions(payload)
