"""A local stand-in for Anthropic's Messages API: recorded responses served over real HTTP on 127.0.0.1.

The real ``anthropic`` SDK client is pointed at :attr:`AnthropicAPI.url` with ``base_url``, so
every byte goes through its HTTP stack, its SSE decoder and its retry logic, as against the real
API. Streams are sent the way the API sends them: chunked, one SSE event per chunk. Responses
are served in the order they were queued; every request is recorded (path, headers, JSON body).

Like the real API, the server refuses (400) a request it could never answer, whatever is queued:
an empty or whitespace-only text block (a session that sent one once could never continue), and a
transcript the Messages API rejects (:func:`request_problems`: roles out of turn, a tool call without
its result or a result without its call, thinking missing where a tool loop needs it).

The rule a reader must not break: **the server never reaches beyond loopback**; a request with
nothing queued gets a 400 naming that, never a hang.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests._services import closed_port

__all__ = [
    "FIXTURES",
    "HANG_UP",
    "KEY",
    "AnthropicAPI",
    "Recorded",
    "SeenRequest",
    "api_error",
    "closed_port",
    "recorded",
    "request_problems",
    "sse",
]

FIXTURES = Path(__file__).parent / "fixtures" / "anthropic"
KEY = "sk-ant-test-0123456789abcdef"
"""The key test clients are made with (key-shaped, so it is scrubbed wherever it appears)."""
SSE_HEADERS = {"content-type": "text/event-stream", "request-id": "req_test"}


@dataclass(frozen=True)
class Recorded:
    """One response to serve.

    ``cut`` sends ``body`` as part of a longer chunk, then drops the connection (a body that breaks
    off); status 0 closes the connection without any response (a server that hung up).
    """

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    cut: bool = False

    @property
    def streamed(self) -> bool:
        return self.headers.get("content-type", "").startswith("text/event-stream")


@dataclass(frozen=True)
class SeenRequest:
    path: str
    headers: dict[str, str]
    content: bytes

    def json(self) -> Any:
        return json.loads(self.content)


def recorded(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def sse(name: str, **replace: str) -> Recorded:
    """A recorded stream from ``tests/fixtures/anthropic``, with optional text replacements."""
    body = recorded(name).decode()
    for old, new in replace.items():
        body = body.replace(old, new)
    return Recorded(200, body.encode(), dict(SSE_HEADERS))


def sse_events(*events: dict[str, Any]) -> Recorded:
    """A stream built from event objects (each sent as ``event: <type>`` + ``data: <json>``)."""
    body = "".join(f"event: {e['type']}\ndata: {json.dumps(e, separators=(',', ':'))}\n\n" for e in events)
    return Recorded(200, body.encode(), dict(SSE_HEADERS))


def api_error(status: int, name_or_body: str | dict[str, Any]) -> Recorded:
    """An HTTP error with a recorded (file name) or given JSON body, as the API sends it."""
    body = recorded(name_or_body) if isinstance(name_or_body, str) else json.dumps(name_or_body).encode()
    headers = {"content-type": "application/json", "request-id": "req_test"}
    if status == 529:  # what the API sends with an overload: retry, and how soon (1 ms keeps tests fast)
        headers |= {"x-should-retry": "true", "retry-after-ms": "1"}
    return Recorded(status, body, headers)


HANG_UP = Recorded(0, b"")
"""Close the connection without sending a response."""


class AnthropicAPI:
    """Serves queued :class:`Recorded` responses to whoever connects; records every request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[Recorded] = []
        self.requests: list[SeenRequest] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        # a short poll keeps shutdown() quick: it waits for the serving loop's next look at its flag
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="anthropic-api", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def serve(self, *responses: Recorded) -> AnthropicAPI:
        with self._lock:
            self._queue.extend(responses)
        return self

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [r.json() for r in self.requests]

    def _take(self, request: SeenRequest) -> Recorded:
        refused = _refusal(request)
        with self._lock:
            self.requests.append(request)
            if refused is not None:
                return refused
            if self._queue:
                return self._queue.pop(0)
        nothing = {"type": "error", "error": {"type": "invalid_request_error", "message": "no recorded response left"}}
        return api_error(400, nothing)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> AnthropicAPI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def request_problems(body: dict[str, Any]) -> list[str]:
    """What the Messages API would refuse in a request's transcript (the rules our adapter must keep).

    The first message is the user's and roles alternate; every ``tool_use`` is answered by a ``tool_result``
    (same id) in the very next message, results first, and no result answers a call that is not in the
    message before it; a request with tool blocks defines tools; with thinking on, the request ends on a user
    message (no prefill), and one that continues a tool loop (it ends with tool results) sends the assistant
    message before them starting with its thinking.
    """
    messages = body.get("messages", [])
    problems: list[str] = []
    if not messages or messages[0].get("role") != "user":
        problems.append("messages: the first message must use the user role")
    for i in range(1, len(messages)):
        if messages[i].get("role") == messages[i - 1].get("role"):
            problems.append(f"messages.{i}: roles must alternate, two {messages[i].get('role')} messages in a row")
    has_tools = False
    for i, message in enumerate(messages):
        blocks = _blocks(message)
        calls = [b.get("id") for b in blocks if b.get("type") == "tool_use"]
        results = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
        has_tools = has_tools or bool(calls or results)
        after = _blocks(messages[i + 1]) if i + 1 < len(messages) else None
        if calls and after is not None:
            answered = [b.get("tool_use_id") for b in after if b.get("type") == "tool_result"]
            if sorted(answered) != sorted(calls):
                problems.append(f"messages.{i + 1}: tool_use ids {calls} need their tool_result blocks, got {answered}")
            elif any(b.get("type") != "tool_result" for b in after[: len(answered)]):
                problems.append(f"messages.{i + 1}: tool_result blocks must come first")
        if results:
            before = _blocks(messages[i - 1]) if i > 0 else []
            asked = {b.get("id") for b in before if b.get("type") == "tool_use"}
            if not set(results) <= asked:
                problems.append(f"messages.{i}: tool_result for {sorted(set(results) - asked)} without its tool_use")
    if has_tools and not body.get("tools"):
        problems.append("tools: a request with tool_use or tool_result blocks must define tools")
    thinking = body.get("thinking") or {}
    if thinking.get("type") in ("enabled", "adaptive") and messages and messages[-1].get("role") == "assistant":
        problems.append("messages: with thinking on, the final message must be the user's (no assistant prefill)")
    continues = len(messages) >= 2 and any(b.get("type") == "tool_result" for b in _blocks(messages[-1]))
    if thinking.get("type") in ("enabled", "adaptive") and continues:
        first = _blocks(messages[-2])[:1]
        if not first or first[0].get("type") not in ("thinking", "redacted_thinking"):
            found = first[0].get("type") if first else "nothing"
            problems.append(
                f"messages.{len(messages) - 2}.content.0.type: Expected `thinking` or `redacted_thinking`, "
                f"but found `{found}`."
            )
    return problems


