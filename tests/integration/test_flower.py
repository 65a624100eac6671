"""Flower (the `flower` extra) shows june tasks with their turn ids, and never their text."""

from __future__ import annotations

import base64
import json
import re
import socket
import sys
import urllib.request
from typing import Any

import pytest

from .conftest import Proc, Stack, wait_for

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


AUTH = "Basic " + base64.b64encode(b"ops:flower-test").decode()


def _body(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers={"Authorization": AUTH}), timeout=2
        ) as response:
            return bytes(response.read())
    except OSError:
        return None


def _get(url: str) -> Any:
    body = _body(url)
    return json.loads(body) if body else None


def test_flower_lists_june_tasks_by_turn_id_without_their_text(stack: Stack, session_id: str) -> None:
    stack.worker("flowered", pool="solo")
    port = _free_port()
    args = [sys.executable, "-m", "celery", "-A", "june_worker", "flower", f"--port={port}", "--address=127.0.0.1",
            "--basic-auth=ops:flower-test"]  # fmt: skip
    flower = Proc("flower", args, stack.env, stack.tmp / "flower.log")
    stack.procs.append(flower)
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _body(f"{base}/healthcheck") == b"OK", timeout_s=30, what="flower to listen")
    secret_text = "order 7 widget for account 4111-1111-1111-1111"
    turn_id = stack.producer().start_turn("ops", session_id, secret_text)

    def listed() -> dict[str, Any] | None:
        tasks = _get(f"{base}/api/tasks?limit=200") or {}
        for task in tasks.values():
            if task.get("name") == "june.turn" and turn_id in str(task.get("args")) and task.get("state") == "SUCCESS":
                return dict(task)
        return None

    task = wait_for(listed, timeout_s=30, every_s=0.2, what="flower to list the turn")
    assert turn_id in task["args"] and session_id in task["args"]
    # neither the arguments nor the result carry the text (the card number, whole: a timestamp may hold "4111")
    assert "4111-1111-1111-1111" not in json.dumps(task) and "widget for account" not in json.dumps(task)
    assert turn_id in str(task["result"])


def _flower(stack: Stack) -> str:
    port = _free_port()
    args = [sys.executable, "-m", "celery", "-A", "june_worker", "flower", f"--port={port}", "--address=127.0.0.1",
            "--basic-auth=ops:flower-test"]  # fmt: skip
    stack.procs.append(Proc(f"flower-{port}", args, stack.env, stack.tmp / f"flower-{port}.log"))
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _body(f"{base}/healthcheck") == b"OK", timeout_s=30, what="flower to listen")
    return base


ULID_TURN_ID = re.compile(r"turn_id=(t_[0-9A-HJKMNP-TV-Z]{26})\b")


def test_a_parked_turn_a_scheduled_turn_and_no_sweeps_in_flower(stack: Stack, session_id: str) -> None:
    """An operator finds any turn in Flower by its id: a parked one is PARKED (not a green SUCCESS), a scheduled
    one carries its turn id (a ULID, as every other), and the sweeper (every 0.5 s here) is not listed at all."""
    worker = stack.worker("flowered-parks", pool="solo")
    base = _flower(stack)
    digest = f"{session_id}-digest"
    stack.beat(env={"JUNE_EXAMPLE_SCHEDULE": "1", "JUNE_EXAMPLE_SCHEDULE_EVERY_S": "1", "JUNE_EXAMPLE_SESSION": digest})
    parked_turn = stack.turn("ops", session_id, "refund it")

    def tasks() -> list[dict[str, Any]]:
        return list((_get(f"{base}/api/tasks?limit=500") or {}).values())

    def parked() -> dict[str, Any] | None:
        return next((t for t in tasks() if parked_turn in str(t.get("args")) and t.get("state") == "PARKED"), None)

    task = wait_for(parked, timeout_s=30, every_s=0.2, what="flower to show the turn PARKED")
    assert task["name"] == "june.turn"

    def scheduled() -> str | None:
        for t in tasks():
            found = ULID_TURN_ID.search(str(t.get("args"))) if t.get("name") == "june.proactive" else None
            if found and t.get("state") == "SUCCESS" and digest in str(t.get("args")):
                return found.group(1)
        return None

    turn_id = wait_for(scheduled, timeout_s=30, every_s=0.2, what="flower to list a scheduled turn by its id")
    assert stack.sql("select status from june_turns where turn_id = %s", turn_id) == [("completed",)]
    # the sweeper ran all along, on the same worker, and Flower lists none of it
    wait_for(lambda: worker.log.read_text().count("] succeeded in") and "june.sweep[" in worker.log.read_text()
             and worker.log.read_text().count("june.sweep[") >= 4, timeout_s=30, what="two sweeps")  # fmt: skip
    assert not [t for t in tasks() if t.get("name") == "june.sweep"]
