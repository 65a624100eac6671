"""The ``metered`` agents, served by a worker whose processes record their spans (OpenTelemetry SDK).

Importing :func:`ALL` (the worker loads it through ``JUNE_AGENTS``, in each pool process) installs a
tracer provider whose exporter keeps finished spans in memory and appends each one, as a line of
JSON, to the file named by ``JUNE_IT_SPANS``: the in-memory exporter of a process the test cannot
reach into, made readable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from june_worker import Agent

from . import observe_agents

__all__ = ["ALL", "span_record"]


def span_record(span: ReadableSpan) -> dict[str, object]:
    """A finished span as plain JSON: names, ids (hex), kind, status, attributes."""
    ctx = span.get_span_context()
    assert ctx is not None
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "kind": span.kind.name,
        "status": span.status.status_code.name,
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()},
        "pid": os.getpid(),
    }


class _FileBackedExporter(InMemorySpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(os.environ["JUNE_IT_SPANS"], "a") as f:
            for span in spans:
                f.write(json.dumps(span_record(span)) + "\n")
        return super().export(spans)


def ALL() -> list[Agent]:  # noqa: N802 - the JUNE_AGENTS path names it
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_FileBackedExporter()))
    trace.set_tracer_provider(provider)
    return observe_agents.ALL()
