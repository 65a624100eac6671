"""Slack's settings, on each side: the gateway's (signing secret, agent, events) and the worker's channel."""

from __future__ import annotations

import pytest

from june_worker import Agent
from june_worker.channels import Channels, MemoryRenderState, RenderContext, receiving_only
from june_worker.channels.slack import SlackChannel
from june_worker.channels.webhook import WebhookChannel
from june_worker.errors import ConfigError
from june_worker.gateway import GatewaySettings
from june_worker.gateway.slack_settings import ResolveIdentity, SlackGatewaySettings, slack_from_env
from june_worker.models import ScriptedModel

BASE = {"JUNE_GATEWAY_AGENTS": "desk,ops", "JUNE_GATEWAY_INSECURE_DEV": "1"}


def test_the_slack_routes_are_off_without_a_signing_secret() -> None:
    assert GatewaySettings.from_env(BASE).slack is None


def test_the_signing_secret_turns_them_on_and_never_shows_in_a_repr() -> None:
    env = {**BASE, "SLACK_SIGNING_SECRET": "s3cr3t-signing", "JUNE_SLACK_AGENT": "desk",
           "JUNE_SLACK_RESPOND_TO": "app_mention,reaction_added", "JUNE_SLACK_REPLACE_IN_FLIGHT": "1"}  # fmt: skip
    settings = GatewaySettings.from_env(env)
    assert settings.slack is not None
    assert settings.slack.agent == "desk" and settings.slack.replace_in_flight
    assert settings.slack.respond_to == ("app_mention", "reaction_added")
    assert "s3cr3t" not in repr(settings) and "s3cr3t" not in repr(settings.slack)


@pytest.mark.parametrize("raw", ["message, ", " message ,app_mention,", "message,,app_mention"])
def test_the_event_types_are_read_with_spaces_and_empty_items_left_out(raw: str) -> None:
    env = {**BASE, "SLACK_SIGNING_SECRET": "x", "JUNE_SLACK_AGENT": "desk", "JUNE_SLACK_RESPOND_TO": raw}
    slack = GatewaySettings.from_env(env).slack
    assert slack is not None and slack.respond_to == tuple(t for t in ("message", "app_mention") if t in raw)


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"JUNE_SLACK_AGENT": "billing"}, "JUNE_SLACK_AGENT"),
        ({"JUNE_SLACK_AGENT": "desk", "JUNE_SLACK_RESPOND_TO": "message,file_shared"}, "JUNE_SLACK_RESPOND_TO"),
        ({"JUNE_SLACK_AGENT": "desk", "JUNE_SLACK_RESOLVE_IDENTITY": "nowhere"}, "JUNE_SLACK_RESOLVE_IDENTITY"),
        ({"JUNE_SLACK_AGENT": "desk", "JUNE_SLACK_REPLACE_IN_FLIGHT": "maybe"}, "JUNE_SLACK_REPLACE_IN_FLIGHT"),
    ],
)
def test_a_bad_gateway_slack_setting_names_itself(extra: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        GatewaySettings.from_env({**BASE, "SLACK_SIGNING_SECRET": "x", **extra})


def test_the_worker_channel_needs_the_bot_token_and_keeps_it_out_of_its_repr() -> None:
    with pytest.raises(ConfigError, match="SLACK_BOT_TOKEN"):
        SlackChannel.from_env({})
    channel = SlackChannel.from_env({"SLACK_BOT_TOKEN": "xoxb-1-secret", "JUNE_SLACK_STREAM": "0",
                                     "JUNE_SLACK_STATUS": "is thinking…", "JUNE_SLACK_API_URL": "http://127.0.0.1:9/api/"})  # fmt: skip
    assert not channel.options.stream and channel.options.status == "is thinking…"
    assert channel.api.base_url == "http://127.0.0.1:9/api/"
    assert "xoxb-1-secret" not in repr(channel)
    with pytest.raises(ConfigError, match="JUNE_SLACK_LIVE"):
        SlackChannel.from_env({"SLACK_BOT_TOKEN": "xoxb-1", "JUNE_SLACK_LIVE": "sometimes"})


def test_a_channel_built_for_a_process_that_only_receives_needs_no_token_and_never_posts() -> None:
    # Given the gateway building the agents (receiving only), with no SLACK_BOT_TOKEN
    with receiving_only():
        channel = SlackChannel.from_env({"JUNE_SLACK_STATUS": "is thinking…"})
    # Then the channel exists, but asking it to render or to tell someone names the missing token
    ctx = RenderContext(agent="desk", session="slack:C1:1.1", turn_id="t1", state=MemoryRenderState())
    target = {"channel": "slack", "channel_id": "C1", "thread_ts": "1.1", "user": "U1"}
    with pytest.raises(ConfigError, match="SLACK_BOT_TOKEN"):
        channel.renderer(target, ctx)
    with pytest.raises(ConfigError, match="SLACK_BOT_TOKEN"):
        channel.notify(target, "hello")


def _old(user_id: str, team_id: str | None) -> None:
    return None


def _keywords(user_id: str, team_id: str | None, *, channel_id: str | None = None) -> None:
    return None


def _everything(user_id: str, team_id: str | None, **more: object) -> None:
    return None


async def _new(user_id: str, team_id: str | None, *, user_team_id: str | None, channel_id: str | None) -> None:
    return None


@pytest.mark.parametrize(
    "resolver, called_with",
    [
        (_old, {}),
        (_keywords, {"channel_id": "C1"}),
        (_everything, {"user_team_id": "T2", "channel_id": "C1"}),
        (_new, {"user_team_id": "T2", "channel_id": "C1"}),
    ],
)
def test_the_identity_resolver_gets_only_the_keywords_its_signature_names(
    resolver: ResolveIdentity, called_with: dict[str, str]
) -> None:
    # Given a resolver written for (user_id, team_id), or naming some or all of the newer keywords
    settings = SlackGatewaySettings(signing_secret="x", agent="desk", resolve_identity=resolver)
    # Then it is called with those keywords only (an old one with none, so it keeps working)
    assert settings.resolver_arguments("T2", "C1") == called_with


def _one_argument(user_id: str) -> None:
    return None


def test_an_identity_resolver_that_cannot_take_a_user_and_a_team_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="JUNE_SLACK_RESOLVE_IDENTITY: '_one_argument' cannot be called as"):
        SlackGatewaySettings(signing_secret="x", agent="desk", resolve_identity=_one_argument)


def test_a_slack_agent_reached_through_other_channels_only_is_refused() -> None:
    # Given the gateway's built agents: the Slack agent's deliver hook has a webhook channel, not Slack
    agent = Agent(
        name="desk", model=ScriptedModel([]), deliver=Channels([WebhookChannel({"ops": "http://127.0.0.1:9/"})])
    )
    env = {"SLACK_SIGNING_SECRET": "x", "JUNE_SLACK_AGENT": "desk"}
    # Then the Slack settings refuse it, naming what it is reached through
    with pytest.raises(ConfigError, match=r"agent desk is reached through \['webhook'\], not slack"):
        slack_from_env(env, ("desk",), {"desk": agent})
