"""The live turn page at ``/`` in headless Chromium (Debian's ``chromium``, driven by Playwright; no browser download).

The page signs in with a pasted token, starts a turn that asks for approval, shows the prompt
with Approve / Deny, and sees the turn complete after Approve; it cancels a running turn; it
answers a JSON-schema form. A screenshot of the page mid-turn (parked, waiting for approval)
is saved in the test's temp dir, and to ``docs/gateway-page.png`` when
``JUNE_GATEWAY_SCREENSHOT=docs`` (how the committed one was made). Console errors (a Content
Security Policy violation, a script error) fail the test.

``make test`` installs Debian's chromium when /usr/bin/chromium is missing; without it this
test fails, it never skips.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Route, expect, sync_playwright

from tests.integration.conftest import ROOT

from .kit import Gateway

CHROMIUM = "/usr/bin/chromium"
# An expectation waits up to 30 s (Playwright's default is 5): what it waits on is often a worker's answer (a resume,
# a turn's end), which takes longer than 5 s on a busy machine. Not a timed assert: it passes the moment it holds.
expect.set_options(timeout=30_000)
EMPTY_TRANSCRIPT = re.compile(
    r"^Nothing shown yet\. Type a message and press Start turn, or enter a session and press Watch"
)
EMPTY_EVENTS = re.compile(r"^No events yet\. The session's events \(turn\.started")
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium; make test does it)"
        )
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Browser, gateway: Gateway) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1100, "height": 820})
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if _is_error(m) else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(30_000)
    page.goto(gateway.url)
    page.fill("#token", gateway.tokens["op"])
    page.click("#use-token")
    expect(page.locator("#who")).to_have_text("signed in as op-alice")
    try:
        yield page
    finally:
        context.close()
    assert errors == [], errors


def _is_error(message: ConsoleMessage) -> bool:
    return message.type == "error"


def start(page: Page, agent: str, text: str) -> str:
    session = f"web-{uuid.uuid4().hex[:8]}"
    page.select_option("#agent", agent)
    page.fill("#session", session)
    page.fill("#text", text)
    page.click("#start")
    return session


def screenshot(page: Page, tmp_path: Path, name: str) -> None:
    """A screenshot of the whole page in the test's temp dir, and in docs/ with ``JUNE_GATEWAY_SCREENSHOT=docs``."""
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("JUNE_GATEWAY_SCREENSHOT") == "docs":
        shutil.copyfile(shot, ROOT / "docs" / name)


def test_the_empty_page_says_in_words_what_each_box_will_hold(page: Page, tmp_path: Path) -> None:
    # Given the page, signed in, before any turn or session is shown
    # Then neither box is blank: each says what it is for and how to fill it
    expect(page.locator("#transcript")).to_have_text(EMPTY_TRANSCRIPT)
    expect(page.locator("#events")).to_have_text(EMPTY_EVENTS)
    expect(page.locator("#status")).to_have_text("idle")
    screenshot(page, tmp_path, "gateway-page-empty.png")


def test_watching_a_session_shows_what_the_person_said_and_who_said_it(page: Page, gateway: Gateway) -> None:
    # Given a session where someone said something over HTTP, and the agent answered
    session = f"web-{uuid.uuid4().hex[:8]}"
    done = gateway.client().post(
        gateway.path("ops", session, "/turns"), json={"text": "hello watcher"}, params={"wait": 1}
    )
    assert done.json()["status"] == "completed"
    # When the page watches that session
    page.select_option("#agent", "ops")
    page.fill("#session", session)
    page.click("#watch")
    # Then it replays both sides: the person's message (with who sent it, and how), then the reply
    user = page.locator("#transcript .msg.user")
    expect(user).to_have_count(1)
    expect(user).to_have_text("op-alice · httphello watcher")
    expect(user.locator(".from")).to_have_text("op-alice · http")
    expect(page.locator("#transcript .msg.assistant")).to_have_text("ok: hello watcher")
    expect(page.locator("#transcript .empty")).to_have_count(0)


def test_a_turn_started_on_the_page_shows_the_persons_message_once(page: Page) -> None:
    start(page, "ops", "hello once")
    expect(page.locator("#status")).to_have_text("completed")
    expect(page.locator("#transcript .msg.user")).to_have_count(1)
    expect(page.locator("#transcript .msg.user")).to_have_text("hello once")


def test_the_page_starts_a_turn_shows_the_approval_and_completes_it_on_approve(page: Page, tmp_path: Path) -> None:
    start(page, "ops", "refund")
    expect(page.locator("#status")).to_have_text("waiting for input")
    expect(page.locator("#prompt")).to_have_text("Refund 5.0?")
    expect(page.locator("#transcript")).to_contain_text('→ approve {"amount":5}')
    expect(page.get_by_role("button", name="Deny")).to_be_visible()
    screenshot(page, tmp_path, "gateway-page.png")
    page.get_by_role("button", name="Approve").click()
    expect(page.locator("#status")).to_have_text("completed")
    expect(page.locator("#transcript")).to_contain_text("Done: approve -> {'refunded': True}")
    expect(page.locator("#transcript")).to_contain_text('← approve {"refunded":true}')
    expect(page.locator("#pending")).to_be_hidden()