def _refusal(request: SeenRequest) -> Recorded | None:
    """The 400 the real API answers a request with an empty or whitespace-only text block or a transcript it
    refuses (:func:`request_problems`), else None. Checked before any queued response is used, as the API
    checks before it generates.
    """
    try:
        body = request.json()
        messages = body.get("messages", [])
    except ValueError:
        return None
    problems = request_problems(body)
    if problems:
        return api_error(400, {"type": "error", "error": {"type": "invalid_request_error", "message": problems[0]}})
    for i, message in enumerate(messages):
        content = message.get("content")
        blocks = content if isinstance(content, list) else []
        for block in blocks:
            if isinstance(block, dict) and block.get("type") == "text" and not str(block.get("text", "")).strip():
                error = "text content blocks must contain non-whitespace text"
                if not block.get("text"):
                    error = "text content blocks must be non-empty"
                body = {
                    "type": "error",
                    "error": {"type": "invalid_request_error", "message": f"messages.{i}: {error}"},
                }
                return api_error(400, body)
    return None


def _handler_for(api: AnthropicAPI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
            length = int(self.headers.get("content-length") or 0)
            content = self.rfile.read(length)
            headers = {k.lower(): v for k, v in self.headers.items()}
            response = api._take(SeenRequest(self.path, headers, content))
            try:
                if response.status == 0:
                    self.connection.shutdown(socket.SHUT_RDWR)
                else:
                    self._send(response)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up on the response (a test that stopped reading): nothing to do
            self.close_connection = True

        def _send(self, response: Recorded) -> None:
            self.send_response(response.status)
            for name, value in response.headers.items():
                self.send_header(name, value)
            self.send_header("connection", "close")
            if not response.streamed and not response.cut:
                self.send_header("content-length", str(len(response.body)))
                self.end_headers()
                self.wfile.write(response.body)
                return
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            if response.cut:
                # announce more bytes than are sent, then close: the client sees the body break off
                self.wfile.write(f"{len(response.body) + 64:x}\r\n".encode() + response.body)
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            for event in response.body.split(b"\n\n"):
                if event.strip():
                    chunk = event + b"\n\n"
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # keep test output clean

    return Handler
