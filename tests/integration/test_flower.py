"""Flower (the `flower` extra) shows june tasks with their turn ids, and never their text."""

from __future__ import annotations

import base64
import json
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
