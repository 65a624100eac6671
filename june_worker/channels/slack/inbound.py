"""Slack's verified payloads as june's inbound requests: an event becomes a turn, a button click an answer.

Pure functions over the JSON Slack sent (the signature was checked before, by the receiving
process). A payload that is not what Slack sends is a :class:`SlackPayloadError` naming what is
wrong (the gateway answers 400); one that is fine but not for us (a bot's own message, an edit, an
action that is not ``june_input:yes`` / ``june_input:no``) is None or an empty list.

* A message or an app mention in channel ``C`` is the turn ``slack:<team>:<C>:<ts>`` (a retry of
  the delivery, or the same message arriving as both ``message`` and ``app_mention``, is the same
  turn) in the session ``slack:<C>:<thread_ts>`` (a message outside a thread opens one at its own
  ts); a person's ``file_share`` or ``thread_broadcast`` is a message like any other (its text; the
  files themselves are not passed on). A ``reaction_added`` is the turn ``slack:<team>:<event_id>``
  in the session ``slack:<C>:<ts of the message reacted to>``: Slack's event does not say which
  thread that message is in, so a reaction to a reply inside a thread is a session of its own, not
  the thread's (finding the thread takes ``conversations.replies``, a Web API call with the bot
  token, which this side holds neither of nor the time for within Slack's 3 seconds).
* The speaker is attested (Slack signed it), ``source`` is ``slack``; the target is the thread.
* :func:`speaker_team` / :func:`clicker_team`: the sender's own workspace, for the identity resolver.
  In a Slack Connect channel it is not the workspace that received the request (``team_id``):
  Slack names it in the event's ``user_team`` (or ``team``), and in a click's ``user.team_id``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from typing import Any

from ...engine.types import InboundEvent, Principal, SpeakerIdentity
from ...errors import PayloadError
from ..base import InboundAnswer, InboundTurn
from .blocks import ACTION_PREFIX

__all__ = ["SlackPayloadError", "clicker_team", "parse_actions", "parse_event", "session_id", "speaker_team"]

_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,40}$")
_LEADING_MENTION = re.compile(r"^\s*<@[A-Z0-9]+>[\s,:]*")
_ANSWERS = {f"{ACTION_PREFIX}yes": True, f"{ACTION_PREFIX}no": False}
_USER_SUBTYPES = frozenset({"file_share", "thread_broadcast"})
"""Message subtypes a person posts (with a file; a thread reply also sent to the channel): they start a turn like a
plain message. Every other subtype (``bot_message``, ``message_changed``, ``message_deleted``, joins...) does not."""


class SlackPayloadError(PayloadError):
    """A Slack payload that is not what Slack sends (the gateway answers 400)."""


def _id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise SlackPayloadError(f"{what} must be a Slack id (letters, digits, '.', '_' or '-'), not {value!r:.60}")
    return value


def _obj(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SlackPayloadError(f"{what} must be a JSON object")
    return value


def session_id(channel: str, thread_ts: str) -> str:
    return f"slack:{channel}:{thread_ts}"


def parse_event(
    payload: Mapping[str, Any],
    *,
    respond_to: Collection[str] = ("message", "app_mention"),
    replace_in_flight: bool = False,
    principal: Principal | None = None,
) -> InboundTurn | None:
    """The turn an ``event_callback`` starts, or None when it starts none."""
    event = _obj(payload.get("event"), "event")
    kind = event.get("type")
    if not isinstance(kind, str):
        raise SlackPayloadError("event.type must be a string")
    subtype = event.get("subtype")
    if kind not in respond_to or event.get("bot_id") or (subtype and subtype not in _USER_SUBTYPES):
        return None  # not subscribed here, a bot's own post (ours included), an edit, a deletion...
    team = _id(payload.get("team_id") or event.get("team"), "team_id")
    user = _id(event.get("user"), "event.user")
    if kind == "reaction_added":
        item = _obj(event.get("item"), "event.item")
        channel, ts = _id(item.get("channel"), "event.item.channel"), _id(item.get("ts"), "event.item.ts")
        reaction = event.get("reaction")
        if not isinstance(reaction, str):
            raise SlackPayloadError("event.reaction must be a string")
        turn_id = f"slack:{team}:{_id(payload.get('event_id'), 'event_id')}"
        text, thread, normal = f":{reaction}:", ts, "reaction"
    else:
        channel, ts = _id(event.get("channel"), "event.channel"), _id(event.get("ts"), "event.ts")
        thread = _id(event["thread_ts"], "event.thread_ts") if event.get("thread_ts") else ts
        raw_text = event.get("text")
        if not isinstance(raw_text, str):
            raise SlackPayloadError("event.text must be a string")
        text = _LEADING_MENTION.sub("", raw_text).strip()
        if not text:
            return None
        turn_id, normal = f"slack:{team}:{channel}:{ts}", "mention" if kind == "app_mention" else "message"
    session = session_id(channel, thread)
    inbound = InboundEvent(
        source="slack",
        kind=normal,
        user=SpeakerIdentity(id=user, attested=True, team=team),
        principal=principal,
        thread=session,
        text=text,
        channel_id=channel,
        thread_ts=thread,
        ts=ts,
    )
    target = {"channel": "slack", "channel_id": channel, "thread_ts": thread, "team_id": team, "user": user}
    replace = replace_in_flight and normal in ("message", "mention")
    return InboundTurn(session=session, turn_id=turn_id, text=text, event=inbound, target=target, replace=replace)


def _team(payload: Mapping[str, Any], *candidates: tuple[Any, str]) -> str | None:
    for value, what in candidates:
        if value:
            return _id(value, what)
    received = payload.get("team_id")
    return received if isinstance(received, str) and _ID_RE.match(received) else None


def speaker_team(payload: Mapping[str, Any]) -> str | None:
    """The workspace of the person an ``event_callback`` is from (their own, in a Slack Connect channel)."""
    event = _obj(payload.get("event"), "event")
    return _team(payload, (event.get("user_team"), "event.user_team"), (event.get("team"), "event.team"))


def clicker_team(payload: Mapping[str, Any]) -> str | None:
    """The workspace of the person who clicked (``block_actions``: ``user.team_id``, else the payload's team)."""
    user, team = payload.get("user"), payload.get("team")
    own = user.get("team_id") if isinstance(user, Mapping) else None
    received = team.get("id") if isinstance(team, Mapping) else None
    return _team(payload, (own, "user.team_id"), (received, "team.id"))


def parse_actions(payload: Mapping[str, Any]) -> list[InboundAnswer]:
    """The answers a ``block_actions`` click carries (our ``june_input:yes`` / ``june_input:no`` buttons only)."""
    if payload.get("type") != "block_actions":
        return []
    actions = payload.get("actions")
    if not isinstance(actions, list):
        raise SlackPayloadError("actions must be a list")
    ours = [_obj(a, "actions[]") for a in actions if isinstance(a, Mapping) and a.get("action_id") in _ANSWERS]
    if not ours:
        return []  # only the exact june_input:yes / june_input:no are ours
    user = _obj(payload.get("user"), "user")
    by = _id(user.get("id"), "user.id")
    container = _obj(payload.get("container"), "container")
    raw_message = payload.get("message")
    message: Mapping[str, Any] = raw_message if isinstance(raw_message, Mapping) else {}
    channel = _id(container.get("channel_id") or _obj(payload.get("channel"), "channel").get("id"), "channel id")
    message_ts = _id(container.get("message_ts") or message.get("ts"), "container.message_ts")
    thread = container.get("thread_ts") or message.get("thread_ts") or message_ts
    thread = _id(thread, "thread_ts")
    out = []
    for action in ours:
        try:
            value = json.loads(action.get("value") or "")
        except ValueError:
            raise SlackPayloadError("the button's value is not JSON") from None
        value = _obj(value, "the button's value")
        turn_id, input_id = value.get("turn_id"), value.get("input_id")
        if not isinstance(turn_id, str) or not isinstance(input_id, str) or not turn_id or not input_id:
            raise SlackPayloadError("the button's value must name turn_id and input_id")
        given = value.get("session")
        session = given if isinstance(given, str) and given else session_id(channel, thread)
        out.append(
            InboundAnswer(
                session=session,
                turn_id=turn_id,
                input_id=input_id,
                value=_ANSWERS[str(action["action_id"])],
                by=by,
                reply_to={"channel": "slack", "channel_id": channel, "thread_ts": thread, "user": by},
            )
        )
    return out
