"""Structured logs: one line per turn transition and failure, as JSON with ``JUNE_LOG_FORMAT=json``.

Every transition goes to the logger ``june_worker.turns`` with its fields in ``record.june``:
``event`` (``turn.running``, ``turn.suspended``, ``turn.completed``, ``turn.failed``,
``turn.cancelled``, ``turn.rejected``, ``turn.interrupted``, ``turn.resumed``, ``turn.takeover``),
``turn_id``, ``agent``, ``session``, ``step``, ``attempt``, and where they apply ``phase``,
``error_type``, ``duration_ms``. :class:`JsonFormatter` writes any record as one JSON object
(``ts``, ``level``, ``logger``, ``message`` and those fields); :func:`use_json_logs` puts it on
the handlers of a process's root logger (the worker does so when ``JUNE_LOG_FORMAT=json``).

The rule a reader must not break: **no message text, prompt, tool argument, answer or exception
message in a transition**: the error's type only (its message is on the turn's row, its
``turn.failed`` event and the operator console).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..engine.secrets import scrub, scrubbed_logger

__all__ = ["LOG_FORMATS", "JsonFormatter", "transition", "use_json_logs"]

LOG_FORMATS = ("text", "json")
log = scrubbed_logger("june_worker.turns")


def transition(
    event: str,
    *,
    turn_id: str,
    agent: str,
    session: str,
    step: str | None,
    attempt: int | None,
    level: int = logging.INFO,
    **fields: Any,
) -> None:
    """Log one turn transition (or failure); ``fields``: ``phase``, ``error_type``, ``duration_ms``..."""
    if not log.isEnabledFor(level):
        return
    june = {"event": event, "turn_id": turn_id, "agent": agent, "session": session, "step": step, "attempt": attempt}
    june.update((k, v) for k, v in fields.items() if v is not None)
    extra = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    log.log(
        level,
        "%s %s agent=%s session=%s step=%s attempt=%s%s",
        event, turn_id, agent, session, step, attempt, f" {extra}" if extra else "",
        extra={"june": june},
    )  # fmt: skip


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON: ``ts`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, june's fields;
    ``exc_type`` and ``exc`` (the traceback) with an exception. The message and the traceback are scrubbed
    of secrets (:mod:`~june_worker.engine.secrets`) even on a handler without the scrubbing filter."""

    def format(self, record: logging.LogRecord) -> str:
        june = getattr(record, "june", None)
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
        }
        if isinstance(june, dict):
            out["message"] = june.get("event", record.getMessage())
            out.update(june)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exc_type"] = record.exc_info[0].__name__ if record.exc_info[0] else None
            out["exc"] = scrub(record.exc_text or self.formatException(record.exc_info))
        elif record.exc_text:  # formatted and scrubbed by ScrubFilter, which dropped the exception itself
            out["exc_type"] = getattr(record, "exc_type_name", None)
            out["exc"] = scrub(record.exc_text)
        out["message"] = scrub(str(out["message"]))
        return json.dumps(out, default=str, ensure_ascii=False)


def use_json_logs(logger: logging.Logger | None = None) -> None:
    """Write every record of ``logger`` (the root logger by default) as JSON, on each of its handlers."""
    target = logger if logger is not None else logging.getLogger()
    formatter = JsonFormatter()
    for handler in target.handlers:
        handler.setFormatter(formatter)
