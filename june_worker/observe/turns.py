"""The worker's view of a turn run: metrics, spans and transition logs, through the engine's TurnHooks.

:meth:`TurnObserver.run` wraps one run of one turn (the host's ``runner.run()``) in a
``june.turn`` span (a child of the span that sent the turn) and gives the runner a
:class:`TurnWatch`, the engine's :class:`~june_worker.engine.hooks.TurnHooks`: a span per step
(``chat <model>`` with the GenAI semantic conventions' attributes, for a model call and for a
compaction of the transcript, ``june.step.kind`` telling them apart; ``execute_tool <name>``),
step durations, token counts, tool outcomes, and a log line per transition, all read off the
commits the store accepted.

The rule a reader must not break: **observing never fails a turn**. Every hook body is guarded;
a fault of the metrics files or the tracer is logged (once per process) and the turn goes on.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from ..engine.agent import Agent
from ..engine.events import ActionCompleted, InputRequested, TurnEvent, TurnFailed, TurnResult
from ..engine.hooks import StepKind
from ..engine.secrets import scrubbed_logger
from ..engine.store import Commit, SessionRef, TurnRecord
from . import tracing
from .logs import transition
from .metrics import OTHER, Metrics, metrics

__all__ = ["TurnObserver", "TurnWatch", "gen_ai_model", "gen_ai_system"]

log = scrubbed_logger("june_worker.observe")
_ENDINGS = ("completed", "failed", "cancelled", "suspended")
_TOKEN_TYPES = (
    ("input_tokens", "input", "gen_ai.usage.input_tokens"),
    ("output_tokens", "output", "gen_ai.usage.output_tokens"),
    ("cache_read_tokens", "cache_read", "gen_ai.usage.cache_read.input_tokens"),
    ("cache_write_tokens", "cache_write", "gen_ai.usage.cache_creation.input_tokens"),
)
_warned = False


def _fault(what: str) -> None:
    """A fault of our own instrumentation: logged once per process with its traceback, never raised."""
    global _warned
    if not _warned:
        _warned = True
        log.warning("observing a turn failed (%s); metrics or spans may be missing", what, exc_info=True)


def gen_ai_system(model: Any) -> str:
    """The GenAI ``system`` of a model object: ``anthropic`` for the Anthropic adapter, else its class, lowercased."""
    cls = type(model)
    if "anthropic" in cls.__module__ or cls.__name__.lower().startswith("anthropic"):
        return "anthropic"
    name = cls.__name__.lower()
    return name[: -len("model")] if name.endswith("model") and len(name) > 5 else name


def gen_ai_model(model: Any) -> str:
    """The model's name (``claude-...``) when the object says it, else the system's name."""
    name = getattr(model, "model", None)
    return name if isinstance(name, str) and 0 < len(name) <= 128 else gen_ai_system(model)


class TurnObserver:
    """One per worker process: makes a :class:`TurnWatch` for each run of a turn."""

    def __init__(self, agents: dict[str, Agent]) -> None:
        self.metrics: Metrics = metrics(agents)
        self.tracer = tracing.tracer()

    def took_over(self, ref: SessionRef, rec: TurnRecord) -> None:
        """This process took a session whose first turn another process left running (it died or stalled)."""
        try:
            if self.metrics.enabled:
                self.metrics.takeovers.labels(self.metrics.agent(ref.agent)).inc()
            transition(
                "turn.takeover", turn_id=rec.turn_id, agent=ref.agent, session=ref.session, step=None,
                attempt=rec.attempts + 1, level=logging.WARNING,
            )  # fmt: skip
        except Exception:
            _fault("takeover")

    def rejected(self, ref: SessionRef, turn_id: str) -> None:
        """A turn refused before it ran (an unknown agent, a parked session, an undeliverable target)."""
        try:
            self.metrics.turn_ended(ref.agent, "rejected")
            transition("turn.rejected", turn_id=turn_id, agent=ref.agent, session=ref.session, step=None, attempt=None)
        except Exception:
            _fault("rejection")

    def cancelled_by_reset(self, ref: SessionRef, turn_id: str) -> None:
        """A parked turn a reset ended (cancelled, reason reset): no run of it commits that ending."""
        try:
            self.metrics.turn_ended(ref.agent, "cancelled")
            transition(
                "turn.cancelled", turn_id=turn_id, agent=ref.agent, session=ref.session, step=None, attempt=None,
                reason="reset",
            )  # fmt: skip
        except Exception:
            _fault("cancel by a reset")

    @contextlib.contextmanager
    def run(self, agent: Agent, ref: SessionRef, rec: TurnRecord) -> Iterator[TurnWatch]:
        """Around ``runner.run()``: the turn's span is current inside (its steps' spans are its children)."""
        watch = TurnWatch(self, agent, ref, rec)
        token = watch.open()
        try:
            yield watch
        except BaseException as exc:
            watch.interrupted(exc)
            raise
        finally:
            watch.close(token)


class TurnWatch:
    """The hooks of one run (:class:`~june_worker.engine.hooks.TurnHooks`), and what it saw."""

    def __init__(self, observer: TurnObserver, agent: Agent, ref: SessionRef, rec: TurnRecord) -> None:
        self._o = observer
        self._m = observer.metrics
        self.agent = agent
        self.label = self._m.agent(agent.name)
        self.ref = ref
        self.turn_id = rec.turn_id
        self.attempt = rec.attempts + 1
        self.payload_trace = rec.payload.trace
        self.enqueued_at = rec.payload.sent_at or rec.created_at or None
        """When the turn was enqueued: the producer's ``sent_at``, else its record's creation (the database's clock)."""
        self.status: str | None = None
        self.step_id: str | None = None
        self._span: trace.Span = trace.INVALID_SPAN
        self._step_span: trace.Span | None = None
        self._tool_outcomes: dict[str, str] = {}
        """The outcome of each tool step whose result committed, by step id (calls may run in parallel)."""
        self._t0 = time.perf_counter()
        self._model = gen_ai_model(agent.model)
        self._system = gen_ai_system(agent.model)
        summariser = agent.context.model if agent.context is not None and agent.context.model is not None else None
        self._compact_model = gen_ai_model(summariser) if summariser is not None else self._model
        self._compact_system = gen_ai_system(summariser) if summariser is not None else self._system
        """Who writes a compaction step's summary: the context policy's model, else the agent's."""
        self._tools = {t.name for t in agent.tools}

    # --- the run -----------------------------------------------------------------------------------

    def open(self) -> object | None:
        try:
            parent = tracing.context_of(self.payload_trace)
            self._span = self._o.tracer.start_span(
                "june.turn",
                context=parent,
                kind=SpanKind.CONSUMER,
                attributes={
                    "june.agent": self.agent.name,
                    "june.session": self.ref.session,
                    "june.turn_id": self.turn_id,
                    "june.attempt": self.attempt,
                },
            )
            token = otel_context.attach(trace.set_span_in_context(self._span))
            if self._m.enabled:
                self._m.in_progress.labels(self.label).inc()
            return token
        except Exception:
            _fault("turn start")
            return None

    def interrupted(self, exc: BaseException) -> None:
        """The run ended by an exception (a transient fault it could not outlast, a lost lease)."""
        try:
            reason = "lease_lost" if type(exc).__name__ == "LeaseLostError" else "transient"
            self.status = self.status or "interrupted"
            self._span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            self._span.set_attribute("error.type", type(exc).__name__)
            if self._m.enabled:
                self._m.interrupted.labels(self.label, reason).inc()
            transition(
                "turn.interrupted", turn_id=self.turn_id, agent=self.agent.name, session=self.ref.session,
                step=self.step_id, attempt=self.attempt, level=logging.WARNING, error_type=type(exc).__name__,
                reason=reason,
            )  # fmt: skip
        except Exception:
            _fault("turn interrupted")

    def finished(self, result: TurnResult) -> None:
        """How the run ended, when no commit of its own said so (a rejection, an ending committed elsewhere)."""
        try:
            if self.status is None and result.status == "rejected":
                self.status = "rejected"
                self._m.turn_ended(self.agent.name, "rejected")
                transition(
                    "turn.rejected", turn_id=self.turn_id, agent=self.agent.name, session=self.ref.session,
                    step=None, attempt=self.attempt,
                )  # fmt: skip
            elif self.status is None:
                self.status = result.status
        except Exception:
            _fault("turn finished")

    def close(self, token: object | None) -> None:
        try:
            status = self.status or "interrupted"
            if self._m.enabled:
                self._m.in_progress.labels(self.label).dec()
                self._m.turn_seconds.labels(self.label, status).observe(time.perf_counter() - self._t0)
            self._span.set_attribute("june.turn.status", status)
            self._span.end()
        except Exception:
            _fault("turn end")
        finally:
            if token is not None:
                otel_context.detach(token)  # type: ignore[arg-type]

    # --- TurnHooks -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, kind: StepKind, step: str, tool: str | None = None) -> Iterator[None]:
        # A compaction may run inside a model step (the model refused the request as too long): that step is
        # current again after it.
        outer = (self.step_id, self._step_span) if kind == "compact" else None
        self.step_id = step
        span = self._step_start(kind, step, tool)
        token = otel_context.attach(trace.set_span_in_context(span)) if span is not None else None
        t0 = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            self._step_end(kind, step, tool, span, t0, exc)
            raise
        else:
            self._step_end(kind, step, tool, span, t0, None)
        finally:
            if token is not None:
                otel_context.detach(token)
            if outer is not None and outer[1] is not None:
                self.step_id, self._step_span = outer

    def _step_start(self, kind: StepKind, step: str, tool: str | None) -> trace.Span | None:
        try:
            if kind in ("model", "compact"):
                model, system = (
                    (self._model, self._system) if kind == "model" else (self._compact_model, self._compact_system)
                )
                name, attributes = (
                    f"chat {model}",
                    {
                        "gen_ai.operation.name": "chat",
                        "gen_ai.system": system,
                        "gen_ai.provider.name": system,
                        "gen_ai.request.model": model,
                    },
                )
            else:
                tool_name = tool or "?"
                name, attributes = (
                    f"execute_tool {tool_name}",
                    {
                        "gen_ai.operation.name": "execute_tool",
                        "gen_ai.tool.name": tool_name,
                        "gen_ai.tool.call.id": step.split(":", 2)[-1],
                    },
                )
            attributes.update({"june.step": step, "june.step.kind": kind})
            span = self._o.tracer.start_span(name, kind=SpanKind.INTERNAL if kind == "tool" else SpanKind.CLIENT,
                                             attributes=attributes)  # fmt: skip
            self._step_span = span
            return span
        except Exception:
            _fault("step start")
            return None

    def _step_end(self, kind: StepKind, step: str, tool: str | None, span: trace.Span | None, t0: float,
                  exc: BaseException | None) -> None:  # fmt: skip
        try:
            outcome = self._tool_outcomes.pop(step, None)
            if kind == "tool":
                outcome = outcome or ("aborted" if exc is not None else "parked")
            if span is not None:
                if exc is not None:
                    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                    span.set_attribute("error.type", type(exc).__name__)
                elif outcome == "error":
                    span.set_status(Status(StatusCode.ERROR, "tool error"))
                    span.set_attribute("error.type", "tool_error")
                if outcome is not None:
                    span.set_attribute("june.tool.outcome", outcome)
                span.end()
            self._step_span = None
            if self._m.enabled:
                self._m.step_seconds.labels(self.label, kind).observe(time.perf_counter() - t0)
                if kind == "tool" and outcome is not None:
                    name = tool if tool in self._tools else OTHER
                    self._m.tool_calls.labels(self.label, name, outcome).inc()
        except Exception:
            _fault("step end")

    def committed(self, commit: Commit) -> None:
        try:
            self._read_commit(commit)
        except Exception:
            _fault("commit")

    def _read_commit(self, commit: Commit) -> None:
        for event in commit.events:
            if isinstance(event, ActionCompleted):
                self._tool_outcomes[event.step] = "error" if event.error is not None else "ok"
        for rec in commit.steps:
            if not isinstance(rec.data, dict):
                continue
            if rec.step_id.startswith("model:"):
                self._usage(rec.data, self._model)
            elif rec.step_id.startswith("compact:"):  # a compaction's call is a model call too: it costs tokens
                self._usage(rec.data, self._compact_model)
        status = commit.turn_status if commit.turn_id == self.turn_id else None
        if status == "running":
            if self._m.enabled:
                self._m.attempts.labels(self.label).inc()
            opening = bool(commit.messages)
            if opening and self.enqueued_at is not None:  # a turn opens once: a replay or a resume is no new wait
                self._m.queue_waited(self.agent.name, time.time() - self.enqueued_at)
            self._log("turn.running", "turn:open" if opening else "turn:replay", commit.events)
        elif status in _ENDINGS:
            assert status is not None
            self.status = status
            self._m.turn_ended(self.agent.name, status)
            self._log(f"turn.{status}", self.step_id, commit.events)

    def _usage(self, data: dict[str, Any], model: str) -> None:
        usage, finish = data.get("usage"), data.get("finish")
        span = self._step_span
        if span is not None and isinstance(finish, dict) and isinstance(finish.get("reason"), str):
            span.set_attribute("gen_ai.response.finish_reasons", [finish["reason"]])
        if not isinstance(usage, dict):
            return
        for key, kind, attribute in _TOKEN_TYPES:
            n = usage.get(key)
            if not isinstance(n, int) or n < 0:
                continue
            if span is not None:
                span.set_attribute(attribute, n)
            if n and self._m.enabled:
                self._m.tokens.labels(self.label, model, kind).inc(n)

    def _log(self, event: str, step: str | None, events: list[TurnEvent]) -> None:
        phase = error_type = None
        for e in events:
            if isinstance(e, TurnFailed):
                step, phase, error_type = e.step, e.phase, e.error.type
            elif isinstance(e, InputRequested):
                step = e.step
        duration_ms = None if event == "turn.running" else round((time.perf_counter() - self._t0) * 1000, 1)
        transition(
            event, turn_id=self.turn_id, agent=self.agent.name, session=self.ref.session, step=step,
            attempt=self.attempt, level=logging.WARNING if event == "turn.failed" else logging.INFO, phase=phase,
            error_type=error_type, duration_ms=duration_ms,
        )  # fmt: skip
