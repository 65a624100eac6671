"""What june-worker asks of its Celery broker, per broker: Redis or RabbitMQ (``CELERY_BROKER_URL``).

Both brokers get the same promises from here: a publish that waits a bounded time
(``JUNE_PUBLISH_TIMEOUT_S``) and is retried a bounded number of times (``JUNE_PUBLISH_RETRIES``)
before it raises, persistent messages, and ``acks_late`` (in :mod:`.defaultconfig`) so a
message is only gone once its task ran.

* **RabbitMQ** (``amqp://``): the turn queue and the control queue are declared durable, as
  quorum queues by default (``JUNE_BROKER_QUEUE_TYPE=quorum``; ``classic`` for a broker that
  has none), and every publish waits for the broker's confirm. Celery sees the quorum queues
  and uses per-consumer prefetch (quorum queues refuse a global QoS). A worker that dies
  drops its connection and the broker hands its unacknowledged messages out again at once.
* **Redis** (``redis://``): there is no connection to drop, so kombu keeps a delivered,
  unacknowledged message aside and puts it back after its **visibility timeout**. Celery's
  default is one hour; here it is ``JUNE_BROKER_VISIBILITY_S``, by default three lease lengths
  (90 s), and workers look for such messages every sixth of it. A message whose task runs
  longer than that is handed out a second time; the copy finds its turn recorded and running
  and ends at once (intake is idempotent by turn id). Without persistence (AOF) a Redis
  restart loses what was queued: see ``docker-compose.yml`` and ``durable=True`` producers.
  kombu's set of unacknowledged messages is one per database; june's workers keep theirs
  under ``<JUNE_KEY_PREFIX>:broker:unacked*`` (:func:`~june_wire.keys.broker_unacked_keys`),
  so they never put back another Celery app's messages.

Producers (``producers/``) declare the same queues the same way; a test checks they agree.
"""

from __future__ import annotations

from typing import Any

from kombu.entity import Queue
from redis.backoff import NoBackoff
from redis.retry import Retry

from june_wire.keys import broker_unacked_keys

from ..errors import ConfigError
from .settings import WorkerSettings

__all__ = ["QUEUE_TYPES", "broker_kind", "celery_options", "publish_options", "queues"]

QUEUE_TYPES = ("quorum", "classic")


def broker_kind(url: str) -> str:
    """``"amqp"`` for RabbitMQ URLs, ``"redis"`` for Redis ones, else the URL's scheme."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("amqp", "amqps", "pyamqp"):
        return "amqp"
    if scheme in ("redis", "rediss", "sentinel", "unix"):
        return "redis"
    return scheme


def queues(settings: WorkerSettings) -> list[Queue]:
    """The turn queue and the control queue as the worker declares them (durable; quorum on RabbitMQ)."""
    if settings.broker_queue_type not in QUEUE_TYPES:
        raise ConfigError(f"JUNE_BROKER_QUEUE_TYPE={settings.broker_queue_type!r}: expected one of {QUEUE_TYPES}")
    arguments = {"x-queue-type": settings.broker_queue_type} if broker_kind(settings.broker_url) == "amqp" else None
    return [
        Queue(name, routing_key=name, durable=True, queue_arguments=arguments)  # type: ignore[no-untyped-call]
        for name in (settings.queue, settings.control_queue)
    ]


def restore_every_s(settings: WorkerSettings) -> float:
    """How often a worker on Redis looks for messages whose visibility timeout passed."""
    return max(settings.broker_visibility_s / 6, 0.5)


def celery_options(settings: WorkerSettings) -> dict[str, Any]:
    """Celery settings for the broker in ``settings.broker_url`` (merged into :mod:`.defaultconfig`)."""
    timeout = settings.publish_timeout_s
    kind = broker_kind(settings.broker_url)
    transport: dict[str, Any] = {}
    if kind == "redis":
        transport = {
            "visibility_timeout": settings.broker_visibility_s,
            "unacked_restore_interval": restore_every_s(settings),
            "unacked_restore_throttle": 1,  # every interval scans, not every tenth
            "socket_connect_timeout": timeout,
            "socket_timeout": timeout,  # a broker that accepts but never answers must not hang a publish
            # june's own unacked set: kombu's default is one per database, so a june worker would put back, after
            # its short visibility timeout, what another Celery app's workers took from the same database
            **broker_unacked_keys(settings.key_prefix),
        }
        if settings.broker_url.lower().startswith("sentinel"):
            # redis-py retries each question to a sentinel 3 times with a backoff of its own (9 s for a silent one):
            # one try each, so that the publish retry policy below is the one retry policy
            transport["sentinel_kwargs"] = {
                "socket_timeout": timeout,
                "socket_connect_timeout": timeout,
                "retry": Retry(NoBackoff(), 0),
            }
    elif kind == "amqp":
        transport = {"confirm_publish": True}
    return {
        "task_queues": queues(settings),
        "task_create_missing_queue_type": settings.broker_queue_type if kind == "amqp" else "classic",
        "task_default_delivery_mode": "persistent",
        "broker_transport_options": transport,
        "broker_connection_timeout": timeout,
        "task_publish_retry": True,
        "task_publish_retry_policy": retry_policy(settings.publish_retries),
    }


def retry_policy(retries: int) -> dict[str, float]:
    """kombu's retry policy for a publish: ``retries`` more tries, 0.2 s apart and growing to 1 s."""
    return {"max_retries": retries, "interval_start": 0, "interval_step": 0.2, "interval_max": 1.0}


def publish_options(settings: WorkerSettings) -> dict[str, Any]:
    """Per-publish options for ``send_task``: how long a socket write and a RabbitMQ confirm may take."""
    if broker_kind(settings.broker_url) != "amqp":
        return {}
    return {"timeout": settings.publish_timeout_s, "confirm_timeout": settings.publish_timeout_s}
