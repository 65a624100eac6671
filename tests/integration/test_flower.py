"""Flower (the `flower` extra) shows june tasks with their turn ids, and never their text.

The last test opens Flower's Tasks page in headless Chromium (Debian's ``chromium``, as tests/gateway/test_browser.py
drives it) and saves a screenshot in the test's temp dir, and to ``docs/flower.png`` with
``JUNE_GATEWAY_SCREENSHOT=docs`` (the convention of the gateway's screenshots).
"""

from __future__ import annotations

import base64
import json
import re
import socket
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, expect

from tests._budgets import PROCESS_START_S
from tests.gateway.test_browser import browser, screenshot

from .conftest import Proc, Stack, wait_for

__all__ = ["browser"]  # a fixture, imported for pytest

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
    base = _flower(stack)
    secret_text = "order 7 widget for account 4111-1111-1111-1111"
    turn_id = stack.producer().start_turn("ops", session_id, secret_text)

    def listed() -> dict[str, Any] | None:
        tasks = _get(f"{base}/api/tasks?limit=200") or {}
        for task in tasks.values():
            if task.get("name") == "june.turn" and turn_id in str(task.get("args")) and task.get("state") == "SUCCESS":
                return dict(task)
        return None

    task = wait_for(listed, timeout_s=60, every_s=0.2, what="flower to list the turn")
    assert turn_id in task["args"] and session_id in task["args"]
    # neither the arguments nor the result carry the text (the card number, whole: a timestamp may hold "4111")
    assert "4111-1111-1111-1111" not in json.dumps(task) and "widget for account" not in json.dumps(task)
    assert turn_id in str(task["result"])


def _flower(stack: Stack, *options: str, probe: bool = True) -> str:
    """A Flower of this stack's app; with ``probe``, once it lists task events (a probe turn of its own is listed)."""
    port = _free_port()
    args = [sys.executable, "-m", "celery", "-A", "june_worker", "flower", f"--port={port}", "--address=127.0.0.1",
            "--basic-auth=ops:flower-test", *options]  # fmt: skip
    stack.procs.append(Proc(f"flower-{port}", args, stack.env, stack.tmp / f"flower-{port}.log"))
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _body(f"{base}/healthcheck") == b"OK", timeout_s=PROCESS_START_S, what="flower to listen")
    if not probe:
        return base
    # Flower answers its health check before it listens to task events, and misses what is sent in between: a probe
    # turn, sent again until Flower lists one, says it listens (the tests' own turns come after)
    session = f"flower-probe-{port}"

    def listening() -> bool:
        stack.producer().start_turn("ops", session, "probe")
        # any probe so far: on a busy machine one sent before may be listed only now
        seen = lambda: any(session in str(t.get("args")) for t in (_get(f"{base}/api/tasks?limit=500") or {}).values())  # noqa: E731
        try:
            wait_for(seen, timeout_s=5, every_s=0.2, what="a probe")
        except AssertionError:
            return False
        return True

    wait_for(listening, timeout_s=PROCESS_START_S, every_s=0.1, what="flower to list task events")
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

    task = wait_for(parked, timeout_s=60, every_s=0.2, what="flower to show the turn PARKED")
    assert task["name"] == "june.turn"

    def scheduled() -> str | None:
        for t in tasks():
            found = ULID_TURN_ID.search(str(t.get("args"))) if t.get("name") == "june.proactive" else None
            if found and t.get("state") == "SUCCESS" and digest in str(t.get("args")):
                return found.group(1)
        return None

    turn_id = wait_for(scheduled, timeout_s=60, every_s=0.2, what="flower to list a scheduled turn by its id")
    assert stack.sql("select status from june_turns where turn_id = %s", turn_id) == [("completed",)]
    # the sweeper ran all along, on the same worker, and Flower lists none of it
    wait_for(lambda: worker.log.read_text().count("] succeeded in") and "june.sweep[" in worker.log.read_text()
             and worker.log.read_text().count("june.sweep[") >= 4, timeout_s=60, what="two sweeps")  # fmt: skip
    assert not [t for t in tasks() if t.get("name") == "june.sweep"]


# The Tasks page's columns with the arguments and the result (Flower's default shows neither), as docker-compose.yml
# sets FLOWER_TASKS_COLUMNS
COLUMNS = "name,state,args,result,received,runtime,worker"
NAME, STATE, ARGS, RESULT = 0, 1, 2, 3  # their cells in a row


