"""Gateway settings, read from the environment once, where the gateway process starts.

The Redis, broker, queue and key-prefix variables are the worker's own (both sides must
agree); the ``JUNE_GATEWAY_*`` ones are the gateway's.

=============================  ==============================================  ===========================
variable                       meaning                                         default
=============================  ==============================================  ===========================
JUNE_DATABASE_URL              Postgres: pending input, turn and session reads  postgresql://postgres@127.0.0.1:5432/june
JUNE_REDIS_URL                 Redis holding the event streams (a Redis         redis://127.0.0.1:6379/0
                               Cluster: redis+cluster://host:port,...)
CELERY_BROKER_URL              the broker                                       JUNE_REDIS_URL
CELERY_RESULT_BACKEND          where control tasks' answers come back           JUNE_REDIS_URL
JUNE_QUEUE                     queue of ``june.turn``                           june
JUNE_CONTROL_QUEUE             queue of resume / cancel / reset                 june.control
JUNE_KEY_PREFIX                prefix of every Redis key                        june
JUNE_FIREHOSE_PARTITIONS       partitions of the all-sessions stream (the       1 (16 on a Redis Cluster,
                               console's live feed reads them)                  as on the workers)
JUNE_BROKER_QUEUE_TYPE         RabbitMQ queue type, as the workers declare it   quorum
JUNE_PUBLISH_TIMEOUT_S         one try to send a task (connect, write, confirm) 5
JUNE_PUBLISH_RETRIES           more tries before a 503                          3
JUNE_AGENTS                    agents the workers serve (``module:attr``)       june_worker.demo:build_agent
JUNE_GATEWAY_AGENTS            agent names, comma-separated (skips importing    (from JUNE_AGENTS)
                               JUNE_AGENTS)
JUNE_GATEWAY_TOKENS            bearer tokens as JSON (see :mod:`.auth`)         none
JUNE_GATEWAY_TOKENS_FILE       bearer tokens in a JSON or TOML file             none
JUNE_GATEWAY_INSECURE_DEV      ``1``: requests without a token are let in       0
                               (local development only; logged loudly)
JUNE_GATEWAY_DEV_PRINCIPAL     who such a request is                            dev
JUNE_GATEWAY_HOST / _PORT      where ``june gateway`` listens                   127.0.0.1 / 8080
JUNE_GATEWAY_HEARTBEAT_S       SSE comment sent after this long without events  15
JUNE_GATEWAY_MAX_STREAM_S      an SSE response ends after this long (the        3600
                               client reconnects with Last-Event-ID)
JUNE_GATEWAY_WAIT_S            longest ``?wait=true`` before a 504              300
JUNE_GATEWAY_CONTROL_TIMEOUT_S longest wait for resume / cancel / reset         30
JUNE_GATEWAY_REDIS_CONNECTIONS Redis connections for SSE readers (one per       1000
                               open stream while it waits)
JUNE_GATEWAY_ACCESS_LOG        ``0`` turns uvicorn's access log off             1
JUNE_GATEWAY_MAX_BODY_BYTES    a larger request body is a 413                   2097152 (2 MiB)
JUNE_GATEWAY_AUTHORIZE_SESSION the app's ``authorize_session`` hook              none
                               (``module:attribute``; see :mod:`.access`)
SLACK_SIGNING_SECRET, JUNE_SLACK_*  the Slack routes (see :mod:`.slack_settings`)  off
JUNE_GATEWAY_METRICS_PUBLIC    ``1``: ``/metrics`` needs no token (a private    0
                               network only); else an operator's token
=============================  ==============================================  ===========================

The rule a reader must not break: **settings are built here and passed down**; nothing else in
the gateway reads the environment.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from june_wire.keys import default_firehose_partitions
from june_wire.redis_url import is_cluster_url

from ..channels.base import receiving_only
from ..errors import ConfigError
from .access import AuthorizeSession
from .auth import TokenTable, load_tokens
from .slack_settings import SlackGatewaySettings, slack_from_env

__all__ = ["AGENT_NAME_RE", "GatewaySettings", "agent_names", "load_hook", "token_loader"]

AGENT_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_DEFAULT_AGENTS = "june_worker.demo:build_agent"


def _number(env: Mapping[str, str], name: str, default: float, *, low: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if value < low:
        raise ConfigError(f"{name} must be at least {low:g}, not {raw}")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected 1 or 0")


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
        for name in sorted(n for n in env if n.startswith("JUNE_GATEWAY_") or n in _SHARED):
            if not env[name].strip():
                raise ConfigError(f"{name} is set but empty; unset it for the default or give a value")
        names = env.get("JUNE_GATEWAY_AGENTS", "").strip()
        built: dict[str, Any] | None = None  # the agents themselves, when built here (not named only)
        if names:
            agents = tuple(n.strip() for n in names.split(",") if n.strip())
        else:
            paths = tuple(p.strip() for p in env.get("JUNE_AGENTS", _DEFAULT_AGENTS).split(",") if p.strip())
            built = built_agents(paths)
            agents = tuple(built)
        redis_url = env.get("JUNE_REDIS_URL", cls.redis_url)
        for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
            if is_cluster_url(env.get(name, redis_url)):
                raise ConfigError(
                    f"{name} is a Redis Cluster: a cluster holds june's events only; set {name} to a single Redis "
                    "(redis://) or, for the broker, RabbitMQ (amqp://)"
                )
        hook_path = env.get("JUNE_GATEWAY_AUTHORIZE_SESSION")
        return cls(
            agents=agents,
            tokens=load_tokens(env.get("JUNE_GATEWAY_TOKENS"), env.get("JUNE_GATEWAY_TOKENS_FILE")),
            insecure_dev=_flag(env, "JUNE_GATEWAY_INSECURE_DEV", False),
            dev_principal=env.get("JUNE_GATEWAY_DEV_PRINCIPAL", cls.dev_principal),
            database_url=env.get("JUNE_DATABASE_URL", cls.database_url),
            redis_url=redis_url,
            broker_url=env.get("CELERY_BROKER_URL", redis_url),
            result_backend=env.get("CELERY_RESULT_BACKEND", redis_url),
            queue=env.get("JUNE_QUEUE", cls.queue),
            control_queue=env.get("JUNE_CONTROL_QUEUE", cls.control_queue),
            key_prefix=env.get("JUNE_KEY_PREFIX", cls.key_prefix),
            firehose_partitions=int(_number(env, "JUNE_FIREHOSE_PARTITIONS", cls.firehose_partitions, low=1)),
            broker_queue_type=env.get("JUNE_BROKER_QUEUE_TYPE", cls.broker_queue_type).strip().lower(),
            publish_timeout_s=_number(env, "JUNE_PUBLISH_TIMEOUT_S", cls.publish_timeout_s, low=0.1),
            publish_retries=int(_number(env, "JUNE_PUBLISH_RETRIES", cls.publish_retries, low=0)),
            host=env.get("JUNE_GATEWAY_HOST", cls.host),
            port=int(_number(env, "JUNE_GATEWAY_PORT", cls.port, low=1)),
            heartbeat_s=_number(env, "JUNE_GATEWAY_HEARTBEAT_S", cls.heartbeat_s, low=0.05),
            max_stream_s=_number(env, "JUNE_GATEWAY_MAX_STREAM_S", cls.max_stream_s, low=0.1),
            wait_s=_number(env, "JUNE_GATEWAY_WAIT_S", cls.wait_s, low=0.1),
            control_timeout_s=_number(env, "JUNE_GATEWAY_CONTROL_TIMEOUT_S", cls.control_timeout_s, low=0.1),
            redis_connections=int(_number(env, "JUNE_GATEWAY_REDIS_CONNECTIONS", cls.redis_connections, low=2)),
            access_log=_flag(env, "JUNE_GATEWAY_ACCESS_LOG", True),
            metrics_public=_flag(env, "JUNE_GATEWAY_METRICS_PUBLIC", False),
            max_body_bytes=int(_number(env, "JUNE_GATEWAY_MAX_BODY_BYTES", cls.max_body_bytes, low=1024)),
            authorize_session=load_hook(hook_path, "JUNE_GATEWAY_AUTHORIZE_SESSION") if hook_path else None,
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


_SHARED = frozenset(
    {"JUNE_DATABASE_URL", "JUNE_REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "JUNE_QUEUE",
     "JUNE_CONTROL_QUEUE", "JUNE_KEY_PREFIX", "JUNE_AGENTS", "JUNE_BROKER_QUEUE_TYPE", "JUNE_PUBLISH_TIMEOUT_S",
     "JUNE_PUBLISH_RETRIES", "JUNE_FIREHOSE_PARTITIONS"}
)  # fmt: skip