def test_the_page_cancels_a_running_turn(page: Page) -> None:
    start(page, "dribble", "go")
    expect(page.locator("#transcript .msg.assistant")).to_contain_text("10 ")  # text typing in
    page.click("#cancel")
    expect(page.locator("#status")).to_have_text("cancelled (requested)")


def test_the_page_answers_a_form_built_from_the_request_schema(page: Page) -> None:
    start(page, "form", "ship it")
    expect(page.locator("#prompt")).to_have_text("Where should we ship it?")
    page.fill("input[name=address]", "1 Main St")
    page.check("input[name=express]")
    page.get_by_role("button", name="Send answer").click()
    expect(page.locator("#status")).to_have_text("completed")
    expect(page.locator("#transcript")).to_contain_text(
        "Shipping to {'shipping': {'address': '1 Main St', 'express': True}}"
    )


def test_the_page_watches_a_session_and_shows_its_pending_input(page: Page, gateway: Gateway) -> None:
    session = f"web-{uuid.uuid4().hex[:8]}"
    parked = gateway.client().post(gateway.path("ops", session, "/turns"), json={"text": "refund"}, params={"wait": 1})
    assert parked.json()["status"] == "suspended"
    page.select_option("#agent", "ops")
    page.fill("#session", session)
    page.click("#watch")
    expect(page.locator("#prompt")).to_have_text("Refund 5.0?")
    expect(page.locator("#transcript")).to_contain_text("Asking.")
    page.get_by_role("button", name="Approve").click()
    expect(page.locator("#status")).to_have_text("completed")


def test_switching_sessions_leaves_nothing_of_the_previous_one_on_the_page(page: Page) -> None:
    first = start(page, "ops", "hello first")
    expect(page.locator("#status")).to_have_text("completed")
    expect(page.locator("#transcript")).to_contain_text("ok: hello first")
    second = f"web-{uuid.uuid4().hex[:8]}"
    page.fill("#session", second)
    page.press("#session", "Tab")  # the field's change event: another session
    expect(page.locator("#transcript")).to_have_text(EMPTY_TRANSCRIPT)
    expect(page.locator("#events")).to_have_text(EMPTY_EVENTS)
    expect(page.locator("#status")).to_have_text("idle")
    expect(page.locator("#turn-id")).to_have_text("")
    page.fill("#text", "hello second")
    page.click("#start")
    expect(page.locator("#status")).to_have_text("completed")
    expect(page.locator("#transcript")).to_contain_text("ok: hello second")
    expect(page.locator("#transcript")).not_to_contain_text("hello first")
    page.fill("#session", first)  # back, without a change event: Watch session shows that session alone
    page.click("#watch")
    expect(page.locator("#transcript")).to_contain_text("ok: hello first")
    expect(page.locator("#transcript")).not_to_contain_text("hello second")
    page.select_option("#agent", "form")  # another agent: another session too
    expect(page.locator("#transcript")).to_have_text(EMPTY_TRANSCRIPT)


def test_a_reply_that_comes_after_switching_sessions_is_not_drawn_into_the_session_shown(
    page: Page, gateway: Gateway
) -> None:
    # Given a turn started on the page whose POST is held in flight
    held: list[Route] = []

    def hold(route: Route) -> None:
        held.append(route)

    page.route("**/sessions/*/turns", hold)
    first = start(page, "ops", "hello first")
    wait_held(page, held, "POST")
    # When the user switches to another session, and only then the POST goes through and its reply streams back
    page.fill("#session", f"web-{uuid.uuid4().hex[:8]}")
    page.press("#session", "Tab")
    expect(page.locator("#transcript")).to_have_text(EMPTY_TRANSCRIPT)
    with page.expect_response(lambda r: r.request.method == "POST" and r.url.endswith("/turns")) as sent:
        held[0].continue_()
    page.unroute("**/sessions/*/turns")
    turn_id = sent.value.headers["x-turn-id"]
    assert gateway.stack.wait_terminal("ops", first, turn_id)["type"] == "turn.completed"
    # Then the session shown gets nothing of it: a turn started there shows alone
    page.fill("#text", "hello second")
    page.click("#start")
    expect(page.locator("#status")).to_have_text("completed")
    expect(page.locator("#transcript")).to_contain_text("ok: hello second")
    expect(page.locator("#transcript")).not_to_contain_text("hello first")
    expect(page.locator("#events")).not_to_contain_text(turn_id)


