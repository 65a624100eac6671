"""A second channel, to show the seam: POST each finished run of a turn, as JSON, to a configured URL.

The target names an endpoint, never a URL (``{"channel": "webhook", "endpoint": "ops"}``): URLs,
which often carry a secret, are configured on the worker (``WebhookChannel({"ops": url})``) and
stay out of task arguments. It renders post-once (no live part). Delivery is at least once, so
each POST carries an ``Idempotency-Key`` (the turn, the run and a digest of what it shows) for
the receiver to drop a repeat; a run recorded as delivered is not posted again. A 5xx, a 429 or
no answer is retryable (the delivery stays due); any other status is not.

The body::

    {"turn_id": "...", "session": "...", "run": "reply" | "resume:<input id>",
     "status": "completed" | "failed" | "cancelled" | "parked", "text": "...", "note": "..." | null,
     "tools": [{"id": "c1", "name": "create_order", "status": "complete" | "error", "error": null}],
     "input": {"id": "...", "prompt": "..."} | null}
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.events import TurnEvent, TurnResult
from ..engine.types import JsonValue
from ..errors import ChannelError, ConfigError
from .base import RenderContext
from .view import Segment, fold

__all__ = ["WebhookChannel"]

log = logging.getLogger("june_worker.channels.webhook")


class WebhookChannel:
    name = "webhook"

    def __init__(self, endpoints: Mapping[str, str], *, timeout_s: float = 10.0) -> None:
        for name, url in endpoints.items():
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"webhook endpoint {name!r} must be an http(s) URL")
        self.endpoints = dict(endpoints)
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"WebhookChannel(endpoints={sorted(self.endpoints)})"  # URLs may hold secrets

    def _url(self, target: Mapping[str, JsonValue]) -> str:
        name = target.get("endpoint")
        url = self.endpoints.get(name) if isinstance(name, str) else None
        if url is None:
            raise ChannelError(f"no webhook endpoint named {name!r} on this worker", "POST", "unknown_endpoint")
        return url

    def renderer(self, target: Mapping[str, JsonValue], ctx: RenderContext) -> _WebhookRenderer:
        return _WebhookRenderer(self, self._url(target), ctx)

    def notify(self, target: Mapping[str, JsonValue], text: str) -> None:
        self.post(self._url(target), {"note": text}, key=None)

    def post(self, url: str, body: dict[str, Any], *, key: str | None) -> None:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Idempotency-Key"] = key
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s):  # noqa: S310 - a configured http(s) URL
                return
        except urllib.error.HTTPError as exc:
            exc.close()  # the error holds the response open
            retryable = exc.code >= 500 or exc.code == 429
            log.warning("webhook POST answered %d%s", exc.code, "; a later attempt may succeed" if retryable else "")
            raise ChannelError(f"webhook POST answered {exc.code}", "POST", str(exc.code), retryable) from None
        except OSError as exc:
            log.warning("webhook POST did not answer: %s", type(exc).__name__)
            raise ChannelError(f"webhook POST did not answer ({type(exc).__name__})", "POST", "", True) from None


def _body(ctx: RenderContext, seg: Segment) -> dict[str, Any]:
    return {
        "turn_id": ctx.turn_id,
        "session": ctx.session,
        "run": seg.key,
        "status": seg.ending,
        "text": seg.text,
        "note": seg.note,
        "tools": [{"id": t.id, "name": t.name, "status": t.status, "error": t.error} for t in seg.tasks.values()],
        "input": {"id": seg.prompt.id, "prompt": seg.prompt.prompt} if seg.prompt else None,
        "inputs": [{"id": p.id, "prompt": p.prompt} for p in seg.prompts],
    }


class _WebhookRenderer:
    live = False
    interval_s = 0.0

    def __init__(self, channel: WebhookChannel, url: str, ctx: RenderContext) -> None:
        self.channel, self.url, self.ctx = channel, url, ctx

    def feed(self, event: TurnEvent) -> None:
        return None

    def push(self) -> None:
        return None

    def abort(self) -> None:
        return None

    def finish(self, events: Sequence[TurnEvent], result: TurnResult) -> None:
        for seg in fold(events):
            if seg.key is None or not seg.ended:
                continue
            digest = seg.digest()
            if (self.ctx.state.get(seg.key) or {}).get("done") == digest:
                continue
            if seg.visible or seg.prompt is not None:
                key = f"{self.ctx.turn_id}:{seg.key}:{digest}"
                self.channel.post(self.url, _body(self.ctx, seg), key=key)
            self.ctx.state.put(seg.key, {"done": digest})
