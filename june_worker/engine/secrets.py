"""Secrets kept out of every string the engine stores or publishes (errors, causes, stacks, events).

A model adapter registers the credentials it was configured with (:func:`register_secret`);
:func:`scrub` replaces each registered value, and anything shaped like an Anthropic key
(``sk-ant-...``) whether registered or not, with :data:`PLACEHOLDER`. It is applied where an
exception becomes data (:func:`~june_worker.engine.endings.error_info`, a tool's error text)
and where an adapter writes its own error messages.

The rule a reader must not break: **a string that came from outside the process (an
exception's message, a provider's reply) is scrubbed before it is stored, published or logged
by the engine, and scrubbed whole, before it is cut to any bound** (a cut can split a secret into a
piece nothing recognises). Values shorter than :data:`MIN_SECRET_CHARS` are not registered: replacing a
short common string everywhere would garble every report, and no real credential is that short.
"""

from __future__ import annotations

import re
import threading

__all__ = ["MIN_SECRET_CHARS", "PLACEHOLDER", "register_secret", "scrub"]

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
