"""The gateway's ``/metrics``: its HTTP traffic and open streams, and the state gauges (Postgres, the broker).

The gateway records into a registry of its own (one per app; not prometheus_client's global one):

* ``june_gateway_requests_total{method, route, status}`` and
  ``june_gateway_request_duration_seconds{method, route}`` (until the response starts: an SSE
  stream counts its time to the first byte), by route *template* (``/v1/agents/{agent}/...``),
  never the path that was asked for;
* ``june_gateway_sse_streams_open`` and ``june_gateway_sse_events_sent_total``, from the
  backend's stream counters;
* the state gauges of :class:`june_worker.observe.state.StateCollector`;
* the counters of the gateway's producer (:mod:`producers.metrics`: publish retries, durable fallbacks).

Every route's request counter and histogram exist from the start, at 0, under the route's own success
status (``200``, ``202``): a panel shows 0 before the first request, not "no data"
(:func:`june_worker.observe.metrics.at_zero`).

``/metrics`` needs an operator's bearer token (Prometheus sends it with ``authorization:
credentials``); with ``JUNE_GATEWAY_METRICS_PUBLIC=1`` it needs none (serve it on a private
network only).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producers.metrics import producer_metrics

from ..observe.metrics import at_zero
from ..observe.state import StateCollector, broker_depths
from .backend import GatewayBackend
from .deps import Authenticated
from .settings import GatewaySettings

__all__ = ["GatewayMetrics", "install_metrics"]

_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Streams:
    """The backend's SSE counters, read at scrape time."""

    def __init__(self, backend: GatewayBackend) -> None:
        self.backend = backend

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        stats = self.backend.stats
        yield GaugeMetricFamily("june_gateway_sse_streams_open", "SSE responses open now.", value=stats.open)
        yield CounterMetricFamily(
            "june_gateway_sse_events_sent", "Events sent on SSE responses.", value=stats.events_sent
        )


class GatewayMetrics:
    """The app's registry and its request metrics."""

    def __init__(self, settings: GatewaySettings, backend: GatewayBackend) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "june_gateway_requests", "HTTP requests answered, by route template and status.",
            ["method", "route", "status"], registry=self.registry,
        )  # fmt: skip
        self.seconds = Histogram(
            "june_gateway_request_duration_seconds", "Time until the response started, by route template.",
            ["method", "route"], buckets=_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_Streams(backend))
        queues = (settings.queue, settings.control_queue)
        broker = settings.broker_url or settings.redis_url
        self.state = StateCollector(
            settings.database_url, agents=settings.agents, depths=lambda: broker_depths(broker, queues)
        )
        self.registry.register(self.state)
        for collector in producer_metrics().collectors():
            self.registry.register(collector)

    def start_at_zero(self, app: FastAPI) -> None:
        """Every route's request series, at 0 (call once its routes are all added): those of the OpenAPI schema
        under their first success status, and the pages (``/``, ``/console``, ``/metrics``) under 200."""
        routes = [
            (
                method.upper(),
                path,
                next((code for code in operation.get("responses", {}) if code.startswith("2")), "200"),
            )
            for path, operations in app.openapi().get("paths", {}).items()
            for method, operation in operations.items()
        ]
        routes += [
            (method, r.path, str(r.status_code or 200))
            for r in app.routes
            if isinstance(r, APIRoute) and not r.include_in_schema
            for method in sorted(r.methods or ())
        ]
        at_zero(self.requests, routes)
        at_zero(self.seconds, [(method, path) for method, path, _ in routes])


class _RequestMetrics:
    """ASGI middleware: count each request by its route template once its response starts."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        seen = False

        async def watched(message: Message) -> None:
            nonlocal seen
            if message["type"] == "http.response.start" and not seen:
                seen = True
                route = scope.get("route")
                template = getattr(route, "path", None) or "other"
                method = scope.get("method", "GET")
                self.metrics.requests.labels(method, template, str(message["status"])).inc()
                self.metrics.seconds.labels(method, template).observe(time.perf_counter() - t0)
            await send(message)

        await self.app(scope, receive, watched)


def install_metrics(app: FastAPI, settings: GatewaySettings, backend: GatewayBackend) -> GatewayMetrics:
    """Add the request middleware and the ``/metrics`` route to ``app``."""
    metrics = GatewayMetrics(settings, backend)
    app.add_middleware(_RequestMetrics, metrics=metrics)

    async def exposition() -> Response:
        body = await backend.blocking(lambda: generate_latest(metrics.registry))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    if settings.metrics_public:

        @app.get("/metrics", include_in_schema=False)
        async def public_scrape() -> Response:
            return await exposition()

    else:

        @app.get("/metrics", include_in_schema=False)
        async def scrape(principal: Authenticated) -> Response:
            if not principal.operator:
                raise HTTPException(status_code=403, detail="/metrics needs an operator token (role: operator)")
            return await exposition()

    return metrics
