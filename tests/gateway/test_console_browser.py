"""The operator console at ``/console`` in headless Chromium (Debian's ``chromium``, as test_browser.py drives it).

The inbox lists a parked approval with its prompt and who may answer; Approve by an operator the
agent lets answer resumes the turn (and the live feed takes it out of the inbox); the same click by
an operator the agent refuses shows the refusal and leaves the turn parked; a failed turn shows its
error, and its timeline the failing event; a turn refused at intake is listed among them with its
reason, and a session whose only turn was refused is shown ``rejected``. A screenshot (a parked approval, a failed turn, a
timeline) is saved in the test's temp dir, and to ``docs/console.png`` with
``JUNE_GATEWAY_SCREENSHOT=docs``. Console errors fail the test. All fail on main (d2b81ad): no console.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, Route, expect

from tests.integration.conftest import ROOT, wait_for

from .console_kit import console_gateway, console_stack
from .kit import Gateway
from .test_browser import browser, deliver_held, hold_replies, wait_held

__all__ = ["browser", "console_gateway", "console_stack"]  # fixtures, imported for pytest


@pytest.fixture
def open_console(browser: Browser, console_gateway: Gateway) -> Iterator[Callable[[str], Page]]:
    contexts, errors = [], []

    def open_as(who: str) -> Page:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        contexts.append(context)
        page = context.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "403" not in m.text else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(30_000)
        page.goto(console_gateway.url + "/console")
        page.fill("#token", console_gateway.tokens[who])
        page.click("#use-token")
        expect(page.locator("#live")).to_have_text("live")
        return page

    try:
        yield open_as
    finally:
        for context in contexts:
            context.close()
    assert errors == [], errors


def _parked(gw: Gateway) -> tuple[str, str]:
    session = f"web-{uuid.uuid4().hex[:8]}"
    r = gw.client("admin").post(gw.path("ops", session, "/turns"), json={"text": "refund"}, params={"wait": 1})
    assert r.json()["status"] == "suspended"
    return session, str(r.json()["turn_id"])


def test_the_inbox_lists_a_parked_approval_and_approve_by_a_permitted_operator_resumes_it(
    open_console: Callable[[str], Page], console_gateway: Gateway
) -> None:
    gw = console_gateway
    page = open_console("admin")
    session, turn_id = _parked(gw)  # parked after the page opened: the live feed brings it in
    row = page.locator(f"#inbox tr.approval[data-turn='{turn_id}']")
    expect(row.locator(".prompt")).to_have_text("Refund 5.0?")
    expect(row.locator(".who")).to_have_text("policy operator")
    expect(row).to_contain_text(f"ops · {session}")
    row.get_by_role("button", name="Approve").click()
    expect(row.locator(".act")).to_have_text("approved: resuming")
    expect(page.locator(f"#inbox tr.approval[data-turn='{turn_id}']")).to_have_count(0)  # live: gone from the inbox

    def completed() -> dict[str, Any] | None:
        turn: dict[str, Any] = gw.client("admin").get(gw.path("ops", session, f"/turns/{turn_id}")).json()
        return turn if turn["status"] == "completed" else None

    done = wait_for(completed, timeout_s=30, what="the approved turn to complete")
    assert done["result"]["text"] == "Done: approve -> {'refunded': True}"


def test_approve_by_an_operator_the_agent_refuses_shows_why_and_leaves_the_turn_parked(
    open_console: Callable[[str], Page], console_gateway: Gateway
) -> None:
    gw = console_gateway
    session, turn_id = _parked(gw)
    page = open_console("mallory")
    row = page.locator(f"#inbox tr.approval[data-turn='{turn_id}']")
    row.get_by_role("button", name="Approve").click()
    expect(row.locator(".row-error")).to_contain_text("403")
    expect(row.locator(".row-error")).to_contain_text("not authorized")
    pending = gw.client("admin").get(gw.path("ops", session, "/pending")).json()["pending"]
    assert pending is not None and pending["turn_id"] == turn_id


def test_a_failed_turn_shows_its_error_and_its_timeline(
    open_console: Callable[[str], Page], console_gateway: Gateway, tmp_path: Path
) -> None:
    gw = console_gateway
    _parked(gw)  # something in the inbox for the screenshot
    page = open_console("admin")
    session = f"web-{uuid.uuid4().hex[:8]}"
    r = gw.client("admin").post(gw.path("boom", session, "/turns"), json={"text": "go"}, params={"wait": 1})
    turn_id = r.json()["turn_id"]
    row = page.locator(f"#failed tr.failed[data-turn='{turn_id}']")  # brought in by the live feed
    expect(row.locator(".error")).to_have_text("RuntimeError: model exploded (dependency skew)")
    expect(row.locator(".phase")).to_have_text("model · model:1")
    row.click()
    expect(page.locator("#timeline-title")).to_have_text(f"boom · {session} · {turn_id}")
    expect(page.locator("#timeline-summary")).to_contain_text("failed at model model:1")
    expect(page.locator("#timeline-events")).to_contain_text("turn.failed")
    expect(page.locator("#timeline-events")).to_contain_text("RuntimeError: model exploded (dependency skew)")
    shot = tmp_path / "console.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("JUNE_GATEWAY_SCREENSHOT") == "docs":
        shutil.copyfile(shot, ROOT / "docs" / "console.png")


def test_an_empty_console_says_in_words_what_each_list_will_hold(
    browser: Browser, database_url: str, redis_url: str, tmp_path: Path
) -> None:
    from june_worker.gateway import GatewaySettings, Principal, TokenTable, create_app
    from tests.integration.conftest import _database

    from .kit import ServedApp

    # Given a console over a database nothing was ever sent to
    databases = _database(database_url)
    token = f"empty-console-{uuid.uuid4().hex}"
    settings = GatewaySettings(
        agents=("ops",), tokens=TokenTable.of({token: Principal("op-erin", None, operator=True)}),
        database_url=next(databases), redis_url=redis_url, key_prefix=f"june-empty-{uuid.uuid4().hex[:8]}",
    )  # fmt: skip
    served = ServedApp(create_app(settings))
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.goto(served.url + "/console")
        # Then before signing in, each list says how to fill it
        for name in ("inbox", "failed", "sessions"):
            expect(page.locator(f"#{name} .empty")).to_have_text(
                "Sign in with an operator's token (above) to see this list."
            )
        shot = tmp_path / "console-signed-out.png"
        page.screenshot(path=str(shot), full_page=True)
        # When an operator signs in
        page.fill("#token", token)
        page.click("#use-token")
        expect(page.locator("#live")).to_have_text("live")
        # Then each empty list says what it will hold, not a blank table
        expect(page.locator("#inbox .empty")).to_contain_text("No turn is waiting for an answer")
        expect(page.locator("#failed .empty")).to_contain_text("No failed turn")
        expect(page.locator("#sessions .empty")).to_contain_text("No session yet")
        shot = tmp_path / "console-empty.png"
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("JUNE_GATEWAY_SCREENSHOT") == "docs":
            shutil.copyfile(shot, ROOT / "docs" / "console-empty.png")
    finally:
        context.close()
        served.stop()
        databases.close()


def _rejected(gw: Gateway) -> tuple[str, str]:
    """A session whose only turn a worker refused at intake (its text is not a string)."""
    session, turn_id = f"web-{uuid.uuid4().hex[:8]}", f"t_{uuid.uuid4().hex}"
    gw.stack.send("june.turn", {"turn_id": turn_id, "agent": "ops", "session": session, "text": ["not", "text"]})
    return session, turn_id


def test_a_rejected_turn_is_listed_among_failed_turns_with_its_reason(
    open_console: Callable[[str], Page], console_gateway: Gateway
) -> None:
    # Given the console open
    page = open_console("admin")

    # When a worker refuses a turn at intake
    _, turn_id = _rejected(console_gateway)

    # Then the live feed brings it into the failed turns, marked rejected, with the worker's reason
    row = page.locator(f"#failed tr.failed[data-turn='{turn_id}']")
    expect(row.locator(".error")).to_contain_text("rejected: ")
    expect(row.locator(".error")).to_contain_text("text: Input should be a valid string")
    expect(row.locator(".phase")).to_have_text("intake")


def test_a_session_whose_only_turn_was_rejected_is_shown_rejected(
    open_console: Callable[[str], Page], console_gateway: Gateway
) -> None:
    # Given the console open
    page = open_console("admin")

    # When a worker refuses the only turn of a new session
    session, _ = _rejected(console_gateway)

    # Then the sessions list shows it rejected, and so does the list filtered by that status
    row = page.locator(f"#sessions tr.session[data-session='{session}'] .status")
    expect(row).to_have_text("rejected")
    with page.expect_response(lambda r: "/v1/console/sessions?" in r.url and "status=rejected" in r.url):
        page.select_option("#status-filter", "rejected")
    expect(row).to_have_text("rejected")


def test_an_inbox_read_that_answers_after_a_newer_one_does_not_bring_back_what_is_gone(
    open_console: Callable[[str], Page], console_gateway: Gateway
) -> None:
    gw = console_gateway
    page = open_console("admin")
    first, first_turn = _parked(gw)
    expect(page.locator(f"#inbox tr.approval[data-turn='{first_turn}']")).to_have_count(1)
    # Given a read of the inbox answered while the first approval was open, but not yet delivered to the page
    held = hold_replies(page, "**/v1/console/approvals*", first_only=True)
    _, second_turn = _parked(gw)  # the live feed's change makes the page read the inbox again
    wait_held(page, held, "read of the inbox")
    # When the first approval is answered elsewhere, a newer read shows it gone, and only then the old read arrives
    input_id = gw.client("admin").get(gw.path("ops", first, "/pending")).json()["pending"]["input"]["id"]
    r = gw.client("admin").post(
        gw.path("ops", first, f"/turns/{first_turn}/resume"), json={"input_id": input_id, "value": True}
    )
    assert r.status_code < 300, r.text
    expect(page.locator(f"#inbox tr.approval[data-turn='{second_turn}']")).to_have_count(1)
    expect(page.locator(f"#inbox tr.approval[data-turn='{first_turn}']")).to_have_count(0)
    deliver_held(page, held, "/v1/console/approvals")
    # Then the page keeps the newer list: the answered approval does not come back
    expect(page.locator(f"#inbox tr.approval[data-turn='{first_turn}']")).to_have_count(0)
    expect(page.locator(f"#inbox tr.approval[data-turn='{second_turn}']")).to_have_count(1)


def test_an_approval_answered_while_the_inbox_is_redrawn_still_says_so(
    open_console: Callable[[str], Page], console_gateway: Gateway
) -> None:
    gw = console_gateway
    page = open_console("admin")
    session, turn_id = _parked(gw)
    row = page.locator(f"#inbox tr.approval[data-turn='{turn_id}']")
    expect(row.get_by_role("button", name="Approve")).to_have_count(1)
    # Given an Approve whose request is held in flight while the inbox is drawn again (another approval arrives)
    held: list[Route] = []
    page.route("**/resume", lambda route: held.append(route))
    row.get_by_role("button", name="Approve").click()
    wait_held(page, held, "resume")
    _, other = _parked(gw)
    expect(page.locator(f"#inbox tr.approval[data-turn='{other}']")).to_have_count(1)  # drawn again
    # When the resume goes through
    with page.expect_response(lambda r: r.url.endswith("/resume")):
        held[0].continue_()
    # Then the row drawn meanwhile says it was approved, and offers no button to answer it again
    expect(row.locator(".act")).to_have_text("approved: resuming")
    expect(row.get_by_role("button")).to_have_count(0)
