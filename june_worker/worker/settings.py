"""Worker settings, read from the environment once, where a process starts.

Every variable is declared once, in :class:`WorkerEnv` (its type, default, meaning and what a value must look
like); the table in docs/settings.md is generated from it (``python -m june_worker.settings_doc``). A bad value
is one :class:`~june_worker.errors.ConfigError` line naming the variable; ``june worker`` / ``june beat`` /
``june migrate`` print it and exit 2.

Crash injection for tests is honoured only when ``JUNE_ENABLE_TEST_HOOKS=1``:
``JUNE_CRASH_AT=<point>[@<step>]`` kills the worker process (SIGKILL) at that point.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BeforeValidator

from june_wire.keys import default_firehose_partitions
from june_wire.redis_url import is_cluster_url, parse_cluster_url

from ..envsettings import EnvModel, comma_list, var
from ..errors import ConfigError

__all__ = ["WorkerEnv", "WorkerSettings"]

_VISIBILITY_LEASES = 3
"""The Redis broker's visibility timeout, in lease lengths: long enough that a running turn's message is
rarely handed out twice (the copy is harmless), short enough that an unrecorded message of a dead worker
comes back within a few leases, not Celery's hour."""

_SECONDS = "a number of seconds, at least 0"
_COUNT = "a whole number, at least 0"


def _lower(value: object) -> object:
    return value.strip().lower() if isinstance(value, str) else value


_Lower = BeforeValidator(_lower)


