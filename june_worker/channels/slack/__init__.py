"""Slack, the first channel: inbound payloads (:mod:`.inbound`), rendering (:mod:`.render`), the Web API (:mod:`.api`).

Needs the ``slack`` extra (``slack_sdk``). See docs/slack.md for the app manifest and how to run it.
"""

from .channel import SlackChannel
from .inbound import SlackPayloadError, parse_actions, parse_event, session_id
from .render import SlackOptions, SlackRenderer

__all__ = [
    "SlackChannel",
    "SlackOptions",
    "SlackPayloadError",
    "SlackRenderer",
    "parse_actions",
    "parse_event",
    "session_id",
]
