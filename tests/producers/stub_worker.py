"""A stand-in june worker for the producer tests: tasks named june.resume / june.cancel / june.reset that
answer with canned summaries in the worker's format, chosen by the payload.

Started by the ``stub_worker`` fixture as a real ``celery worker`` process (solo pool) on a control
queue of its own. Configured by ``STUB_BROKER_URL`` (broker and result backend), ``STUB_KEY_PREFIX``
(the stream prefix) and ``STUB_READY_FILE`` (written when the worker is ready). Imports nothing of
june_worker.

* ``june.resume``: value ``"deny"`` → forbidden, ``"stale"`` → conflict, ``"bogus"`` → an unknown status;
  anything else → accepted, and the turn's continuation (started, text, completed) is appended to the
  session stream, as a worker resuming it would. Every answer echoes the payload it got under ``echo``.
* ``june.cancel``: turn ``t_boom`` → the task raises; a turn → ``cancelled`` that turn; none → all of
  ``t_a`` and ``t_b``.
* ``june.reset``: sessions starting with ``busy`` → pending, ``parked`` → rejected, else reset to a new
  generation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready

BROKER = os.environ["STUB_BROKER_URL"]
PREFIX = os.environ.get("STUB_KEY_PREFIX", "june")

app = Celery("june-stub", broker=BROKER, backend=BROKER, set_as_current=True)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_accept_content=["json"],
    worker_enable_remote_control=False,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@worker_ready.connect
def _ready(**_: Any) -> None:
    Path(os.environ["STUB_READY_FILE"]).write_text("ready")


def _append(payload: dict[str, Any], type: str, seq: int | None, **fields: Any) -> None:
    agent, session = payload["agent"], payload["session"]
    data = {"agent": agent, "session": session, "turn_id": payload["turn_id"], "seq": seq, "type": type, **fields}
    client = redis.Redis.from_url(BROKER)
    try:
        client.xadd(f"{PREFIX}:events:{{{agent}:{session}}}", {"type": type, "data": json.dumps(data)})
    finally:
        client.close()


@app.task(name="june.resume")
def resume(payload: dict[str, Any]) -> dict[str, Any]:
    value = payload.get("value")
    turn_id = payload["turn_id"]
    if value == "deny":
        return {"status": "forbidden", "reason": "U0 may not answer this request", "turn_id": turn_id, "echo": payload}
    if value == "stale":
        return {"status": "conflict", "reason": "the request was already answered", "turn_id": turn_id}
    if value == "bogus":
        return {"status": "maybe", "reason": None, "turn_id": turn_id}
    # seq 7 on: right after the six events of kit.script(end="input.requested"), as a stream's seqs have no holes
    _append(
        payload, "turn.started", 7, trigger={"kind": "resume", "call_id": "call_2", "input_id": payload["input_id"]}
    )
    _append(payload, "message.completed", 8, step="model:3", text="Refunded.")
    _append(payload, "turn.completed", 9, text="Refunded.", usage=None)
    return {"status": "accepted", "reason": None, "turn_id": turn_id, "echo": payload}


@app.task(name="june.cancel")
def cancel(payload: dict[str, Any]) -> dict[str, Any]:
    turn_id = payload.get("turn_id")
    if turn_id == "t_boom":
        raise RuntimeError("stub failure while cancelling")
    return {"status": "cancelled", "turn_ids": [turn_id] if turn_id else ["t_a", "t_b"]}


@app.task(name="june.reset")
def reset(payload: dict[str, Any]) -> dict[str, Any]:
    session = payload["session"]
    if session.startswith("busy"):
        return {"status": "pending", "reason": "a turn is running; the reset follows it"}
    if session.startswith("parked"):
        return {"status": "rejected", "reason": "the session waits for input"}
    return {"status": "reset", "previous_session": f"{session}#g0", "generation": 1}
