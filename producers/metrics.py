"""A producer's own counters, for the service that embeds it: sends that had to be tried again, and turns that
went to Postgres only (``durable=True`` with the broker down) for the sweeper to send.

* ``june_producer_publish_retries_total{messages}``: tries to reach the broker that failed while sending a
  message, each followed by another (``messages``: ``turn`` for ``june.turn`` / ``june.proactive``,
  ``control`` for ``june.resume`` / ``june.cancel`` / ``june.reset``); a send whose tries all fail is a
  :class:`~producers.errors.BrokerUnavailable` (``JUNE_PUBLISH_RETRIES`` more tries after the first).
* ``june_producer_durable_fallbacks_total{task}``: turns recorded in Postgres whose message the broker did not
  take; the call returned their id anyway, and the sweeper sends them.

They are prometheus_client counters in its default registry (``prometheus_client.REGISTRY``: what the service's
own ``/metrics`` or ``start_http_server`` serves; the gateway serves them too), made when the process makes its
first producer, every label value at 0: a dashboard shows 0 before anything went wrong, not "no data". Without
prometheus_client installed (it is not a dependency of ``producers``) nothing is counted.

The rule a reader must not break: **counting never fails a send**; every method here swallows its own errors.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["MESSAGES", "TURN_TASKS", "ProducerMetrics", "producer_metrics"]

MESSAGES = ("turn", "control")
"""The ``messages`` label: which of a producer's two Celery apps was sending."""
TURN_TASKS = ("june.turn", "june.proactive")
"""The ``task`` label of a durable fallback: the tasks that send turns."""

log = logging.getLogger("producers")


class ProducerMetrics:
    """The process's producer counters; every method is a no-op when prometheus_client is not installed."""

    def __init__(self, registry: Any = None) -> None:
        self.retries: Any = None
        self.fallbacks: Any = None
        try:
            from prometheus_client import REGISTRY, Counter
        except ImportError:
            return
        registry = REGISTRY if registry is None else registry
        self.retries = Counter(
            "june_producer_publish_retries",
            "Failed tries to reach the broker while sending a message, each followed by another try.",
            ["messages"],
            registry=registry,
        )
        self.fallbacks = Counter(
            "june_producer_durable_fallbacks",
            "Turns recorded in Postgres (durable=True) whose message the broker did not take: the sweeper sends them.",
            ["task"],
            registry=registry,
        )
        for messages in MESSAGES:  # exposed at 0 from the start
            self.retries.labels(messages)
        for task in TURN_TASKS:
            self.fallbacks.labels(task)

    def collectors(self) -> list[Any]:
        """The counters, for a registry of one's own to serve as well (the gateway's)."""
        return [c for c in (self.retries, self.fallbacks) if c is not None]

    def publish_retried(self, messages: str) -> None:
        if self.retries is None:
            return
        try:
            self.retries.labels(messages if messages in MESSAGES else "turn").inc()
        except Exception:  # noqa: BLE001 - counting never fails a send
            log.debug("could not count a publish retry", exc_info=True)

    def durable_fallback(self, task: str) -> None:
        if self.fallbacks is None:
            return
        try:
            self.fallbacks.labels(task if task in TURN_TASKS else "june.turn").inc()
        except Exception:  # noqa: BLE001 - counting never fails a send
            log.debug("could not count a durable fallback", exc_info=True)


_LOCK = threading.Lock()
_METRICS: ProducerMetrics | None = None


def producer_metrics() -> ProducerMetrics:
    """This process's producer counters, made (at 0) on first use."""
    global _METRICS
    with _LOCK:
        if _METRICS is None:
            _METRICS = ProducerMetrics()
        return _METRICS
