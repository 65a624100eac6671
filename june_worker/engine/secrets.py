"""Secrets kept out of every string the engine stores or publishes (errors, causes, stacks, events).

A model adapter registers the credentials it was configured with (:func:`register_secret`);
:func:`scrub` replaces each registered value, and anything shaped like an Anthropic key
(``sk-ant-...``) whether registered or not, with :data:`PLACEHOLDER`. It is applied where an
exception becomes data (:func:`~june_worker.engine.endings.error_info`, a tool's error text)
and where an adapter writes its own error messages.

Log records are scrubbed too, by :class:`ScrubFilter`: on every logger june makes
(:func:`scrubbed_logger`, so the in-process runtime's log is clean whatever handlers the
application sets up), and on the handlers of the processes june configures (the worker, beat, the
gateway: :func:`scrub_handlers`), which also covers what Celery, uvicorn and libraries log there.

The rule a reader must not break: **a string that came from outside the process (an
exception's message, a provider's reply) is scrubbed before it is stored, published or logged
by the engine, and scrubbed whole, before it is cut to any bound** (a cut can split a secret into a
piece nothing recognises). Values shorter than :data:`MIN_SECRET_CHARS` are not registered: replacing a
short common string everywhere would garble every report, and no real credential is that short.
"""

from __future__ import annotations

import logging
import re
import threading

__all__ = [
    "MIN_SECRET_CHARS",
    "PLACEHOLDER",
    "ScrubFilter",
    "register_secret",
    "scrub",
    "scrub_handlers",
    "scrubbed_logger",
]

PLACEHOLDER = "<redacted>"
MIN_SECRET_CHARS = 8

_KEY_SHAPED = re.compile(r"sk-ant-[A-Za-z0-9_\-]{4,}")
"""Anthropic API and admin keys (``sk-ant-api03-...``, ``sk-ant-admin01-...``)."""

_lock = threading.Lock()
_secrets: tuple[str, ...] = ()  # longest first, replaced whole (copy on write: scrub reads without the lock)


def register_secret(value: str | None) -> None:
    """Keep ``value`` out of every scrubbed string from now on, in this process (idempotent)."""
    global _secrets
    if not isinstance(value, str) or len(value) < MIN_SECRET_CHARS:
        return
    with _lock:
        if value not in _secrets:
            _secrets = tuple(sorted((*_secrets, value), key=len, reverse=True))


def scrub(text: str) -> str:
    """``text`` with every registered secret and every Anthropic-shaped key replaced by the placeholder."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, PLACEHOLDER)
    return _KEY_SHAPED.sub(PLACEHOLDER, text)


# --- logs -------------------------------------------------------------------------------------------

_FORMATTER = logging.Formatter()


class ScrubFilter(logging.Filter):
    """Scrubs a log record in place, before any handler formats it: its message (with its arguments) and
    its traceback. Never drops a record.

    A record with nothing to scrub is left as it is (formatters that read ``args``, as uvicorn's access
    log does, keep working). One that holds a secret gets the scrubbed message with no arguments, and its
    traceback formatted and scrubbed into ``exc_text`` with ``exc_info`` dropped, so that no formatter
    can format the raw exception again (``exc_type_name`` keeps its class name).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # arguments that do not fit: logging would print both raw; print them scrubbed
            record.msg, record.args = scrub(f"{record.msg!s} {record.args!r}"), ()
        else:
            clean = scrub(message)
            if clean != message:
                record.msg, record.args = clean, ()
        if record.exc_info:
            text = record.exc_text or _FORMATTER.formatException(record.exc_info)
            clean = scrub(text)
            if clean != text:
                record.exc_type_name = getattr(record.exc_info[0], "__name__", None)
                record.exc_info = None
            record.exc_text = clean  # formatters print this instead of formatting the exception again
        elif record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


_FILTER = ScrubFilter()


def scrubbed_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with :class:`ScrubFilter` on it: what june logs there is scrubbed before any
    handler, the application's included, sees it. Every logger of the package is made with it."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, ScrubFilter) for f in logger.filters):
        logger.addFilter(_FILTER)
    return logger


def scrub_handlers(logger: logging.Logger | None = None) -> None:
    """Put :class:`ScrubFilter` on every handler of ``logger`` (the root logger by default), so that every
    record those handlers write is scrubbed, whoever logged it (idempotent)."""
    target = logger if logger is not None else logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, ScrubFilter) for f in handler.filters):
            handler.addFilter(_FILTER)
