"""The retry budget of one Anthropic model call: how often a failed request is sent again, and after how long.

The adapter turns the SDK's own retries off and keeps this one policy, so that nothing stacks on it: a
request that failed before any output (HTTP 408/409/429/5xx/529, a connection error, an in-stream error
such as ``overloaded_error``) is sent again at most ``max_retries`` times per model call, after the
server's ``retry-after`` when it sends one, else after an exponential backoff. A ``retry-after`` longer
than ``max_wait_s`` ends the retries at once: the server said it will not be ready within the budget.

The one rule a reader must not break: **an error the budget covered leaves the adapter non-retryable**,
so the step's retries and the host's attempts never send the request again on top of it.
"""

from __future__ import annotations

import email.utils
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_BACKOFF_S",
    "RETRYABLE_STATUS",
    "RETRYABLE_STREAM_ERRORS",
    "RetryBudget",
    "retry_after_s",
    "transport_errors",
    "worth_retrying",
]

MAX_BACKOFF_S = 8.0
"""The longest backoff between two requests when the server does not say how long to wait."""

RETRYABLE_STATUS = frozenset({408, 409, 429})
"""HTTP statuses below 500 worth another request (every 5xx is, 529 ``overloaded`` included)."""

RETRYABLE_STREAM_ERRORS = frozenset({"overloaded_error", "api_error", "rate_limit_error", "timeout_error"})
"""``error.type`` values of an in-stream ``error`` event that a fresh request may not hit again."""


def transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's transport errors (a connection dropped mid-body is raised unwrapped)."""
    found: list[type[BaseException]] = []
    for name in ("httpx2", "httpx"):
        module = sys.modules.get(name)
        error = getattr(module, "TransportError", None) if module is not None else None
        if isinstance(error, type) and issubclass(error, BaseException):
            found.append(error)
    return tuple(found)


def _headers(exc: BaseException) -> Any:
    response = getattr(exc, "response", None)
    return getattr(response, "headers", None)


def retry_after_s(exc: BaseException) -> float | None:
    """How long the server asked to wait before the next request (``retry-after-ms``, or ``retry-after`` in
    seconds or as an HTTP date), or None when it did not say."""
    headers = _headers(exc)
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(float(value) * scale, 0.0)
        except ValueError:
            pass
    when = email.utils.parsedate_tz(headers.get("retry-after") or "")
    if when is None:
        return None
    return max(email.utils.mktime_tz(when) - time.time(), 0.0)


def worth_retrying(exc: BaseException) -> bool:
    """A failure that another request may not meet: an overload, a rate limit, a server or connection error."""
    sdk = sys.modules.get("anthropic")
    if sdk is not None and isinstance(exc, sdk.APIStatusError):
        if exc.status_code < 400:  # an error event inside a 200 stream
            return getattr(exc, "type", None) in RETRYABLE_STREAM_ERRORS
        said = (_headers(exc) or {}).get("x-should-retry")
        if said in ("true", "false"):
            return bool(said == "true")
        return exc.status_code in RETRYABLE_STATUS or exc.status_code >= 500
    if sdk is not None and isinstance(exc, sdk.APIConnectionError):
        return True
    return isinstance(exc, transport_errors())


@dataclass
class RetryBudget:
    """The retries left to one model call (every request it sends, continuations of a paused reply included)."""

    max_retries: int
    delay_s: float
    max_wait_s: float
    used: int = 0
    started: float = field(default_factory=time.monotonic)
    refused_wait_s: float | None = None
    """The server's ``retry-after`` that ended the retries, being longer than ``max_wait_s``."""

    def next_wait(self, exc: BaseException) -> float | None:
        """Seconds to wait before sending the request again after ``exc``; None: not again (not worth it, the
        budget is spent, or the server asked for a longer wait than the budget allows)."""
        if not worth_retrying(exc) or self.used >= self.max_retries:
            return None
        after = retry_after_s(exc)
        if after is not None and after > self.max_wait_s:
            self.refused_wait_s = after
            return None
        self.used += 1
        if after is not None:
            return after
        backoff = min(self.delay_s * 2.0 ** (self.used - 1), MAX_BACKOFF_S)
        return backoff * (1 - 0.25 * random.random())

    def spent(self) -> str:
        """Why the retries ended, for the error the call raises."""
        tried = f"gave up after {self.used} of {self.max_retries} retries in {time.monotonic() - self.started:.1f}s"
        if self.refused_wait_s is not None:
            return f"the API asked to wait {self.refused_wait_s:g}s, longer than max_retry_wait_s={self.max_wait_s:g}; {tried}"
        return tried
