"""Worker settings, read from the environment once, where a process starts.

==========================  =======================================  ==========================
variable                    meaning                                  default
==========================  =======================================  ==========================
JUNE_DATABASE_URL           Postgres, the source of truth            postgresql://postgres@127.0.0.1:5432/june
JUNE_REDIS_URL              Redis for event streams (and results);   redis://127.0.0.1:6379/0
                            redis+cluster://host:port[,host:port]
                            for a Redis Cluster (events only: set
                            the broker and the result backend)
CELERY_BROKER_URL           the broker: redis:// or amqp://          JUNE_REDIS_URL
CELERY_RESULT_BACKEND       where task summaries go                  JUNE_REDIS_URL
JUNE_AGENTS                 agents to serve, ``module:attr`` list    june_worker.demo:build_agent
JUNE_QUEUE                  queue of turn messages                   june
JUNE_CONTROL_QUEUE          queue of resume / cancel / reset         june.control
JUNE_LEASE_S                session lease length                     30
JUNE_ALIVE_S                a worker process counts as dead after    3
                            this long without a heartbeat; its
                            leases are then taken over at once
JUNE_SWEEP_S                sweeper period (beat)                    10
JUNE_DELIVERY_ATTEMPTS      tries of a target's deliver hook before  5
                            the worker gives the delivery up
JUNE_MAX_ATTEMPTS           starts of one turn (a killed process, a  5
                            transient fault that outlasts a step's
                            retries) before it ends ``failed`` as
                            poison and the session moves on
JUNE_OUTBOX_RETENTION_S     relayed outbox events older than this    86400 (a day)
                            are deleted, but for those from a
                            session's oldest unfinished or
                            delivery-due turn on (a follower catches
                            up on the stream; /log and relays read
                            the outbox)
JUNE_TURN_RETENTION_S       ended turns' rows, and their step        604800 (a week)
                            records, are deleted this long after
                            they ended (a message redelivered later
                            would run again)
JUNE_ARCHIVE_RETENTION_S    archived generations (resets) are        2592000 (30 days)
                            deleted this long after the reset
JUNE_STREAM_TTL_S           a session's Redis stream and marker      604800 (a week)
                            expire once it was quiet this long, and
                            its firehose marker field is dropped
                            (0: never)
JUNE_PRUNE_BATCH            rows deleted per statement and sweep     1000
JUNE_KEY_PREFIX             prefix of every Redis key                june
JUNE_STREAM_MAXLEN          approximate cap of a session stream      10000
JUNE_STREAM_MAX_AGE_S       drop stream entries older than this      0 (keep)
JUNE_FIREHOSE_PARTITIONS    partitions of the all-sessions stream    1 (16 on a Redis Cluster)
JUNE_TASK_EVENTS            Celery task events (Flower); 0 = off     1
JUNE_BROKER_QUEUE_TYPE      RabbitMQ queue type: quorum or classic   quorum
JUNE_BROKER_VISIBILITY_S    Redis broker: a delivered message not    3 x JUNE_LEASE_S
                            acknowledged for this long is handed
                            out again (Celery's default is 1 h)
JUNE_PUBLISH_TIMEOUT_S      connect / send / confirm timeout of a    5
                            publish to the broker
JUNE_PUBLISH_RETRIES        publish retries before it raises         3
JUNE_DB_POOL_SIZE           with many turns per process: Postgres    3
                            connections its turns' statements
                            share (the heartbeat has one more)
JUNE_REDIS_CONNECTIONS      with many turns per process: Redis       8
                            connections their publishes share
JUNE_LOOP_BLOCKED_S         with many turns per process: something   0.5
                            holding their event loop this long is
                            logged, naming the tool
JUNE_ISOLATION_QUEUE        with many turns per process: where a     <JUNE_QUEUE>.isolated under
                            turn whose process died under it goes    ``june worker --turns-per-
                            on, alone (a solo worker consumes it);   process`` (its supervisor
                            unset: it runs on in a shared process    starts that worker); unset
JUNE_TRANSCRIPT_CACHE       transcripts a worker process keeps in    256
                            memory, so that a turn reads only the
                            messages it does not hold (0: off)
JUNE_TRANSCRIPT_CACHE_      messages held in all; a longer           50000
MESSAGES                    transcript is read whole every turn
JUNE_TRANSCRIPT_CACHE_      about how much they take in all (the     32000000
BYTES                       characters of their JSON); a larger
                            transcript is read whole every turn
JUNE_METRICS_PORT           the worker's main process serves         0 (off)
                            Prometheus metrics on this port
                            (``/metrics``; docs/operations.md)
JUNE_METRICS_HOST           the address it listens on                127.0.0.1
PROMETHEUS_MULTIPROC_DIR    where the pool's processes keep their    a new temporary directory
                            metrics (one per worker; emptied at
                            the worker's start)
JUNE_LOG_FORMAT             ``text`` or ``json`` (one JSON object    text
                            per line; turn transitions with their
                            fields)
==========================  =======================================  ==========================

Crash injection for tests is honoured only when ``JUNE_ENABLE_TEST_HOOKS=1``:
``JUNE_CRASH_AT=<point>[@<step>]`` kills the worker process (SIGKILL) at that point.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..events._redis_url import is_cluster_url, parse_cluster_url
from ..events.keys import default_firehose_partitions

__all__ = ["WorkerSettings"]

_VISIBILITY_LEASES = 3
"""The Redis broker's visibility timeout, in lease lengths: long enough that a running turn's message is
rarely handed out twice (the copy is harmless), short enough that an unrecorded message of a dead worker
comes back within a few leases, not Celery's hour."""


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if value < 0:
        raise ConfigError(f"{name} must not be negative")
    return value


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
        env = os.environ if env is None else env
        redis_url = env.get("JUNE_REDIS_URL", cls.redis_url)
        agents = tuple(a.strip() for a in env.get("JUNE_AGENTS", ",".join(cls.agents)).split(",") if a.strip())
        if not agents:
            raise ConfigError("JUNE_AGENTS names no agent; give module:attribute paths, comma-separated")
        lease_s = _float(env, "JUNE_LEASE_S", cls.lease_s)
        if lease_s < 0.5:
            raise ConfigError("JUNE_LEASE_S must be at least 0.5 seconds")
        broker_url = env.get("CELERY_BROKER_URL", redis_url)
        result_backend = env.get("CELERY_RESULT_BACKEND", redis_url)
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
        partitions_default = default_firehose_partitions(cluster=is_cluster_url(redis_url))
        queue_type = env.get("JUNE_BROKER_QUEUE_TYPE", cls.broker_queue_type).strip().lower()
        if queue_type not in ("quorum", "classic"):
            raise ConfigError(f"JUNE_BROKER_QUEUE_TYPE={queue_type!r}: expected quorum or classic")
        metrics_port = int(_float(env, "JUNE_METRICS_PORT", cls.metrics_port))
        if metrics_port > 65535:
            raise ConfigError(f"JUNE_METRICS_PORT={metrics_port}: expected a TCP port (1-65535), or 0 for off")
        log_format = env.get("JUNE_LOG_FORMAT", cls.log_format).strip().lower()
        if log_format not in ("text", "json"):
            raise ConfigError(f"JUNE_LOG_FORMAT={log_format!r}: expected text or json")
        return cls(
            database_url=env.get("JUNE_DATABASE_URL", cls.database_url),
            redis_url=redis_url,
            broker_url=broker_url,
            result_backend=result_backend,
            agents=agents,
            queue=env.get("JUNE_QUEUE", cls.queue),
            control_queue=env.get("JUNE_CONTROL_QUEUE", cls.control_queue),
            lease_s=lease_s,
            alive_s=max(_float(env, "JUNE_ALIVE_S", cls.alive_s), 0.5),
            sweep_s=_float(env, "JUNE_SWEEP_S", cls.sweep_s),
            delivery_attempts=max(int(_float(env, "JUNE_DELIVERY_ATTEMPTS", cls.delivery_attempts)), 1),
            max_attempts=max(int(_float(env, "JUNE_MAX_ATTEMPTS", cls.max_attempts)), 1),
            outbox_retention_s=_float(env, "JUNE_OUTBOX_RETENTION_S", cls.outbox_retention_s),
            turn_retention_s=_float(env, "JUNE_TURN_RETENTION_S", cls.turn_retention_s),
            archive_retention_s=_float(env, "JUNE_ARCHIVE_RETENTION_S", cls.archive_retention_s),
            stream_ttl_s=_float(env, "JUNE_STREAM_TTL_S", cls.stream_ttl_s),
            prune_batch=max(int(_float(env, "JUNE_PRUNE_BATCH", cls.prune_batch)), 1),
            key_prefix=env.get("JUNE_KEY_PREFIX", cls.key_prefix),
            stream_maxlen=int(_float(env, "JUNE_STREAM_MAXLEN", cls.stream_maxlen)),
            stream_max_age_s=_float(env, "JUNE_STREAM_MAX_AGE_S", cls.stream_max_age_s),
            firehose_partitions=int(_float(env, "JUNE_FIREHOSE_PARTITIONS", partitions_default)),
            broker_queue_type=queue_type,
            broker_visibility_s=max(_float(env, "JUNE_BROKER_VISIBILITY_S", _VISIBILITY_LEASES * lease_s), 1.0),
            publish_timeout_s=max(_float(env, "JUNE_PUBLISH_TIMEOUT_S", cls.publish_timeout_s), 0.1),
            publish_retries=int(_float(env, "JUNE_PUBLISH_RETRIES", cls.publish_retries)),
            db_pool_size=max(int(_float(env, "JUNE_DB_POOL_SIZE", cls.db_pool_size)), 1),
            redis_connections=max(int(_float(env, "JUNE_REDIS_CONNECTIONS", cls.redis_connections)), 2),
            loop_blocked_s=max(_float(env, "JUNE_LOOP_BLOCKED_S", cls.loop_blocked_s), 0.01),
            isolation_queue=env.get("JUNE_ISOLATION_QUEUE") or None,
            transcript_cache=int(_float(env, "JUNE_TRANSCRIPT_CACHE", cls.transcript_cache)),
            transcript_cache_messages=int(_float(env, "JUNE_TRANSCRIPT_CACHE_MESSAGES", cls.transcript_cache_messages)),
            transcript_cache_bytes=int(_float(env, "JUNE_TRANSCRIPT_CACHE_BYTES", cls.transcript_cache_bytes)),
            metrics_port=metrics_port,
            metrics_host=env.get("JUNE_METRICS_HOST", cls.metrics_host),
            metrics_dir=env.get("PROMETHEUS_MULTIPROC_DIR") or None,
            log_format=log_format,
            crash_at=env.get("JUNE_CRASH_AT") if env.get("JUNE_ENABLE_TEST_HOOKS") == "1" else None,
        )
