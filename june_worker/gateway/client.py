"""Reading the gateway from Python: parse ``text/event-stream``, collapse a turn's stream to its end.

Works with any response object that has ``status_code``, ``headers``, ``iter_lines()`` and
``read()`` (httpx's streamed responses, for one)::

    with httpx.stream("POST", f"{url}/v1/agents/ops/sessions/s1/turns", json={"text": "hi"},
                      headers={"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}) as r:
        print(collapse_text(r))          # the final text; raises if the turn did not complete

A response that is not an SSE stream (a 409, a 500 with a JSON body...) is a
:class:`GatewayResponseError` saying so, with the status and the body, never an empty result.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import JuneError

__all__ = [
    "TERMINAL_TYPES",
    "GatewayResponseError",
    "SSEMessage",
    "TurnEnd",
    "TurnNotCompletedError",
    "collapse",
    "collapse_text",
    "expect_sse",
    "parse_sse",
]

TERMINAL_TYPES = frozenset({"turn.completed", "turn.failed", "turn.cancelled", "input.requested"})


class StreamedResponse(Protocol):
    @property
    def status_code(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    def iter_lines(self) -> Iterator[str]: ...
    def read(self) -> bytes: ...


class GatewayResponseError(JuneError):
    """The gateway answered with something other than the SSE stream that was asked for."""

    def __init__(self, status: int, content_type: str, body: str) -> None:
        super().__init__(status, content_type, body)
        self.status, self.content_type, self.body = status, content_type, body

    def __str__(self) -> str:
        body = self.body if len(self.body) <= 500 else self.body[:497] + "..."
        return f"expected an SSE response (text/event-stream), got status {self.status} ({self.content_type}): {body}"


class TurnNotCompletedError(JuneError):
    """The turn's stream ended without ``turn.completed``: it failed, was cancelled, parked, or the stream broke."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(status, detail)
        self.status, self.detail = status, detail

    def __str__(self) -> str:
        return f"the turn did not complete ({self.status}): {self.detail}"


@dataclass(frozen=True, slots=True)
class SSEMessage:
    """One dispatched SSE message. ``id`` is the Redis stream id (resume with ``Last-Event-ID``)."""

    id: str | None
    event: str
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


def parse_sse(lines: Iterable[str]) -> Iterator[SSEMessage]:
    """SSE messages from a stream's lines (the WHATWG parsing rules; comments and ``retry`` are skipped)."""
    event, last_id, has_id = "", None, False
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield SSEMessage(id=last_id if has_id else None, event=event or "message", data="\n".join(data))
            event, data, has_id = "", [], False
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id" and "\0" not in value:
            last_id, has_id = value, True
    # a message not closed by a blank line is incomplete: the stream broke, drop it (as browsers do)


def expect_sse(response: StreamedResponse) -> None:
    """Raise :class:`GatewayResponseError` unless ``response`` is a 200 ``text/event-stream``."""
    content_type = response.headers.get("content-type", "")
    if response.status_code != 200 or not content_type.startswith("text/event-stream"):
        body = response.read().decode("utf-8", "replace")
        raise GatewayResponseError(response.status_code, content_type or "no content type", body)


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """How a turn's stream ended: its terminal event's type and JSON, and that event's stream id."""

    type: str
    event: dict[str, Any]
    last_event_id: str | None
    text: str
    """The final text (``turn.completed``), or the text of the completed messages so far."""


def collapse(response: StreamedResponse) -> TurnEnd:
    """Read a turn's SSE stream to its terminal event. A non-SSE response is a :class:`GatewayResponseError`."""
    expect_sse(response)
    texts: list[str] = []
    for message in parse_sse(response.iter_lines()):
        if message.event not in TERMINAL_TYPES and message.event != "message.completed":
            continue
        event = message.json()
        if message.event == "message.completed":
            texts.append(str(event.get("text", "")))
            continue
        text = str(event["text"]) if message.event == "turn.completed" else "\n".join(texts)
        return TurnEnd(type=message.event, event=event, last_event_id=message.id, text=text)
    raise TurnNotCompletedError("broken", "the stream ended before the turn's terminal event")


def collapse_text(response: StreamedResponse) -> str:
    """The turn's final text; :class:`TurnNotCompletedError` if it failed, was cancelled or parked."""
    end = collapse(response)
    if end.type == "turn.completed":
        return end.text
    if end.type == "turn.failed":
        raise TurnNotCompletedError("failed", str(end.event.get("error", {}).get("message", "")))
    if end.type == "turn.cancelled":
        raise TurnNotCompletedError("cancelled", str(end.event.get("reason", "")))
    request = end.event.get("request", {})
    raise TurnNotCompletedError("suspended", f"waiting for input {request.get('id')!r}: {request.get('prompt', '')}")