class WorkerEnv(EnvModel):
    """The variables of a worker (and of ``june beat`` and ``june migrate``, which read the same)."""

    database_url: str = var(
        "JUNE_DATABASE_URL",
        "postgresql://postgres@127.0.0.1:5432/june",
        "Postgres, the source of truth",
        expected="a postgresql:// URL",
    )
    redis_url: str = var(
        "JUNE_REDIS_URL",
        "redis://127.0.0.1:6379/0",
        "Redis for event streams (and results); redis+cluster://host:port[,host:port] for a Redis "
        "Cluster (events only: then set the broker and the result backend)",
        expected="a redis://, rediss:// or redis+cluster:// URL",
    )
    broker_url: str | None = var(
        "CELERY_BROKER_URL",
        None,
        "the broker: redis:// or amqp://",
        expected="a redis:// or amqp:// URL",
        default_doc="JUNE_REDIS_URL",
    )
    result_backend: str | None = var(
        "CELERY_RESULT_BACKEND",
        None,
        "where task summaries go",
        expected="a redis:// URL",
        default_doc="JUNE_REDIS_URL",
    )
    agents: Annotated[tuple[str, ...], comma_list] = var(
        "JUNE_AGENTS",
        ("june_worker.demo:build_agent",),
        "agents to serve: an Agent, a list, or a function returning them, as module:attribute, comma-separated",
        expected="module:attribute paths, comma-separated",
        default_doc="june_worker.demo:build_agent",
        keep_empty=True,
        min_length=1,
    )
    queue: str = var("JUNE_QUEUE", "june", "queue of turn messages", expected="a queue name")
    control_queue: str = var(
        "JUNE_CONTROL_QUEUE", "june.control", "queue of resume / cancel / reset / sweep", expected="a queue name"
    )
    lease_s: float = var(
        "JUNE_LEASE_S", 30.0, "session lease length", expected="a number of seconds, at least 0.5", ge=0.5
    )
    alive_s: float = var(
        "JUNE_ALIVE_S",
        3.0,
        "a worker process counts as dead after this long without a heartbeat; "
        "its leases are then taken over at once (at least 0.5)",
        expected=_SECONDS,
        ge=0,
    )
    sweep_s: float = var("JUNE_SWEEP_S", 10.0, "sweeper period (beat)", expected=_SECONDS, ge=0)
    start_retry_s: float = var(
        "JUNE_START_RETRY_S",
        2.0,
        "a worker whose Postgres or broker does not answer at "
        "start says so and tries again this often (0: it exits instead)",
        expected=_SECONDS,
        ge=0,
    )
    delivery_attempts: int = var(
        "JUNE_DELIVERY_ATTEMPTS",
        5,
        "tries of a target's deliver hook before the worker gives the delivery up",
        expected="a whole number, at least 0 (0 counts as 1)",
        ge=0,
    )
    max_attempts: int = var(
        "JUNE_MAX_ATTEMPTS",
        5,
        "starts of one turn (a killed process, a transient fault that "
        "outlasts a step's retries) before it ends failed as poison and the session moves on",
        expected="a whole number, at least 0 (0 counts as 1)",
        ge=0,
    )
    outbox_retention_s: float = var(
        "JUNE_OUTBOX_RETENTION_S",
        86400.0,
        "relayed outbox events older than this are "
        "deleted, but for those from a session's oldest unfinished or delivery-due turn "
        "on (a follower catches up on the stream; /log and relays read the outbox)",
        expected=_SECONDS,
        default_doc="86400 (a day)",
        ge=0,
    )
    turn_retention_s: float = var(
        "JUNE_TURN_RETENTION_S",
        604800.0,
        "ended turns' rows, and their step records, "
        "are deleted this long after they ended (a message redelivered later would run "
        "again)",
        expected=_SECONDS,
        default_doc="604800 (a week)",
        ge=0,
    )
    archive_retention_s: float = var(
        "JUNE_ARCHIVE_RETENTION_S",
        2592000.0,
        "archived generations (resets) are deleted this long after the reset",
        expected=_SECONDS,
        default_doc="2592000 (30 days)",
        ge=0,
    )
    stream_ttl_s: float = var(
        "JUNE_STREAM_TTL_S",
        604800.0,
        "a session's Redis stream and marker expire once it "
        "was quiet this long, and its firehose marker field is dropped (0: never)",
        expected=_SECONDS,
        default_doc="604800 (a week)",
        ge=0,
    )
    prune_batch: int = var("JUNE_PRUNE_BATCH", 1000, "rows deleted per statement and sweep", expected=_COUNT, ge=0)
    key_prefix: str = var("JUNE_KEY_PREFIX", "june", "prefix of every Redis key", expected="a key prefix")
    stream_maxlen: int = var("JUNE_STREAM_MAXLEN", 10_000, "approximate cap of a session stream", expected=_COUNT, ge=0)
    stream_max_age_s: float = var(
        "JUNE_STREAM_MAX_AGE_S", 0.0, "drop stream entries older than this (0: keep)", expected=_SECONDS, ge=0
    )
    firehose_partitions: int | None = var(
        "JUNE_FIREHOSE_PARTITIONS",
        None,
        "partitions of the all-sessions stream",
        expected="a whole number, at least 1",
        default_doc="1 (16 on a Redis Cluster)",
        ge=1,
    )
    task_events: bool = var("JUNE_TASK_EVENTS", True, "Celery task events (Flower); 0 = off", expected="1 or 0")
    broker_queue_type: Annotated[Literal["quorum", "classic"], _Lower] = var(
        "JUNE_BROKER_QUEUE_TYPE", "quorum", "RabbitMQ queue type", expected="quorum or classic"
    )
    broker_visibility_s: float | None = var(
        "JUNE_BROKER_VISIBILITY_S",
        None,
        "Redis broker: a delivered message not "
        "acknowledged for this long is handed out again (Celery's default is "
        "1 h; at least 1)",
        expected=_SECONDS,
        default_doc="3 x JUNE_LEASE_S",
        ge=0,
    )
    publish_timeout_s: float = var(
        "JUNE_PUBLISH_TIMEOUT_S",
        5.0,
        "connect / send / confirm timeout of a publish to the broker (at least 0.1)",
        expected=_SECONDS,
        ge=0,
    )
    publish_retries: int = var("JUNE_PUBLISH_RETRIES", 3, "publish retries before it raises", expected=_COUNT, ge=0)
    db_pool_size: int = var(
        "JUNE_DB_POOL_SIZE",
        3,
        "with many turns per process: Postgres connections its turns' statements share (the heartbeat has one more)",
        expected="a whole number, at least 0 (0 counts as 1)",
        ge=0,
    )
    redis_connections: int = var(
        "JUNE_REDIS_CONNECTIONS",
        8,
        "with many turns per process: Redis connections their publishes share (at least 2)",
        expected=_COUNT,
        ge=0,
    )
    loop_blocked_s: float = var(
        "JUNE_LOOP_BLOCKED_S",
        0.5,
        "with many turns per process: something holding their event loop this long is logged, naming the tool",
        expected=_SECONDS,
        ge=0,
    )
    isolation_queue: str | None = var(
        "JUNE_ISOLATION_QUEUE",
        None,
        "with many turns per process: where a turn whose "
        "process died under it goes on, alone (a solo worker consumes it); unset: it "
        "runs on in a shared process",
        expected="a queue name",
        default_doc="<queue>.isolated under june worker --turns-per-process, for its first -Q queue (else "
        "JUNE_QUEUE; its supervisor starts that worker); else unset",
    )
    transcript_cache: int = var(
        "JUNE_TRANSCRIPT_CACHE",
        256,
        "transcripts a worker process keeps in memory, so "
        "that a turn reads only the messages it does not hold (0: off)",
        expected=_COUNT,
        ge=0,
    )
    transcript_cache_messages: int = var(
        "JUNE_TRANSCRIPT_CACHE_MESSAGES",
        50_000,
        "messages held in all; a longer transcript is read whole every turn",
        expected=_COUNT,
        ge=0,
    )
    transcript_cache_bytes: int = var(
        "JUNE_TRANSCRIPT_CACHE_BYTES",
        32_000_000,
        "about how much they take in all (the characters of their JSON); a larger transcript is read whole every turn",
        expected=_COUNT,
        ge=0,
    )
    metrics_port: int = var(
        "JUNE_METRICS_PORT",
        0,
        "the worker's main process serves Prometheus metrics on this port (/metrics; docs/operations.md)",
        expected="a TCP port (1-65535), or 0 for off",
        default_doc="0 (off)",
        ge=0,
        le=65535,
    )
    metrics_host: str = var("JUNE_METRICS_HOST", "127.0.0.1", "the address it listens on", expected="an address")
    metrics_dir: str | None = var(
        "PROMETHEUS_MULTIPROC_DIR",
        None,
        "where the pool's processes keep their metrics (one per worker; emptied at the worker's start)",
        expected="a directory",
        default_doc="a new temporary directory",
    )
    log_format: Annotated[Literal["text", "json"], _Lower] = var(
        "JUNE_LOG_FORMAT",
        "text",
        "text, or json: one JSON object per line (turn transitions with their fields)",
        expected="text or json",
    )
    example_schedule: bool = var(
        "JUNE_EXAMPLE_SCHEDULE",
        False,
        "1: beat also runs an example proactive turn (celeryconfig.py; schedules: README)",
        expected="1 or 0",
    )
    example_schedule_every_s: float = var(
        "JUNE_EXAMPLE_SCHEDULE_EVERY_S", 86400.0, "its period", expected="a number of seconds, more than 0", gt=0
    )
    example_agent: str = var("JUNE_EXAMPLE_AGENT", "ops", "its agent", expected="an agent name")
    example_session: str = var("JUNE_EXAMPLE_SESSION", "daily-digest", "its session", expected="a session name")
    example_target: str | None = var(
        "JUNE_EXAMPLE_TARGET",
        None,
        'where its answer is delivered, as JSON, e.g. {"channel": "slack", "channel_id": "C024BE91L"}',
        expected="a JSON object",
    )
    enable_test_hooks: bool = var(
        "JUNE_ENABLE_TEST_HOOKS", False, "tests only: 1 honours JUNE_CRASH_AT", expected="1 or 0"
    )
    crash_at: str | None = var(
        "JUNE_CRASH_AT",
        None,
        "tests only: <point>[@<step>] kills the worker process there",
        expected="<point>[@<step>]",
    )


