"""Gateway settings, read from the environment once, where the gateway process starts.

The Redis, broker, queue and key-prefix variables are the worker's own (both sides must
agree); the ``JUNE_GATEWAY_*`` ones are the gateway's.

Every variable is declared once, in :class:`GatewayEnv` (and the Slack ones in
:class:`~.slack_settings.SlackEnv`); docs/settings.md is generated from them
(``python -m june_worker.settings_doc``).

The rule a reader must not break: **settings are built here and passed down**; nothing else in
the gateway reads the environment.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator

from june_wire.keys import default_firehose_partitions
from june_wire.redis_url import is_cluster_url

from ..channels.base import receiving_only
from ..envsettings import EnvModel, comma_list, var
from ..errors import ConfigError
from .access import AuthorizeSession
from .auth import TokenTable, load_tokens
from .slack_settings import SlackGatewaySettings, slack_from_env

__all__ = ["AGENT_NAME_RE", "GatewayEnv", "GatewaySettings", "agent_names", "load_hook", "token_loader"]

AGENT_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_DEFAULT_AGENTS = "june_worker.demo:build_agent"


def _lower(value: object) -> object:
    return value.strip().lower() if isinstance(value, str) else value


_SECONDS = "a number of seconds"


class GatewayEnv(EnvModel):
    """The gateway's variables (the Slack ones: :class:`~.slack_settings.SlackEnv`). Set but empty is an error."""

    empty = "error"

    database_url: str = var(
        "JUNE_DATABASE_URL",
        "postgresql://postgres@127.0.0.1:5432/june",
        "Postgres: pending input, turn and session reads",
        expected="a postgresql:// URL",
    )
    redis_url: str = var(
        "JUNE_REDIS_URL",
        "redis://127.0.0.1:6379/0",
        "Redis holding the event streams (a Redis Cluster: redis+cluster://host:port,...)",
        expected="a redis:// or redis+cluster:// URL",
    )
    broker_url: str | None = var(
        "CELERY_BROKER_URL", None, "the broker", expected="a redis:// or amqp:// URL", default_doc="JUNE_REDIS_URL"
    )
    result_backend: str | None = var(
        "CELERY_RESULT_BACKEND",
        None,
        "where control tasks' answers come back",
        expected="a redis:// URL",
        default_doc="JUNE_REDIS_URL",
    )
    queue: str = var("JUNE_QUEUE", "june", "queue of june.turn", expected="a queue name")
    control_queue: str = var(
        "JUNE_CONTROL_QUEUE", "june.control", "queue of resume / cancel / reset", expected="a queue name"
    )
    key_prefix: str = var("JUNE_KEY_PREFIX", "june", "prefix of every Redis key", expected="a key prefix")
    firehose_partitions: int | None = var(
        "JUNE_FIREHOSE_PARTITIONS",
        None,
        "partitions of the all-sessions stream (the console's live feed reads them)",
        expected="a whole number, at least 1",
        default_doc="1 (16 on a Redis Cluster, as on the workers)",
        ge=1,
    )
    broker_queue_type: Annotated[Literal["quorum", "classic"], BeforeValidator(_lower)] = var(
        "JUNE_BROKER_QUEUE_TYPE",
        "quorum",
        "RabbitMQ queue type, as the workers declare it",
        expected="quorum or classic",
    )
    publish_timeout_s: float = var(
        "JUNE_PUBLISH_TIMEOUT_S", 5.0, "one try to send a task (connect, write, confirm)", expected=_SECONDS, ge=0.1
    )
    publish_retries: int = var(
        "JUNE_PUBLISH_RETRIES", 3, "more tries before a 503", expected="a whole number, at least 0", ge=0
    )
    agents: Annotated[tuple[str, ...], comma_list] = var(
        "JUNE_AGENTS",
        ("june_worker.demo:build_agent",),
        "agents the workers serve (module:attribute)",
        expected="module:attribute paths, comma-separated",
        min_length=1,
    )
    gateway_agents: Annotated[tuple[str, ...], comma_list] | None = var(
        "JUNE_GATEWAY_AGENTS",
        None,
        "agent names, comma-separated (skips importing JUNE_AGENTS)",
        expected="agent names, comma-separated",
        default_doc="from JUNE_AGENTS",
    )
    tokens: str | None = var(
        "JUNE_GATEWAY_TOKENS",
        None,
        "bearer tokens as JSON (see june_worker/gateway/auth.py)",
        expected="a JSON object of tokens",
        secret=True,
        default_doc="none",
    )
    tokens_file: str | None = var(
        "JUNE_GATEWAY_TOKENS_FILE",
        None,
        "bearer tokens in a JSON or TOML file (read again on SIGHUP)",
        expected="a file path",
        default_doc="none",
    )
    insecure_dev: bool = var(
        "JUNE_GATEWAY_INSECURE_DEV",
        False,
        "1: requests without a token are let in (local development only; logged loudly)",
        expected="1 or 0",
    )
    dev_principal: str = var("JUNE_GATEWAY_DEV_PRINCIPAL", "dev", "who such a request is", expected="a principal id")
    host: str = var("JUNE_GATEWAY_HOST", "127.0.0.1", "where june gateway listens", expected="an address")
    port: int = var("JUNE_GATEWAY_PORT", 8080, "its port", expected="a TCP port (1-65535)", ge=1, le=65535)
    heartbeat_s: float = var(
        "JUNE_GATEWAY_HEARTBEAT_S", 15.0, "SSE comment sent after this long without events", expected=_SECONDS, ge=0.05
    )
    max_stream_s: float = var(
        "JUNE_GATEWAY_MAX_STREAM_S",
        3600.0,
        "an SSE response ends after this long (the client reconnects with Last-Event-ID)",
        expected=_SECONDS,
        ge=0.1,
    )
    wait_s: float = var("JUNE_GATEWAY_WAIT_S", 300.0, "longest ?wait=true before a 504", expected=_SECONDS, ge=0.1)
    control_timeout_s: float = var(
        "JUNE_GATEWAY_CONTROL_TIMEOUT_S", 30.0, "longest wait for resume / cancel / reset", expected=_SECONDS, ge=0.1
    )
    redis_connections: int = var(
        "JUNE_GATEWAY_REDIS_CONNECTIONS",
        1000,
        "Redis connections for SSE readers (one per open stream while it waits)",
        expected="a whole number, at least 2",
        ge=2,
    )
    access_log: bool = var("JUNE_GATEWAY_ACCESS_LOG", True, "0 turns uvicorn's access log off", expected="1 or 0")
    max_body_bytes: int = var(
        "JUNE_GATEWAY_MAX_BODY_BYTES",
        2 * 1024 * 1024,
        "a larger request body is a 413",
        expected="a whole number of bytes, at least 1024",
        default_doc="2097152 (2 MiB)",
        ge=1024,
    )
    authorize_session: str | None = var(
        "JUNE_GATEWAY_AUTHORIZE_SESSION",
        None,
        "the app's authorize_session hook (module:attribute; see june_worker/gateway/access.py)",
        expected="module:function",
        default_doc="none",
    )
    metrics_public: bool = var(
        "JUNE_GATEWAY_METRICS_PUBLIC",
        False,
        "1: /metrics needs no token (a private network only); else an operator's token",
        expected="1 or 0",
    )


