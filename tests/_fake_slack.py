"""A fake Slack Web API on 127.0.0.1: records every call (method + body) and answers like Slack.

``slack_sdk`` is pointed at it with ``base_url`` (``JUNE_SLACK_API_URL`` for workers). It keeps
the messages it was asked to post, stream and update, so a test can read the thread as a person
would see it, and it can be told to fail: a method answering ``{"ok": false, "error": ...}``,
every method failing (``fail_all``), every call carrying Block Kit ``blocks`` failing
(``refuse_blocks``, as Slack answers ``invalid_blocks``), or a 429 with ``Retry-After`` for the
next n calls of a method.

Also: :func:`signed` builds the headers Slack signs a request with (``v0:<ts>:<body>``, HMAC-SHA256
under the signing secret), for requests to the gateway.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Call:
    method: str
    body: dict[str, Any]
    status: int = 200
    ok: bool = True


@dataclass
class Message:
    channel: str
    ts: str
    thread_ts: str | None
    text: str = ""
    blocks: list[Any] = field(default_factory=list)
    streaming: bool = False
    chunks: list[Any] = field(default_factory=list)
    ephemeral_to: str | None = None


class FakeSlack:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.messages: dict[str, Message] = {}
        self.errors: dict[str, str] = {}
        self.fail_all: str | None = None
        self.refuse_blocks: str | None = None
        self.rate_limit: dict[str, int] = {}
        self.retry_after_s = 1
        self.limited = threading.Event()
        """Set when a call was answered 429 (the caller is now waiting out ``Retry-After``)."""
        self.lock = threading.Lock()
        self._ts = itertools.count(1)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length).decode()
                if self.headers.get("Content-Type", "").startswith("application/json"):
                    body = json.loads(raw or "{}")
                else:
                    body = {k: v[0] for k, v in urllib.parse.parse_qs(raw).items()}
                method = self.path.rsplit("/", 1)[-1]
                status, answer, headers = fake.answer(method, body, self.headers.get("Authorization", ""))
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/"
        self._serving = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._serving.start()
        self.tokens: set[str] = set()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # --- answering ---------------------------------------------------------------------------

    def answer(self, method: str, body: dict[str, Any], auth: str) -> tuple[int, dict[str, Any], dict[str, str]]:
        with self.lock:
            self.tokens.add(auth)
            if self.rate_limit.get(method, 0) > 0:
                self.rate_limit[method] -= 1
                self.calls.append(Call(method, body, 429, False))
                self.limited.set()
                return 429, {"ok": False, "error": "ratelimited"}, {"Retry-After": str(self.retry_after_s)}
            error = self.fail_all or self.errors.get(method) or (self.refuse_blocks if body.get("blocks") else None)
            if error:
                self.calls.append(Call(method, body, 200, False))
                return 200, {"ok": False, "error": error}, {}
            self.calls.append(Call(method, body))
            return 200, self._apply(method, body), {}

    def _new_ts(self) -> str:
        return f"{1700000000 + next(self._ts)}.000100"

    def _apply(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        channel = str(body.get("channel") or body.get("channel_id") or "")
        if method in ("chat.postMessage", "chat.startStream"):
            ts = self._new_ts()
            streaming = method == "chat.startStream"
            text = body.get("markdown_text", "") if streaming else body.get("text", "")
            self.messages[ts] = Message(channel, ts, body.get("thread_ts"), text, body.get("blocks") or [], streaming)
            return {"ok": True, "channel": channel, "ts": ts}
        if method == "chat.postEphemeral":
            ts = self._new_ts()
            self.messages[ts] = Message(channel, ts, body.get("thread_ts"), body.get("text", ""),
                                        ephemeral_to=body.get("user"))  # fmt: skip
            return {"ok": True, "message_ts": ts}
        ts = str(body.get("ts", ""))
        if method in ("chat.appendStream", "chat.stopStream", "chat.update"):
            message = self.messages.get(ts)
            if message is None:
                return {"ok": False, "error": "message_not_found"}
            if method == "chat.update":
                message.text, message.blocks, message.streaming = body.get("text", ""), body.get("blocks") or [], False
                return {"ok": True, "channel": channel, "ts": ts}
            if not message.streaming:
                return {"ok": False, "error": "message_not_in_streaming_state"}
            message.text += body.get("markdown_text", "") or ""
            message.chunks.extend(body.get("chunks") or [])
            if method == "chat.stopStream":
                message.streaming = False
            return {"ok": True, "channel": channel, "ts": ts}
        return {"ok": True}

    # --- reading -------------------------------------------------------------------------------

    def methods(self) -> list[str]:
        with self.lock:
            return [c.method for c in self.calls]

    def of(self, method: str) -> list[dict[str, Any]]:
        with self.lock:
            return [c.body for c in self.calls if c.method == method]

    def thread(self, channel: str, thread_ts: str) -> list[Message]:
        """The messages everyone sees in a thread (not ephemeral ones), oldest first."""
        with self.lock:
            return [
                m for m in self.messages.values()
                if m.channel == channel and m.thread_ts == thread_ts and m.ephemeral_to is None
            ]  # fmt: skip

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()
            self.messages.clear()
            self.errors.clear()
            self.fail_all = None
            self.refuse_blocks = None
            self.rate_limit.clear()


def signed(secret: str, body: bytes, *, timestamp: int | None = None) -> dict[str, str]:
    """The headers Slack sends with a request: its timestamp and ``v0=`` HMAC-SHA256 of ``v0:<ts>:<body>``."""
    ts = str(int(time.time()) if timestamp is None else timestamp)
    digest = hmac.new(secret.encode(), f"v0:{ts}:".encode() + body, hashlib.sha256).hexdigest()
    return {"X-Slack-Request-Timestamp": ts, "X-Slack-Signature": f"v0={digest}"}
