"""The gateway's Slack settings, read from the environment with the rest (:meth:`GatewaySettings.from_env`).

Every variable is declared once, in :class:`SlackEnv`; docs/settings.md is generated from it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeAlias

from ..channels.base import Channels
from ..envsettings import EnvModel, comma_list, var
from ..errors import ConfigError

__all__ = ["EVENT_TYPES", "RESOLVER_KEYWORDS", "ResolveIdentity", "SlackEnv", "SlackGatewaySettings", "slack_from_env"]

ResolveIdentity: TypeAlias = Callable[..., "Mapping[str, Any] | None | Awaitable[Mapping[str, Any] | None]"]
"""``resolve(user_id, team_id, *, user_team_id, channel_id)``: the app's principal for a Slack user
(``{"id": ..., **claims}``), or None. ``team_id`` is the workspace that received the request (the app's
install), ``user_team_id`` the sender's own workspace (another one in a Slack Connect channel; else the same),
``channel_id`` where they wrote or clicked. A resolver takes whichever of the keywords it names (all of them with
``**kwargs``): one written as ``resolve(user_id, team_id)`` is called with those two only."""

RESOLVER_KEYWORDS = ("user_team_id", "channel_id")

EVENT_TYPES = ("message", "app_mention", "reaction_added")


class SlackEnv(EnvModel):
    """The gateway's Slack variables (an empty value: the default)."""

    signing_secret: str | None = var(
        "SLACK_SIGNING_SECRET",
        None,
        "the app's signing secret: turns the Slack routes on; never logged",
        expected="Slack's signing secret",
        secret=True,
        default_doc="none (routes off)",
    )
    agent: str = var(
        "JUNE_SLACK_AGENT",
        "",
        "the agent Slack talks to",
        expected="one of the gateway's agents",
        default_doc="required with it",
    )
    respond_to: Annotated[tuple[str, ...], comma_list] = var(
        "JUNE_SLACK_RESPOND_TO",
        ("message", "app_mention"),
        "event types that start a turn",
        expected=f"some of {', '.join(EVENT_TYPES)}, comma-separated",
    )
    replace_in_flight: bool = var(
        "JUNE_SLACK_REPLACE_IN_FLIGHT",
        False,
        "a new message in a thread cancels the thread's running turn (never a parked approval)",
        expected="1 or 0",
    )
    resolve_identity: str | None = var(
        "JUNE_SLACK_RESOLVE_IDENTITY",
        None,
        "module:function(user_id, team_id, *, "
        'user_team_id, channel_id) returning a principal {"id": ..., claims} or None',
        expected="module:function",
        default_doc="none",
    )
    resolve_timeout_s: float = var(
        "JUNE_SLACK_RESOLVE_TIMEOUT_S",
        1.0,
        "the resolver's time; past it the turn is anonymous (it still runs)",
        expected="a number of seconds, more than 0",
    )


@dataclass(frozen=True)
class SlackGatewaySettings:
    signing_secret: str = field(repr=False)
    agent: str
    respond_to: tuple[str, ...] = ("message", "app_mention")
    replace_in_flight: bool = False
    resolve_identity: ResolveIdentity | None = field(default=None, compare=False)
    resolve_timeout_s: float = 1.0
    dedupe_ttl_s: int = 86_400
    """How long an event's turn id is remembered, so a retried delivery is not sent again."""
    resolver_keywords: frozenset[str] = field(init=False, default=frozenset(), repr=False, compare=False)
    """Which of :data:`RESOLVER_KEYWORDS` ``resolve_identity`` takes (read from its signature once, here)."""

    def __post_init__(self) -> None:
        if not self.signing_secret.strip():
            raise ConfigError("SLACK_SIGNING_SECRET is empty")
        unknown = sorted(set(self.respond_to) - set(EVENT_TYPES))
        if unknown or not self.respond_to:
            raise ConfigError(f"JUNE_SLACK_RESPOND_TO: {unknown or 'nothing'} (known: {', '.join(EVENT_TYPES)})")
        if self.resolve_timeout_s <= 0:
            raise ConfigError("JUNE_SLACK_RESOLVE_TIMEOUT_S must be positive")
        if self.resolve_identity is not None:
            object.__setattr__(self, "resolver_keywords", _keywords_of(self.resolve_identity))

    def resolver_arguments(self, user_team_id: str | None, channel_id: str | None) -> dict[str, str | None]:
        """The keyword arguments the identity resolver is called with: those of its signature only."""
        given = {"user_team_id": user_team_id, "channel_id": channel_id}
        return {k: v for k, v in given.items() if k in self.resolver_keywords}