def test_flowers_tasks_page_shows_turns_by_id_a_parked_one_a_scheduled_one_and_no_sweeps(
    stack: Stack, session_id: str, browser: Browser, tmp_path: Path
) -> None:
    """What an operator sees on Flower's Tasks page: a turn by its id (its text nowhere on the page), a parked turn
    PARKED, a scheduled turn with its ULID turn id, and none of the sweeps the worker ran meanwhile."""
    stack.stop()  # the module's earlier workers, beats and Flowers: only this test's tasks on the page
    worker = stack.worker("flowered-page", pool="solo")
    base = _flower(stack, f"--tasks_columns={COLUMNS}", probe=False)  # (no probe row on the page: see below)
    digest = f"{session_id}-digest"
    beat = stack.beat(env={"JUNE_EXAMPLE_SCHEDULE": "1", "JUNE_EXAMPLE_SCHEDULE_EVERY_S": "1",
                           "JUNE_EXAMPLE_SESSION": digest})  # fmt: skip

    def tasks() -> list[dict[str, Any]]:
        return list((_get(f"{base}/api/tasks?limit=500") or {}).values())

    def listed(name: str, state: str, arg: str) -> bool:
        return any(t.get("name") == name and t.get("state") == state and arg in str(t.get("args")) for t in tasks())

    # Flower answers its healthcheck before it listens to the task events (and misses what is sent meanwhile): the
    # turns are sent once it has listed a scheduled one
    wait_for(lambda: listed("june.proactive", "SUCCESS", digest), timeout_s=60, every_s=0.2, what="a scheduled turn")
    secret_text = "order 7 widget for account 4111-1111-1111-1111"
    done_turn = stack.producer().start_turn("ops", session_id, secret_text)
    parked_turn = stack.producer().start_turn("ops", f"{session_id}-parks", "refund it")  # asks for approval
    wait_for(lambda: listed("june.turn", "SUCCESS", done_turn) and listed("june.turn", "PARKED", parked_turn),
             timeout_s=60, every_s=0.2, what="flower to have the turn and the parked turn")  # fmt: skip
    # two more sweeps after Flower showed events (so it was listening), each logged when received and when done
    swept = worker.log.read_text().count("june.sweep[")
    wait_for(lambda: worker.log.read_text().count("june.sweep[") >= swept + 4, timeout_s=60, what="two more sweeps")
    beat.stop()  # no more scheduled turns: the page holds still for the screenshot

    context = browser.new_context(
        viewport={"width": 1700, "height": 600}, http_credentials={"username": "ops", "password": "flower-test"}
    )
    errors: list[str] = []
    try:
        page = context.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(30_000)
        page.goto(f"{base}/tasks")
        page.select_option("#tasks-table_length select", "100")  # every task of the test on one page
        rows = page.locator("#tasks-table tbody tr")  # filled by DataTables from /tasks/datatable: expect waits
        # a turn, by its id in its arguments and its result
        turn = rows.filter(has_text=done_turn)
        expect(turn).to_have_count(1)
        expect(turn.locator("td").nth(NAME)).to_have_text("june.turn")
        expect(turn.locator("td").nth(STATE)).to_have_text("SUCCESS")
        expect(turn.locator("td").nth(ARGS)).to_have_text(f"{{turn_id={done_turn} agent=ops session={session_id}}}")
        expect(turn.locator("td").nth(RESULT)).to_contain_text(done_turn)
        # a parked turn is PARKED, not a green SUCCESS
        parked = rows.filter(has_text=parked_turn)
        expect(parked.locator("td").nth(NAME)).to_have_text("june.turn")
        expect(parked.locator("td").nth(STATE)).to_have_text("PARKED")
        # a scheduled turn carries a ULID turn id, as every other turn
        scheduled = rows.filter(has_text=digest).first
        expect(scheduled.locator("td").nth(NAME)).to_have_text("june.proactive")
        expect(scheduled.locator("td").nth(STATE)).to_have_text("SUCCESS")
        expect(scheduled.locator("td").nth(ARGS)).to_have_text(ULID_TURN_ID)
        # every row on the page is a turn (the sweeps, every 0.5 s and newest, would be first), and all are shown
        shown = rows.count()
        names = {rows.nth(i).locator("td").nth(NAME).inner_text() for i in range(shown)}
        assert names == {"june.turn", "june.proactive"}, names
        expect(page.locator("#tasks-table_info")).to_have_text(f"Showing 1 to {shown} of {shown} tasks")
        # the turns' text is nowhere on the page (the card number whole: a timestamp may hold "4111")
        html = page.content()
        assert "4111-1111-1111-1111" not in html and "widget for account" not in html and "refund it" not in html
        screenshot(page, tmp_path, "flower.png")
        # an operator finds a turn by its id with Flower's search box
        page.fill("#tasks-table_filter input", done_turn)
        expect(rows).to_have_count(1)
        expect(rows.first.locator("td").nth(ARGS)).to_contain_text(done_turn)
        # and Flower's own search finds no sweep at all
        page.fill("#tasks-table_filter input", "name:june.sweep")
        expect(page.locator("#tasks-table tbody")).to_have_text("No tasks match your search.")
    finally:
        context.close()
    assert errors == [], errors
