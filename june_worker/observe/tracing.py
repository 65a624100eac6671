"""OpenTelemetry traces, with the API package only: spans go wherever the application's SDK sends them.

Without an SDK configured (``opentelemetry.trace.set_tracer_provider``), every span here is the
API's no-op span and costs a few microseconds. With one, a turn's life reads as one trace:

    june.start_turn (producer)  ->  june.turn (worker, one per run)  ->  chat <model> | execute_tool <name>

The producer puts the W3C ``traceparent`` (and ``tracestate``) of its span in the Celery
message's headers; the worker reads them off the task's request and keeps them with the turn
(``TurnPayload.trace``), so the run of a turn is a child of the span that sent it even when
another process's drain loop runs it, a sweeper re-sends it, or it resumes after a park.

The rule a reader must not break: **no message text, prompt, tool argument or result, and no
exception message in an attribute**: only ids, names, counts and types.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from .. import __version__

__all__ = ["TRACE_HEADERS", "consumed", "context_of", "current_carrier", "from_request", "message_header", "tracer"]

TRACE_HEADERS = ("traceparent", "tracestate")
"""The message headers that carry a trace (W3C Trace Context)."""


def tracer() -> trace.Tracer:
    return trace.get_tracer("june_worker", __version__)


def current_carrier() -> dict[str, str] | None:
    """The current span's context as W3C headers; None when there is no sampled span (nothing to carry)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    kept = {k: v for k, v in carrier.items() if k in TRACE_HEADERS}
    return kept or None


def message_header(request: Any, name: str) -> Any:
    """Header ``name`` of a Celery task's message (``task.request``): Celery sets a sender's custom headers as the
    request's attributes, or leaves them in its ``headers``; None if the sender put none."""
    value = getattr(request, name, None)
    headers = getattr(request, "headers", None)
    if value is None and isinstance(headers, Mapping):
        value = headers.get(name)
    return value


def from_request(request: Any) -> dict[str, str] | None:
    """The trace headers of a Celery task's message (``task.request``), if the sender put any there."""
    found: dict[str, str] = {}
    for name in TRACE_HEADERS:
        value = message_header(request, name)
        if isinstance(value, str) and 0 < len(value) <= 512:
            found[name] = value
    return found or None


def context_of(carrier: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context a carrier names, or None for none."""
    if not carrier:
        return None
    return propagate.extract(dict(carrier))


@contextlib.contextmanager
def consumed(carrier: Mapping[str, str] | None) -> Iterator[None]:
    """Make the sender's span current while a task handles its message (its own spans become children)."""
    ctx = context_of(carrier)
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)
