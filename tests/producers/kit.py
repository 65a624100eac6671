"""Helpers of the producer tests: stream entries written exactly as the worker writes them, and broker
messages read back exactly as a worker would receive them.

Entries mirror ``june_worker/events/redis_stream.py``: fields ``type`` and ``data``, where ``data`` is
compact JSON starting with ``agent`` and ``session``, then the event's own snake_case fields
(``turn_id``, ``seq`` (null for deltas), ``type``, ...). This module imports nothing of june_worker
either: the producers' tests check the wire format, not the engine's models.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

WAIT_S = 15.0
T = TypeVar("T")


def encode(agent: str, session: str, type: str, turn_id: str, seq: int | None, **fields: Any) -> str:
    data = {"agent": agent, "session": session, "turn_id": turn_id, "seq": seq, "type": type, **fields}
    return json.dumps(data, separators=(",", ":"))


def add_event(
    client: redis.Redis,
    stream: str,
    agent: str,
    session: str,
    type: str,
    turn_id: str,
    seq: int | None = None,
    **fields: Any,
) -> str:
    """XADD one event the way RedisStreamSink does; returns its stream id."""
    return str(client.xadd(stream, {"type": type, "data": encode(agent, session, type, turn_id, seq, **fields)}))


Event = tuple[str, int | None, dict[str, Any]]
"""(type, seq or None for a delta, the event's other fields)."""


def script(turn_id: str, first_seq: int = 1, *, end: str = "turn.completed") -> list[Event]:
    """A turn's events in order: start, streamed text, a tool call, more text, and its end."""
    s = first_seq
    call = {"id": "call_1", "name": "create_order", "input": {"item": "book"}}
    events: list[Event] = [
        ("turn.started", s, {"trigger": {"kind": "inbound", "event": {"source": "cli", "user": {"id": "U1"}}}}),
        ("message.delta", None, {"step": "model:1", "text": "Let me "}),
        ("message.delta", None, {"step": "model:1", "text": "order it."}),
        ("message.completed", s + 1, {"step": "model:1", "text": "Let me order it."}),
        ("action.requested", s + 2, {"step": "tool:1:call_1", "call": call}),
        ("action.completed", s + 3, {"step": "tool:1:call_1", "call": call, "result": {"item": "book"}, "error": None}),
        ("message.delta", None, {"step": "model:2", "text": "Done."}),
        ("message.completed", s + 4, {"step": "model:2", "text": "Done."}),
    ]
    if end == "turn.completed":
        events.append(("turn.completed", s + 5, {"text": "Done.", "usage": {"input_tokens": 12, "output_tokens": 5}}))
    elif end == "input.requested":
        request = {
            "id": "approve",
            "prompt": "Refund 5 on 42?",
            "schema": {"type": "boolean"},
            "answerers": {"user": "U9"},
        }
        events.append(("input.requested", s + 5, {"step": "tool:2:call_2", "request": request}))
    elif end == "turn.failed":
        events.append(("turn.failed", s + 5, {"error": {"message": "model overloaded"}, "phase": "model"}))
    elif end == "turn.cancelled":
        events.append(("turn.cancelled", s + 5, {"reason": "requested"}))
    return events


def write_script(
    client: redis.Redis, stream: str, agent: str, session: str, turn_id: str, events: list[Event]
) -> list[str]:
    return [add_event(client, stream, agent, session, t, turn_id, seq, **f) for t, seq, f in events]


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` when it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def returns_within(call: Callable[[], T], within_s: float, what: str) -> T:
    """``call()``'s value (or exception), failing with a message naming ``what`` when it has not returned within
    ``within_s``: a hang fails the test at that bound, long before pytest's timeout. Not a speed check: the
    bound is a generous multiple of what the call's own settings allow. The call runs in a daemon thread,
    left behind if it hangs."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed back to the test's thread below
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=f"returns-within: {what}", daemon=True)
    thread.start()
    thread.join(within_s)
    if thread.is_alive():
        raise AssertionError(
            f"{what} had not returned after {within_s:g}s, far past what its timeout and retries allow: it hangs"
        )
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True)
class BrokerMessage:
    """A Celery (protocol 2) message as it sits in a kombu Redis queue."""

    headers: dict[str, Any]
    properties: dict[str, Any]
    args: list[Any]
    kwargs: dict[str, Any]
    raw: str

    @property
    def task(self) -> str:
        return str(self.headers["task"])


def pop_message(client: redis.Redis, queue: str, timeout_s: float = 5.0) -> BrokerMessage:
    """Take the oldest message of ``queue`` (kombu LPUSHes and consumers BRPOP) and decode it."""
    reply: Any = client.brpop([queue], timeout=timeout_s)
    assert reply is not None, f"no message arrived in queue {queue!r} within {timeout_s}s"
    raw = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
    envelope = json.loads(raw)
    assert envelope["content-type"] == "application/json", envelope["content-type"]
    assert envelope["properties"]["body_encoding"] == "base64"
    args, kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
    return BrokerMessage(envelope["headers"], envelope["properties"], args, kwargs, raw)


def queue_keys(*queues: str) -> list[str]:
    """The Redis keys kombu makes for a queue: the list itself and its bindings."""
    keys: list[str] = []
    for q in queues:
        keys += [q, f"_kombu.binding.{q}", f"_kombu.binding_permanent.{q}"]
    return keys