def _keywords_of(hook: ResolveIdentity) -> frozenset[str]:
    """The :data:`RESOLVER_KEYWORDS` ``hook`` names (all with ``**kwargs``); a ConfigError if it cannot be called
    as ``hook(user_id, team_id, ...)``."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin or C function without a signature: called the old way
        return frozenset()
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        takes = frozenset(RESOLVER_KEYWORDS)
    else:
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        takes = frozenset(p.name for p in params if p.name in RESOLVER_KEYWORDS and p.kind in kinds)
    try:
        signature.bind("U0", "T0", **dict.fromkeys(takes, "x"))
    except TypeError as exc:
        raise ConfigError(
            f"JUNE_SLACK_RESOLVE_IDENTITY: {getattr(hook, '__name__', hook)!r} cannot be called as "
            f"resolve(user_id, team_id, *, {', '.join(RESOLVER_KEYWORDS)}): {exc}"
        ) from None
    return takes


def _load(path: str) -> ResolveIdentity:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"JUNE_SLACK_RESOLVE_IDENTITY={path!r} must look like 'package.module:function'")
    try:
        hook: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"JUNE_SLACK_RESOLVE_IDENTITY: cannot load {path!r}: {exc}") from exc
    if not callable(hook):
        raise ConfigError(f"JUNE_SLACK_RESOLVE_IDENTITY: {path!r} is not a function")
    return hook  # type: ignore[no-any-return]


def _check_reachable(agent: str, built: Any) -> None:
    """A ConfigError unless the agent's turns can be answered in Slack: a Slack turn carries a thread as its target,
    and a worker rejects a target its agent has no ``deliver`` hook for (the person in Slack would see nothing)."""
    deliver = getattr(built, "deliver", None)
    fix = "give it deliver=Channels([SlackChannel.from_env()]) (docs/slack.md)"
    if deliver is None:
        raise ConfigError(f"JUNE_SLACK_AGENT={agent!r}: agent {agent} has no deliver hook, so nothing could answer "
                          f"in Slack; {fix}")  # fmt: skip
    if isinstance(deliver, Channels) and "slack" not in deliver.channels:
        raise ConfigError(f"JUNE_SLACK_AGENT={agent!r}: agent {agent} is reached through {sorted(deliver.channels)}, "
                          f"not slack; {fix}")  # fmt: skip


def slack_from_env(
    env: Mapping[str, str], agents: tuple[str, ...], built: Mapping[str, Any] | None = None
) -> SlackGatewaySettings | None:
    """The Slack settings when ``SLACK_SIGNING_SECRET`` is set; None (no Slack routes) otherwise.

    ``built``: the agents by name, when the gateway built them (``JUNE_AGENTS``): the Slack agent must then have a
    deliver hook that reaches Slack. Named only (``JUNE_GATEWAY_AGENTS``), the gateway has no agent to check.
    """
    e = SlackEnv.load(env)
    if not e.signing_secret:
        return None
    agent = e.agent.strip()
    if agent not in agents:
        raise ConfigError(f"JUNE_SLACK_AGENT={agent!r} must name one of the gateway's agents {list(agents)}")
    if built is not None:
        _check_reachable(agent, built[agent])
    hook = (e.resolve_identity or "").strip()
    return SlackGatewaySettings(
        signing_secret=e.signing_secret,
        agent=agent,
        respond_to=e.respond_to,
        replace_in_flight=e.replace_in_flight,
        resolve_identity=_load(hook) if hook else None,
        resolve_timeout_s=e.resolve_timeout_s,
    )