@dataclass(frozen=True)
class WorkerSettings:
    database_url: str = "postgresql://postgres@127.0.0.1:5432/june"
    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str = "redis://127.0.0.1:6379/0"
    result_backend: str = "redis://127.0.0.1:6379/0"
    agents: tuple[str, ...] = ("june_worker.demo:build_agent",)
    queue: str = "june"
    control_queue: str = "june.control"
    lease_s: float = 30.0
    alive_s: float = 3.0
    sweep_s: float = 10.0
    start_retry_s: float = 2.0
    delivery_attempts: int = 5
    max_attempts: int = 5
    outbox_retention_s: float = 86400.0
    turn_retention_s: float = 604800.0
    archive_retention_s: float = 2592000.0
    stream_ttl_s: float = 604800.0
    prune_batch: int = 1000
    key_prefix: str = "june"
    stream_maxlen: int = 10_000
    stream_max_age_s: float = 0.0
    firehose_partitions: int = 1
    task_events: bool = True
    broker_queue_type: str = "quorum"
    broker_visibility_s: float = 90.0
    publish_timeout_s: float = 5.0
    publish_retries: int = 3
    db_pool_size: int = 3
    redis_connections: int = 8
    loop_blocked_s: float = 0.5
    isolation_queue: str | None = None
    transcript_cache: int = 256
    transcript_cache_messages: int = 50_000
    transcript_cache_bytes: int = 32_000_000
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    metrics_dir: str | None = None
    log_format: str = "text"
    crash_at: str | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerSettings:
        """Settings from the environment (``os.environ`` by default); a bad value is a one-line :class:`ConfigError`."""
        e = WorkerEnv.load(env)
        redis_url = e.redis_url
        broker_url = e.broker_url or redis_url
        result_backend = e.result_backend or redis_url
        for name, url in (("CELERY_BROKER_URL", broker_url), ("CELERY_RESULT_BACKEND", result_backend)):
            if is_cluster_url(url):
                raise ConfigError(
                    f"{name} is a Redis Cluster ({url.split('://', 1)[0]}://): a cluster holds june's events only; "
                    f"set {name} to a single Redis (redis://) or, for the broker, RabbitMQ (amqp://)"
                )
        if is_cluster_url(redis_url):
            try:
                parse_cluster_url(redis_url)
            except ValueError as exc:
                raise ConfigError(f"JUNE_REDIS_URL: {exc}") from None
        partitions = e.firehose_partitions or default_firehose_partitions(cluster=is_cluster_url(redis_url))
        visibility = e.broker_visibility_s if e.broker_visibility_s is not None else _VISIBILITY_LEASES * e.lease_s
        return cls(
            database_url=e.database_url,
            redis_url=redis_url,
            broker_url=broker_url,
            result_backend=result_backend,
            agents=e.agents,
            queue=e.queue,
            control_queue=e.control_queue,
            lease_s=e.lease_s,
            alive_s=max(e.alive_s, 0.5),
            sweep_s=e.sweep_s,
            start_retry_s=e.start_retry_s,
            delivery_attempts=max(e.delivery_attempts, 1),
            max_attempts=max(e.max_attempts, 1),
            outbox_retention_s=e.outbox_retention_s,
            turn_retention_s=e.turn_retention_s,
            archive_retention_s=e.archive_retention_s,
            stream_ttl_s=e.stream_ttl_s,
            prune_batch=max(e.prune_batch, 1),
            key_prefix=e.key_prefix,
            stream_maxlen=e.stream_maxlen,
            stream_max_age_s=e.stream_max_age_s,
            firehose_partitions=partitions,
            task_events=e.task_events,
            broker_queue_type=e.broker_queue_type,
            broker_visibility_s=max(visibility, 1.0),
            publish_timeout_s=max(e.publish_timeout_s, 0.1),
            publish_retries=e.publish_retries,
            db_pool_size=max(e.db_pool_size, 1),
            redis_connections=max(e.redis_connections, 2),
            loop_blocked_s=max(e.loop_blocked_s, 0.01),
            isolation_queue=e.isolation_queue,
            transcript_cache=e.transcript_cache,
            transcript_cache_messages=e.transcript_cache_messages,
            transcript_cache_bytes=e.transcript_cache_bytes,
            metrics_port=e.metrics_port,
            metrics_host=e.metrics_host,
            metrics_dir=e.metrics_dir,
            log_format=e.log_format,
            crash_at=e.crash_at if e.enable_test_hooks else None,
        )