def load_hook(path: str, variable: str) -> AuthorizeSession:
    """The callable at ``module:attribute``; a :class:`ConfigError` naming ``variable`` when there is none."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{variable}={path!r} must look like 'package.module:function'")
    try:
        hook: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{variable}: cannot load {path!r}: {exc}") from exc
    if not callable(hook):
        raise ConfigError(f"{variable}: {path!r} is a {type(hook).__name__}, not a function")
    return hook  # type: ignore[no-any-return]


def agent_names(paths: tuple[str, ...]) -> tuple[str, ...]:
    """The names of the agents at ``module:attribute`` paths (an Agent, a list, or a callable returning either)."""
    return tuple(built_agents(paths))


def built_agents(paths: tuple[str, ...]) -> dict[str, Any]:
    """The agents at ``module:attribute`` paths, by name, built as a process that only receives builds them
    (:func:`~june_worker.channels.base.receiving_only`: their channels need no bot token here)."""
    agents: dict[str, Any] = {}
    for path in paths:
        module_name, _, attr = path.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"agent path {path!r} must look like 'package.module:attribute'")
        with receiving_only():
            try:
                obj: Any = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise ConfigError(f"cannot load agent {path!r}: {exc}") from exc
            if callable(obj) and not hasattr(obj, "name"):
                obj = obj()
        for agent in obj if isinstance(obj, (list, tuple)) else [obj]:
            name = getattr(agent, "name", None)
            if not isinstance(name, str):
                raise ConfigError(f"{path!r} gave {type(agent).__name__}, not an Agent")
            agents.setdefault(name, agent)
    return agents


@dataclass(frozen=True)
class GatewaySettings:
    """Everything the gateway needs, fixed for the life of the process."""

    agents: tuple[str, ...]
    """The agent names the workers serve; any other name is a 404."""
    tokens: TokenTable = field(default_factory=TokenTable)
    insecure_dev: bool = False
    dev_principal: str = "dev"
    database_url: str = "postgresql://postgres@127.0.0.1:5432/june"
    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str | None = None
    result_backend: str | None = None
    queue: str = "june"
    control_queue: str = "june.control"
    key_prefix: str = "june"
    firehose_partitions: int = 0
    """0: the workers' default for ``redis_url`` (16 on a Redis Cluster, 1 on one Redis)."""
    broker_queue_type: str = "quorum"
    publish_timeout_s: float = 5.0
    publish_retries: int = 3
    host: str = "127.0.0.1"
    port: int = 8080
    heartbeat_s: float = 15.0
    max_stream_s: float = 3600.0
    wait_s: float = 300.0
    control_timeout_s: float = 30.0
    redis_connections: int = 1000
    access_log: bool = True
    stream_batch: int = 100
    """Entries one XREAD takes: what a stream may hold in memory beyond the socket's buffers."""
    event_source: str = "http"
    """The ``source`` of the inbound event the gateway builds for a turn (keys per-source policies)."""
    metrics_public: bool = False
    """``/metrics`` without a token; by default it needs an operator's."""
    max_body_bytes: int = 2 * 1024 * 1024
    """A request body larger than this is refused with 413 before it is read whole."""
    authorize_session: AuthorizeSession | None = field(default=None, compare=False)
    """The app's ``authorize_session(principal, agent, session, action)`` hook (see :mod:`.access`)."""
    slack: SlackGatewaySettings | None = field(default=None, compare=False)
    """Slack's Events API and interactivity routes, when SLACK_SIGNING_SECRET is set (:mod:`.slack`)."""

    def __post_init__(self) -> None:
        if self.firehose_partitions < 0:
            raise ConfigError(f"JUNE_FIREHOSE_PARTITIONS must be at least 1, not {self.firehose_partitions}")
        if self.firehose_partitions == 0:
            cluster = is_cluster_url(self.redis_url)
            object.__setattr__(self, "firehose_partitions", default_firehose_partitions(cluster=cluster))
        for name in self.agents:
            if not AGENT_NAME_RE.match(name):
                raise ConfigError(f"invalid agent name {name!r}: expected 1-128 characters of A-Z a-z 0-9 _ . -")
        if not self.tokens and not self.insecure_dev:
            raise ConfigError(
                "the gateway has no bearer tokens: set JUNE_GATEWAY_TOKENS or JUNE_GATEWAY_TOKENS_FILE "
                "(or JUNE_GATEWAY_INSECURE_DEV=1 for local development only)"
            )
        if not self.dev_principal.strip():
            raise ConfigError("JUNE_GATEWAY_DEV_PRINCIPAL must not be empty")
        if not 0 < self.port < 65536:
            raise ConfigError(f"JUNE_GATEWAY_PORT must be a TCP port, not {self.port}")
        if self.heartbeat_s <= 0 or self.max_stream_s <= 0 or self.wait_s <= 0 or self.control_timeout_s <= 0:
            raise ConfigError("gateway durations must be positive")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"JUNE_GATEWAY_MAX_BODY_BYTES must be at least 1024, not {self.max_body_bytes}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GatewaySettings:
        """Settings from the environment (``os.environ`` by default); a bad value is a :class:`ConfigError`."""
        env = os.environ if env is None else env
        e = GatewayEnv.load(env)
        built: dict[str, Any] | None = None  # the agents themselves, when built here (not named only)
        if e.gateway_agents:
            agents = e.gateway_agents
        else:
            built = built_agents(e.agents)
            agents = tuple(built)
        for name, url in (("CELERY_BROKER_URL", e.broker_url), ("CELERY_RESULT_BACKEND", e.result_backend)):
            if is_cluster_url(url or e.redis_url):
                raise ConfigError(
                    f"{name} is a Redis Cluster: a cluster holds june's events only; set {name} to a single Redis "
                    "(redis://) or, for the broker, RabbitMQ (amqp://)"
                )
        return cls(
            agents=agents,
            tokens=load_tokens(e.tokens, e.tokens_file),
            insecure_dev=e.insecure_dev,
            dev_principal=e.dev_principal,
            database_url=e.database_url,
            redis_url=e.redis_url,
            broker_url=e.broker_url or e.redis_url,
            result_backend=e.result_backend or e.redis_url,
            queue=e.queue,
            control_queue=e.control_queue,
            key_prefix=e.key_prefix,
            firehose_partitions=e.firehose_partitions or 0,
            broker_queue_type=e.broker_queue_type,
            publish_timeout_s=e.publish_timeout_s,
            publish_retries=e.publish_retries,
            host=e.host,
            port=e.port,
            heartbeat_s=e.heartbeat_s,
            max_stream_s=e.max_stream_s,
            wait_s=e.wait_s,
            control_timeout_s=e.control_timeout_s,
            redis_connections=e.redis_connections,
            access_log=e.access_log,
            metrics_public=e.metrics_public,
            max_body_bytes=e.max_body_bytes,
            authorize_session=load_hook(e.authorize_session, "JUNE_GATEWAY_AUTHORIZE_SESSION")
            if e.authorize_session
            else None,
            slack=slack_from_env(env, agents, built),
        )

    def __repr__(self) -> str:
        # Tokens and URL passwords stay out of reprs, which end up in logs and tracebacks.
        return (
            f"GatewaySettings(agents={self.agents!r}, tokens={len(self.tokens)}, insecure_dev={self.insecure_dev}, "
            f"queue={self.queue!r}, control_queue={self.control_queue!r}, key_prefix={self.key_prefix!r}, "
            f"host={self.host!r}, port={self.port})"
        )


def token_loader(env: Mapping[str, str] | None = None) -> Callable[[], TokenTable]:
    """How the token table is read again on SIGHUP: ``JUNE_GATEWAY_TOKENS`` as the process got it (its
    environment does not change), ``JUNE_GATEWAY_TOKENS_FILE`` from the file as it is then."""
    env = os.environ if env is None else env
    tokens_json, tokens_file = env.get("JUNE_GATEWAY_TOKENS"), env.get("JUNE_GATEWAY_TOKENS_FILE")
    return lambda: load_tokens(tokens_json, tokens_file)
