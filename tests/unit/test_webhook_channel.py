"""A second channel fits the seam without touching the engine: a webhook that POSTs finished runs to a URL.

Run in process (Runtime, SQLite store): the Channels hook is the agent's ``deliver``, as on a worker.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from june_worker import Agent, Runtime
from june_worker.channels import Channels, MemoryRenderState, RenderContext
from june_worker.channels.webhook import WebhookChannel
from june_worker.engine.events import Completed, MessageCompleted, TurnCompleted, TurnStarted
from june_worker.engine.types import ProactiveTrigger
from june_worker.errors import ChannelError
from june_worker.models import Reply, ScriptedModel
from june_worker.stores import SQLiteStore


class Receiver:
    def __init__(self) -> None:
        self.posts: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.status = 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.posts.append((dict(self.headers), body))
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


async def test_a_proactive_turn_is_posted_to_the_named_endpoint_once(receiver: Receiver) -> None:
    hook = Channels([WebhookChannel({"ops": receiver.url})])
    agent = Agent(name="ops", model=ScriptedModel([Reply("Three threads are open.")]), deliver=hook)
    runtime = Runtime([agent], SQLiteStore(":memory:"))
    session = runtime.session("ops", "digest")
    turn_id = await session.start(
        "Summarize", trigger=ProactiveTrigger(by="cron:daily"), target={"channel": "webhook", "endpoint": "ops"}
    )
    await session.result(turn_id)
    await runtime.aclose()
    (headers, body) = receiver.posts[0]
    assert body["text"] == "Three threads are open." and body["status"] == "completed" and body["turn_id"] == turn_id
    assert headers["Idempotency-Key"].startswith(f"{turn_id}:reply:")
    assert "url" not in json.dumps(body)
    # at least once: the same delivery again sends nothing new
    events = runtime.store.events(session.ref, turn_id=turn_id)
    hook(target={"channel": "webhook", "endpoint": "ops"}, result=Completed(turn_id=turn_id, text="x"), events=events,
         session="digest")  # fmt: skip
    assert len(receiver.posts) == 1


def test_a_5xx_is_retryable_and_a_4xx_is_not(receiver: Receiver) -> None:
    channel = WebhookChannel({"ops": receiver.url})
    events = [
        TurnStarted(turn_id="t1", trigger=ProactiveTrigger(), seq=1),
        MessageCompleted(turn_id="t1", step="model:1", text="hi", seq=2),
        TurnCompleted(turn_id="t1", text="hi", seq=3),
    ]
    for status, retryable in ((503, True), (404, False)):
        receiver.status = status
        state = MemoryRenderState()
        ctx = RenderContext(agent="ops", session="s", turn_id="t1", state=state)
        with pytest.raises(ChannelError) as caught:
            channel.renderer({"channel": "webhook", "endpoint": "ops"}, ctx).finish(
                events, Completed(turn_id="t1", text="hi")
            )
        assert caught.value.retryable is retryable
        assert state.get("reply") is None, "a failed POST is not recorded as delivered"


def test_a_target_naming_an_unknown_endpoint_says_so() -> None:
    channel = WebhookChannel({"ops": "http://127.0.0.1:9/hook"})
    ctx = RenderContext(agent="ops", session="s", turn_id="t1", state=MemoryRenderState())
    with pytest.raises(ChannelError, match="no webhook endpoint named 'billing'"):
        channel.renderer({"channel": "webhook", "endpoint": "billing"}, ctx)
