"""A producer's settings: the checks its constructor makes, and what :meth:`JuneProducer.from_env` reads.

The variables are the workers' own (``JUNE_REDIS_URL``, ``CELERY_BROKER_URL``...), with the workers'
defaults, so a producer configured like the workers talks to them. The environment is read here, once,
and nowhere else in ``producers`` (a Celery app of a producer reads nothing from it: :mod:`._apps`).

The rule a reader must not break: **a setting that is wrong is a** :class:`~.errors.ProducerConfigError`
**naming it**, raised before anything connects or is sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from june_wire.keys import check_prefix
from june_wire.redis_url import is_cluster_url, parse_cluster_url

from ._apps import QUEUE_TYPES
from .errors import ProducerConfigError

__all__ = ["DEFAULT_REDIS_URL", "VARIABLES", "check_settings", "settings_from_env"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

VARIABLES = (
    "JUNE_REDIS_URL",
    "CELERY_BROKER_URL",
    "CELERY_RESULT_BACKEND",
    "JUNE_QUEUE",
    "JUNE_CONTROL_QUEUE",
    "JUNE_KEY_PREFIX",
    "JUNE_BROKER_QUEUE_TYPE",
    "JUNE_PUBLISH_TIMEOUT_S",
    "JUNE_PUBLISH_RETRIES",
    "JUNE_DATABASE_URL",
)
"""Every variable :func:`settings_from_env` reads."""


def check_settings(
    *,
    redis_url: str,
    broker_url: str | None,
    result_backend: str | None,
    queue: str,
    control_queue: str,
    key_prefix: str,
    broker_queue_type: str,
    publish_timeout_s: float,
    publish_retries: int,
    database_url: str | None,
    durable: bool,
) -> None:
    """Refuse settings a producer cannot work with; each error names the setting and what was expected."""
    for name, value in (("queue", queue), ("control_queue", control_queue)):
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise ProducerConfigError(f"invalid {name} {value!r}: expected a non-empty queue name without spaces")
    try:
        check_prefix(key_prefix)
    except ValueError as exc:
        raise ProducerConfigError(str(exc)) from None
    for name, url in (("redis_url", redis_url), ("broker_url", broker_url), ("result_backend", result_backend)):
        if url is not None and (not isinstance(url, str) or "://" not in url):
            raise ProducerConfigError(f"invalid {name}: expected a URL such as redis://host:6379/0")
    if broker_queue_type not in QUEUE_TYPES:
        raise ProducerConfigError(f"invalid broker_queue_type {broker_queue_type!r}: expected one of {QUEUE_TYPES}")
    if not publish_timeout_s > 0 or not isinstance(publish_retries, int) or publish_retries < 0:
        raise ProducerConfigError(
            f"invalid publish_timeout_s={publish_timeout_s!r} / publish_retries={publish_retries!r}: "
            "expected a positive number of seconds and a count of 0 or more"
        )
    for name, url in (("broker_url", broker_url or redis_url), ("result_backend", result_backend or redis_url)):
        if is_cluster_url(url):
            raise ProducerConfigError(
                f"{name} is a Redis Cluster: a cluster holds june's events only; give {name} a single Redis "
                "(redis://) or, for the broker, RabbitMQ (amqp://)"
            )
    if is_cluster_url(redis_url):
        try:
            parse_cluster_url(redis_url)
        except ValueError as exc:
            raise ProducerConfigError(f"invalid redis_url: {exc}") from None
    if durable and not database_url:
        raise ProducerConfigError("durable=True needs database_url (JUNE_DATABASE_URL): june's Postgres")


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ProducerConfigError(f"{name}={raw!r} is not a number") from None


def settings_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """The constructor's arguments that :data:`VARIABLES` set in ``env``, with the workers' defaults."""
    for name in VARIABLES:
        if name in env and not env[name].strip():
            raise ProducerConfigError(f"{name} is set but empty; unset it for the default or give a value")
    redis_url = env.get("JUNE_REDIS_URL", DEFAULT_REDIS_URL)
    return {
        "redis_url": redis_url,
        "broker_url": env.get("CELERY_BROKER_URL", redis_url),
        "result_backend": env.get("CELERY_RESULT_BACKEND", redis_url),
        "queue": env.get("JUNE_QUEUE", "june"),
        "control_queue": env.get("JUNE_CONTROL_QUEUE", "june.control"),
        "key_prefix": env.get("JUNE_KEY_PREFIX", "june"),
        "broker_queue_type": env.get("JUNE_BROKER_QUEUE_TYPE", "quorum").strip().lower(),
        "publish_timeout_s": _number(env, "JUNE_PUBLISH_TIMEOUT_S", 5.0),
        "publish_retries": int(_number(env, "JUNE_PUBLISH_RETRIES", 3)),
        "database_url": env.get("JUNE_DATABASE_URL"),
    }
