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
from typing import Any

from june_wire.storable import json_text

__all__ = [
    "MIN_SECRET_CHARS",
    "PLACEHOLDER",
    "ScrubFilter",
    "StreamScrubber",
    "register_secret",
    "scrub",
    "scrub_json",
    "secret_free_json_text",
    "scrub_handlers",
    "scrubbed_logger",
]

PLACEHOLDER = "<redacted>"
MIN_SECRET_CHARS = 8

_KEY_PREFIX = "sk-ant-"
_KEY_SHAPED = re.compile(r"sk-ant-[A-Za-z0-9_\-]{4,}")
"""Anthropic API and admin keys (``sk-ant-api03-...``, ``sk-ant-admin01-...``)."""
_KEY_AT_END = re.compile(r"sk-ant-[A-Za-z0-9_\-]*\Z")

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


def scrub_json(value: Any) -> Any:
    """A JSON value with :func:`scrub` applied to every string and key; ``value`` itself when none holds a secret."""
    if isinstance(value, dict | list | tuple) and _clean_as_json(value):
        return value  # the common case: one look at the value's JSON text instead of one per string
    return _scrub_each(value)


_JSON_ESCAPED = re.compile(r'["\\\x00-\x1f]')


def _clean_as_json(value: Any) -> bool:
    """True when no string of ``value`` can hold a secret, judged from its JSON text."""
    try:
        text = json_text(value)
    except (TypeError, ValueError):  # (NaN among them: judged string by string instead)
        return False
    return secret_free_json_text(text)


def secret_free_json_text(text: str) -> bool:
    """True when no string of the value whose JSON ``text`` this is (made without escaping non-ASCII) can hold a
    secret: every registered value and every key-shaped string appears in the text as it is, unless it has a
    character JSON escapes (then: False, and the caller scrubs string by string)."""
    if any(_JSON_ESCAPED.search(secret) for secret in _secrets):
        return False
    return not any(secret in text for secret in _secrets) and _KEY_SHAPED.search(text) is None


def _scrub_each(value: Any) -> Any:
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        clean = {scrub(k) if isinstance(k, str) else k: _scrub_each(v) for k, v in value.items()}
        same = all(a is b for a, b in zip(value.values(), clean.values(), strict=True)) and clean.keys() == value.keys()
        return value if same else clean
    if isinstance(value, list | tuple):
        items = [_scrub_each(v) for v in value]
        return value if all(a is b for a, b in zip(value, items, strict=True)) else items
    return value


class StreamScrubber:
    """Scrubs a text that arrives in pieces (a model's deltas), so that no secret is published split across two.

    :meth:`feed` returns what of the text so far can go out, scrubbed, and holds back its end while that end
    could be the start of a secret: a registered value's first characters, or an Anthropic-shaped key that
    may go on (``sk-an``, ``sk-ant-api03-Ab``). :meth:`flush` returns what is held, scrubbed, once the text ends.
    """

    def __init__(self) -> None:
        self._held = ""

    def feed(self, piece: str) -> str:
        text = self._held + piece
        cut = len(text) - self._open_end(text)
        self._held = text[cut:]
        return scrub(text[:cut])

    def flush(self) -> str:
        text, self._held = self._held, ""
        return scrub(text)

    @staticmethod
    def _open_end(text: str) -> int:
        """How many of ``text``'s last characters could begin a secret still arriving."""
        key = _KEY_AT_END.search(text)
        hold = len(text) - key.start() if key is not None else 0
        for value in (_KEY_PREFIX, *_secrets):
            if not text or text[-1] not in value:
                continue
            for n in range(min(len(value) - 1, len(text)), hold, -1):
                if text.endswith(value[:n]):
                    hold = n
                    break
        return hold


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
