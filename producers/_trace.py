"""The producer's span for a turn it sends, and the trace headers its message carries (OpenTelemetry API only).

``june.start_turn`` (and ``june.proactive``) is a PRODUCER span around recording and sending the
turn; its W3C ``traceparent`` / ``tracestate`` go in the Celery message's headers, and the worker
makes the turn's run a child of it. Without an OpenTelemetry SDK configured the span is the
API's no-op span and no header is sent.

The rule a reader must not break: **ids and names only in attributes**: never the text, the
event, a target or an exception's message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

__all__ = ["TRACE_HEADERS", "sending"]

TRACE_HEADERS = ("traceparent", "tracestate")
_tracer = trace.get_tracer("june_producers")


@contextlib.contextmanager
def sending(name: str, *, agent: str, session: str, turn_id: str, queue: str) -> Iterator[dict[str, str] | None]:
    """A ``name`` span while a turn is recorded and sent; yields the headers that carry it (None: no span)."""
    attributes = {
        "june.agent": agent,
        "june.session": session,
        "june.turn_id": turn_id,
        "messaging.operation.type": "send",
        "messaging.destination.name": queue,
    }
    with _tracer.start_as_current_span(
        name, kind=SpanKind.PRODUCER, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        headers = {k: v for k, v in carrier.items() if k in TRACE_HEADERS} or None
        try:
            yield headers
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            span.set_attribute("error.type", type(exc).__name__)
            raise
