"""Calls to the Slack Web API through ``slack_sdk``'s :class:`~slack_sdk.WebClient`, one per process.

``slack_sdk`` does the HTTP, and its retry handlers retry what Slack says may be retried: a 429
after its ``Retry-After``, a 500 / 503, a dropped connection. What still fails becomes a
:class:`~june_worker.errors.ChannelError` naming the method and Slack's error code (logged as
such; never the token, never the request's text), ``retryable`` for the failures a later attempt
may get past (rate limits, Slack's own errors, the network).

The rule a reader must not break: **the bot token stays in this object**: not in a log line, an
error, an event or a task argument.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.http_retry.builtin_handlers import (
    ConnectionErrorRetryHandler,
    RateLimitErrorRetryHandler,
    ServerErrorRetryHandler,
)

from ...errors import ChannelError

__all__ = ["RETRYABLE_CODES", "SlackApi"]

log = logging.getLogger("june_worker.channels.slack")

RETRYABLE_CODES = frozenset(
    {"ratelimited", "rate_limited", "internal_error", "fatal_error", "service_unavailable", "request_timeout"}
)
"""Slack error codes worth another attempt later; any other code (``channel_not_found``...) is not."""


class SlackApi:
    """A Web API client made lazily, again after a fork (a prefork worker's child makes its own)."""

    DEFAULT_URL = WebClient.BASE_URL

    def __init__(self, token: str, *, base_url: str | None = None, timeout_s: float = 10.0, retries: int = 2) -> None:
        self._token = token
        self.base_url = base_url or self.DEFAULT_URL
        self.timeout_s = timeout_s
        self.retries = retries
        self._client: WebClient | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"SlackApi(base_url={self.base_url!r})"

    @property
    def client(self) -> WebClient:
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._client = WebClient(
                    token=self._token,
                    base_url=self.base_url,
                    timeout=int(max(1, self.timeout_s)),
                    retry_handlers=[
                        RateLimitErrorRetryHandler(max_retry_count=self.retries),
                        ServerErrorRetryHandler(max_retry_count=self.retries),
                        ConnectionErrorRetryHandler(max_retry_count=self.retries),
                    ],
                )
                self._pid = os.getpid()
            return self._client

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Call ``method`` (``chat.postMessage``) with JSON ``params``; the response's data, or :class:`ChannelError`."""
        try:
            response = self.client.api_call(method, json={k: v for k, v in params.items() if v is not None})
        except SlackApiError as exc:
            code = str(exc.response.get("error", "")) if exc.response is not None else ""
            status = getattr(exc.response, "status_code", None)
            retryable = code in RETRYABLE_CODES or status in (429, 500, 502, 503, 504)
            log.warning("Slack %s failed: %s (HTTP %s)%s", method, code or "no error code", status,
                        "; a later attempt may succeed" if retryable else "")  # fmt: skip
            raise ChannelError(f"Slack {method} failed: {code or status}", method, code, retryable) from None
        except (SlackClientError, OSError) as exc:
            log.warning("Slack %s did not answer: %s", method, type(exc).__name__)
            raise ChannelError(f"Slack {method} did not answer ({type(exc).__name__})", method, "", True) from None
        data: dict[str, Any] = dict(response.data) if isinstance(response.data, dict) else {}
        return data
