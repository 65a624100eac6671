"""The producer's Celery apps: JSON only, no task modules, and exactly the broker and result backend given.

Celery lets the process's environment override an app's own settings: ``CELERY_BROKER_URL``,
``CELERY_BROKER_READ_URL`` and ``CELERY_BROKER_WRITE_URL`` win over the broker the app was made with,
``CELERY_RESULT_BACKEND`` over its result backend (and gives one to an app made without), ``CELERY_LOADER``
picks its loader and ``CELERY_CONFIG_MODULE`` imports a module of settings into it (``celery.app.utils.Settings``,
``Celery._get_default_loader``, ``BaseLoader.read_configuration``). A service that talks to two june
deployments, or runs where a worker's variables are set, would then send turns where no worker listens.

The rule a reader must not break: **a producer's app reads nothing from the environment**; what it talks
to is what :class:`~producers.JuneProducer` was given (``from_env`` reads the variables once, explicitly).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import Celery
from celery.loaders.app import AppLoader
from kombu.entity import Queue
from redis.backoff import NoBackoff
from redis.retry import Retry

from .metrics import producer_metrics

__all__ = ["QUEUE_TYPES", "is_amqp", "is_redis", "producer_app"]

QUEUE_TYPES = ("quorum", "classic")


def is_amqp(url: str) -> bool:
    return url.split("://", 1)[0].lower() in ("amqp", "amqps", "pyamqp")


def is_redis(url: str) -> bool:
    """A Redis broker URL, as the worker's broker settings tell them apart (``june_worker/worker/broker.py``)."""
    return url.split("://", 1)[0].lower() in ("redis", "rediss", "sentinel", "unix")


def _sentinel_bounds(timeout_s: float) -> dict[str, Any]:
    """kombu's ``sentinel_kwargs``: how long one question to a sentinel may take, asked once (worker: broker.py)."""
    return {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "retry": Retry(NoBackoff(), 0)}


class _OwnSettingsLoader(AppLoader):  # type: ignore[misc]  # celery is untyped
    """Celery's loader for apps, minus the settings module ``CELERY_CONFIG_MODULE`` would import."""

    def read_configuration(self, env: str = "CELERY_CONFIG_MODULE") -> None:
        return None


class _PinnedCelery(Celery):  # type: ignore[misc]  # celery is untyped
    """A Celery app that connects to ``broker_url`` and ``result_backend`` whatever the environment says."""

    def __init__(self, main: str, *, broker_url: str, result_backend: str | None) -> None:
        super().__init__(
            main,
            broker=broker_url,
            backend=result_backend,
            loader=_OwnSettingsLoader,  # given, so CELERY_LOADER is not read
            set_as_current=False,
            fixups=[],
        )
        self._broker_url = broker_url
        # Looked up before conf.result_backend (Celery._get_backend), which CELERY_RESULT_BACKEND overrides;
        # "disabled": no backend at all, not the environment's.
        self.backend_cls = result_backend or "disabled"

    # Each of these falls back on conf.broker_{read,write}_url, which the environment overrides.
    def connection_for_write(self, url: str | None = None, **kwargs: Any) -> Any:
        return super().connection_for_write(url or self._broker_url, **kwargs)

    def connection_for_read(self, url: str | None = None, **kwargs: Any) -> Any:
        return super().connection_for_read(url or self._broker_url, **kwargs)

    def connection(self, hostname: str | None = None, **kwargs: Any) -> Any:
        return super().connection(hostname or self._broker_url, **kwargs)


def producer_app(
    main: str,
    *,
    broker_url: str,
    result_backend: str | None,
    queues: tuple[str, ...],
    default_queue: str,
    transport_options: Mapping[str, Any],
    queue_type: str,
    publish_timeout_s: float,
    publish_retries: int,
    connect_timeout_s: float,
) -> Any:
    """A Celery app that sends to ``broker_url`` (and reads results from ``result_backend``, if any).

    Each failed try to reach the broker while sending, before the next, is counted in
    ``june_producer_publish_retries_total`` (:mod:`.metrics`), under ``control`` for the app JuneProducer names
    ``...-control``, else ``turn``."""
    app = _PinnedCelery(main, broker_url=broker_url, result_backend=result_backend)
    metrics = producer_metrics()
    messages = "control" if main.endswith("-control") else "turn"

    def retried(exc: BaseException, interval: float) -> None:  # kombu's errback: before each next try
        metrics.publish_retried(messages)

    options = dict(transport_options)
    queue_arguments = None
    if is_redis(broker_url):  # Redis behind Sentinel too
        options.setdefault("socket_connect_timeout", publish_timeout_s)
        options.setdefault("socket_timeout", publish_timeout_s)  # a broker that never answers must not hang
        if broker_url.lower().startswith("sentinel"):
            # redis-py retries each question to a sentinel 3 times with a backoff of its own (9 s for a silent
            # one): one try each, the publish retry policy being the one retry policy, as on the worker
            options.setdefault("sentinel_kwargs", _sentinel_bounds(publish_timeout_s))
    elif is_amqp(broker_url):
        options.setdefault("confirm_publish", True)  # a send returns once the broker has the message
        queue_arguments = {"x-queue-type": queue_type}
    app.conf.update(
        # The queues as the workers declare them (june_worker/worker/broker.py): RabbitMQ refuses a
        # declaration of an existing queue with other arguments, and drops a message sent to no queue.
        task_queues=[
            Queue(name, routing_key=name, durable=True, queue_arguments=queue_arguments)  # type: ignore[no-untyped-call]
            for name in queues
        ],
        task_default_delivery_mode="persistent",
        task_publish_retry=True,
        task_publish_retry_policy={
            "max_retries": publish_retries,
            "interval_start": 0,
            "interval_step": 0.2,
            "interval_max": 1.0,
            "errback": retried,
        },
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_default_queue=default_queue,
        # Flower shows a task from the moment it is sent; the event carries argsrepr, not the payload.
        task_send_sent_event=True,
        broker_transport_options=options,
        broker_connection_timeout=publish_timeout_s,
        redis_socket_connect_timeout=connect_timeout_s,
        # Celery's default is 20 reconnects a second apart: a caller would wait 20 s to learn
        # that the result backend is down. Fail within about a second instead.
        result_backend_transport_options={
            "retry_policy": {"max_retries": 3, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
        },
    )
    return app
