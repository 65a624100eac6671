"""Helpers of the gateway tests: the app served by uvicorn on a loopback port, and reading SSE with httpx."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from june_worker.gateway.backend import GatewayBackend
from june_worker.gateway.client import SSEMessage, parse_sse
from tests._budgets import PROCESS_START_S
from tests.integration.conftest import Stack, wait_for

TERMINAL = {"turn.completed", "turn.failed", "turn.cancelled", "input.requested"}


class ServedApp:
    """An ASGI app served by a real uvicorn server in a thread, on a free loopback port."""

    def __init__(self, app: Any, *, access_log: bool = True) -> None:
        # uvicorn with access_log=False cuts uvicorn.access off the root logger for the whole process: put it
        # back on stop, so that a later test reading the access log (tests/gateway/test_edges.py) still can
        access = logging.getLogger("uvicorn.access")
        self._access = (access.propagate, list(access.handlers))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            lifespan="on",
            log_config=None,  # records go to the root logger, where the tests read them
            access_log=access_log,
            ws="none",
            loop="asyncio",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(
            lambda: self.server.started or not self.thread.is_alive(),
            timeout_s=PROCESS_START_S,
            what="uvicorn to start",
        )
        if not self.server.started:
            raise AssertionError("uvicorn did not start; see the log")
        self._sock = sock

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self._sock.close()
        access = logging.getLogger("uvicorn.access")
        access.propagate, access.handlers = self._access[0], list(self._access[1])


class LogCapture(logging.Handler):
    """Every record logged in the process while attached, formatted (message and traceback)."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []
        self._lock2 = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_text:  # formatted (and scrubbed) already by june's log filter
            text += "\n" + record.exc_text
        elif record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        with self._lock2:
            self.lines.append(text)

    def text(self) -> str:
        with self._lock2:
            return "\n".join(self.lines)


@dataclass
class Gateway:
    """The served gateway of the test package, its stack, and the tokens it knows."""

    url: str
    app: FastAPI
    stack: Stack
    tokens: dict[str, str]
    logs: LogCapture
    clients: list[httpx.Client] = field(default_factory=list)

    @property
    def backend(self) -> GatewayBackend:
        backend: GatewayBackend = self.app.state.backend
        return backend

    def auth(self, who: str = "op") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}

    def client(self, who: str | None = "op", **kwargs: Any) -> httpx.Client:
        headers = self.auth(who) if who else {}
        client = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(60, connect=5), **kwargs)
        self.clients.append(client)
        return client

    @staticmethod
    def path(agent: str, session: str, suffix: str = "") -> str:
        return f"/v1/agents/{agent}/sessions/{session}{suffix}"


def read_events(response: httpx.Response, *, until_terminal: str | None = None) -> Iterator[SSEMessage]:
    """SSE messages of a streamed response; with ``until_terminal``, stop after that turn's terminal event."""
    for message in parse_sse(response.iter_lines()):
        yield message
        if until_terminal is not None and message.event in TERMINAL and message.json()["turn_id"] == until_terminal:
            return


def sse_headers(gw: Gateway, who: str = "op", last_event_id: str | None = None) -> dict[str, str]:
    headers = {**gw.auth(who), "Accept": "text/event-stream"}
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    return headers


def stream_entries(stack: Stack, agent: str, session: str, turn_id: str) -> list[dict[str, Any]]:
    """The turn's entries in the session's Redis stream, as the worker wrote them (with ``id``)."""
    return [e for e in stack.events(agent, session) if e["turn_id"] == turn_id]


def wait_event(gw: Gateway, agent: str, session: str, turn_id: str, kind: str, timeout_s: float = 30) -> dict[str, Any]:
    """The first ``kind`` event of the turn in the session's stream, waited for."""

    def found() -> dict[str, Any] | None:
        return next((e for e in stream_entries(gw.stack, agent, session, turn_id) if e["type"] == kind), None)

    return wait_for(found, timeout_s=timeout_s, what=f"{kind} of {turn_id}")
