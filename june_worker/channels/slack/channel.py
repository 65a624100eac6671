"""The Slack channel's outbound side, as a worker holds it: a bot token, rendering options, a renderer per run.

Configured where the worker process starts (:meth:`SlackChannel.from_env`, in the function that
builds the agents); the Web API client itself is made on first use in each process. The gateway
builds the same agents to learn their names (inside :func:`~june_worker.channels.base.receiving_only`),
and holds no bot token: there ``from_env`` without ``SLACK_BOT_TOKEN`` gives a channel that never
posts (its :meth:`~SlackChannel.renderer` and :meth:`~SlackChannel.notify` raise ``ConfigError``).

==============================  ===================================================  ==================
variable                        meaning                                              default
==============================  ===================================================  ==================
SLACK_BOT_TOKEN                 the bot token (``xoxb-...``); never logged           required
JUNE_SLACK_API_URL              the Web API's base URL (a local fake in tests)       https://slack.com/api/
JUNE_SLACK_LIVE                 render while the turn runs; 0: post once at its end  1
JUNE_SLACK_STREAM               live with chat.startStream / appendStream /          1
                                stopStream (0: chat.postMessage then chat.update)
JUNE_SLACK_STATUS               a status line while the turn runs ("is thinking…")   none
JUNE_SLACK_APPROVAL_CONFIRM     Approve / Deny ask again in a dialog                 0
JUNE_SLACK_INTERVAL_S           live pushes at most this often                       0.6
==============================  ===================================================  ==================
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ...engine.types import JsonValue
from ...errors import ChannelError, ConfigError
from ..base import RenderContext, is_receiving_only
from .api import SlackApi
from .render import SlackOptions, SlackRenderer

__all__ = ["SlackChannel"]


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected 1 or 0")


class SlackChannel:
    """Slack, seen from a worker: renders turns into threads and tells one person a note (ephemeral)."""

    name = "slack"

    def __init__(self, token: str, *, base_url: str | None = None, options: SlackOptions | None = None) -> None:
        if not token.strip():
            raise ConfigError("the Slack channel needs a bot token (SLACK_BOT_TOKEN)")
        self._api: SlackApi | None = SlackApi(token.strip(), base_url=base_url)
        self.base_url = self._api.base_url
        self.options = options or SlackOptions()

    def __repr__(self) -> str:
        return f"SlackChannel({self.base_url!r}, {self.options!r})"

    @classmethod
    def receiving(cls, *, base_url: str | None = None, options: SlackOptions | None = None) -> SlackChannel:
        """The channel as a process that only receives holds it: no bot token, so it never posts."""
        channel = cls.__new__(cls)  # not __init__: that one demands the token
        channel._api = None
        channel.base_url = base_url or SlackApi.DEFAULT_URL
        channel.options = options or SlackOptions()
        return channel

    @property
    def api(self) -> SlackApi:
        if self._api is None:
            raise ConfigError("SLACK_BOT_TOKEN is not set: the Slack channel cannot post without the bot token")
        return self._api

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlackChannel:
        env = os.environ if env is None else env
        token = env.get("SLACK_BOT_TOKEN", "")
        if not token.strip() and not is_receiving_only():
            raise ConfigError("SLACK_BOT_TOKEN is not set: the Slack channel cannot post without the bot token")
        try:
            interval_s = float(env.get("JUNE_SLACK_INTERVAL_S", "0.6"))
        except ValueError:
            raise ConfigError(f"JUNE_SLACK_INTERVAL_S={env['JUNE_SLACK_INTERVAL_S']!r} is not a number") from None
        options = SlackOptions(
            live=_flag(env, "JUNE_SLACK_LIVE", True),
            stream=_flag(env, "JUNE_SLACK_STREAM", True),
            status=env.get("JUNE_SLACK_STATUS", "").strip() or None,
            approval_confirm=_flag(env, "JUNE_SLACK_APPROVAL_CONFIRM", False),
            interval_s=max(0.0, interval_s),
        )
        base_url = env.get("JUNE_SLACK_API_URL") or None
        if not token.strip():  # a gateway building the agents for their names: the token is the workers' only
            return cls.receiving(base_url=base_url, options=options)
        return cls(token, base_url=base_url, options=options)

    def renderer(self, target: Mapping[str, JsonValue], ctx: RenderContext) -> SlackRenderer:
        return SlackRenderer(self.api, target, ctx, self.options)

    def notify(self, target: Mapping[str, JsonValue], text: str) -> None:
        """An ephemeral note to ``target["user"]`` in its channel (and thread): nobody else sees it."""
        channel, user = target.get("channel_id"), target.get("user")
        if not isinstance(channel, str) or not isinstance(user, str):
            raise ChannelError('a Slack note needs "channel_id" and "user" in its target', "", "bad_target", False)
        thread = target.get("thread_ts")
        self.api.call("chat.postEphemeral", channel=channel, user=user, text=text,
                      thread_ts=thread if isinstance(thread, str) else None)  # fmt: skip