def test_the_page_shows_every_open_request_of_a_turn_and_answers_each_on_its_own(page: Page, tmp_path: Path) -> None:
    start(page, "pair", "go")
    requests = page.locator("#pending .request")
    expect(requests).to_have_count(2)
    page.screenshot(path=str(tmp_path / "two-requests.png"), full_page=True)
    expect(requests.nth(0).locator(".prompt")).to_have_text("May finance go ahead?")
    expect(requests.nth(1).locator(".prompt")).to_have_text("May legal go ahead?")
    requests.nth(1).get_by_role("button", name="Deny").click()
    expect(requests).to_have_count(1)
    expect(page.locator("#status")).to_have_text("waiting for 1 more input")
    expect(page.locator("#prompt")).to_have_text("May finance go ahead?")
    page.get_by_role("button", name="Approve").click()
    expect(page.locator("#status")).to_have_text("completed")
    expect(page.locator("#transcript")).to_contain_text("Answers: [{'finance': True}, {'legal': False}]")
    expect(page.locator("#pending")).to_be_hidden()


Held = list[tuple[Route, Any]]
"""Requests a route answered from the server at once, each with the response the page is not given yet."""


def hold_replies(page: Page, pattern: str, *, first_only: bool = False) -> Held:
    """Requests to ``pattern`` are sent to the server at once and their responses kept from the page until
    :func:`deliver_held` (with ``first_only``, only the first one's: later requests go through)."""
    held: Held = []

    def handle(route: Route) -> None:
        if first_only and held:
            route.continue_()
        else:
            held.append((route, route.fetch()))

    page.route(pattern, handle)
    return held


def wait_held(page: Page, held: list[Any], what: str) -> None:
    """Until the page has sent a request the route holds."""
    deadline = time.monotonic() + 30
    while not held and time.monotonic() < deadline:
        page.wait_for_timeout(20)  # lets Playwright run the route handler; not a wait for a worker
    assert held, f"the page sent no {what}"


def deliver_held(page: Page, held: Held, url_part: str) -> None:
    """Give the page the held responses, and return once it has read one's JSON (and run what awaited it)."""
    page.evaluate(
        """(part) => { window.__heldRead = 0; const json = Response.prototype.json;
        Response.prototype.json = async function () { const v = await json.call(this);
          if (this.url.includes(part)) setTimeout(() => { window.__heldRead += 1; }); return v; }; }""",
        url_part,
    )
    for route, response in held:
        route.fulfill(response=response)
    page.wait_for_function("() => window.__heldRead >= 1")


@pytest.fixture
def boss_page(browser: Browser, gateway: Gateway) -> Iterator[tuple[Page, str]]:
    """A page signed in on a gateway serving the delegating ``boss`` agent and its ``scout`` child, and a key
    for the child's hold (released at the end whatever the test did)."""
    from june_worker.gateway import Principal, TokenTable, create_app

    from .conftest import settings_for
    from .kit import ServedApp

    token = f"boss-token-{uuid.uuid4().hex}"
    table = TokenTable.of({token: Principal("op-alice", frozenset({"boss", "scout"}))})
    served = ServedApp(create_app(settings_for(gateway.stack, table, agents=("boss", "scout"))))
    context = browser.new_context(viewport={"width": 1100, "height": 820})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(30_000)
    key = uuid.uuid4().hex[:8]
    try:
        page.goto(served.url)
        page.fill("#token", token)
        page.click("#use-token")
        expect(page.locator("#who")).to_have_text("signed in as op-alice")
        yield page, key
    finally:
        gateway.stack.redis.set(f"it:scout:{key}:release", "1")
        context.close()
        served.stop()
    assert errors == [], errors


def test_the_page_shows_a_subagents_request_as_waiting_on_its_child_with_no_buttons(
    boss_page: tuple[Page, str], gateway: Gateway
) -> None:
    page, key = boss_page
    # Given a turn whose tool delegated to a child agent that is still working
    start(page, "boss", f"delegate 1 {key} hold")
    # Then the page says what the turn waits on, and offers nobody a button to answer it
    block = page.locator("#pending .request")
    expect(block).to_have_count(1)
    expect(block.locator(".prompt")).to_have_text("waiting on child agent scout")
    expect(page.locator("#pending button")).to_have_count(0)
    # and when the child ends, the turn completes
    gateway.stack.redis.set(f"it:scout:{key}:release", "1")
    expect(page.locator("#status")).to_have_text("completed")
    expect(page.locator("#pending")).to_be_hidden()


def test_a_pending_list_that_answers_after_the_turn_moved_on_does_not_bring_its_request_back(
    boss_page: tuple[Page, str], gateway: Gateway
) -> None:
    page, key = boss_page
    # Given a turn waiting on its child, and the page's look at the session's open requests answered (the
    # child's request still open) but not yet delivered to the page
    held = hold_replies(page, "**/pending")
    start(page, "boss", f"delegate 1 {key} hold")
    expect(page.locator("#pending .request .prompt")).to_have_text("waiting on child agent scout")
    wait_held(page, held, "look at the open requests")
    # When the child ends and the turn completes, and only then that answer reaches the page
    gateway.stack.redis.set(f"it:scout:{key}:release", "1")
    expect(page.locator("#status")).to_have_text("completed")
    deliver_held(page, held, "/pending")
    # Then the page shows no request: that answer was about a turn that has moved on
    expect(page.locator("#pending")).to_be_hidden()
    assert page.locator("#pending .request").count() == 0
