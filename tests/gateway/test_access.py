"""Who may use a session over HTTP (june_worker.gateway.access): its opener, operators, prefixes, the app's hook.

A principal that may not use a session gets, on every route, the 404 of a session that does not
exist: the same status, body and headers it got for the same ids before the session existed.
Nothing it asked for happens: the park stays, no cancel or reset reaches a worker, no turn is sent.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from june_worker.gateway import Principal, TokenTable, create_app

from .conftest import settings_for
from .kit import Gateway, ServedApp, read_events, sse_headers

PROBES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("GET", "/events", None),
    ("GET", "/turns/{turn}/events", None),
    ("GET", "/turns/{turn}", None),
    ("GET", "/pending", None),
    ("GET", "/log", None),
    ("POST", "/turns/{turn}/resume", {"input_id": "approve-refund", "value": True}),
    ("POST", "/turns/{turn}/cancel", None),
    ("POST", "/cancel", None),
    ("POST", "/reset", None),
]


def new_session(prefix: str = "s-") -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


def probe(gw: Gateway, who: str, session: str, turn_id: str) -> dict[str, tuple[int, dict[str, str], bytes]]:
    """Every route of the session as ``who``: status, headers (but the date) and body."""
    out: dict[str, tuple[int, dict[str, str], bytes]] = {}
    client = gw.client(who)
    for method, suffix, body in PROBES:
        path = gw.path("ops", session, suffix.format(turn=turn_id))
        with client.stream(method, path, json=body, headers=sse_headers(gw, who)) as r:
            content = r.read() if r.status_code != 200 else b"(a stream)"
            headers = {k: v for k, v in r.headers.items() if k != "date"}
            out[f"{method} {suffix}"] = (r.status_code, headers, content)
    return out


def park(gw: Gateway, session: str, turn_id: str, who: str = "op") -> None:
    r = gw.client(who).post(
        gw.path("ops", session, "/turns"), json={"text": "refund", "turn_id": turn_id}, params={"wait": "true"}
    )
    assert r.status_code == 200 and r.json()["status"] == "suspended", r.text


def test_another_principal_cannot_use_a_session_and_learns_nothing_of_its_existence(gateway: Gateway) -> None:
    session, turn_id = new_session(), f"t_{uuid.uuid4().hex}"
    before = probe(gateway, "viewer", session, turn_id)  # bob, before anyone opened the session
    assert {status for status, _, _ in before.values()} == {404}
    park(gateway, session, turn_id)  # alice opens it and parks on an approval
    stream_before = gateway.stack.events("ops", session)

    after = probe(gateway, "viewer", session, turn_id)

    assert after == before  # status, headers and body, word for word: nothing says the session now exists
    start = gateway.client("viewer").post(gateway.path("ops", session, "/turns"), json={"text": "order 1 spy"})
    assert (start.status_code, start.content) == (404, before["GET /pending"][2])
    assert gateway.stack.events("ops", session) == stream_before  # no cancel, reset or turn reached a worker
    assert gateway.stack.sql("select turn_id, status from june_turns where session = %s", session) == [
        (turn_id, "suspended")
    ]
    assert gateway.stack.sql("select generation from june_sessions where session = %s", session) == [(0,)]
    pending = gateway.client("op").get(gateway.path("ops", session, "/pending")).json()["pending"]
    assert pending["turn_id"] == turn_id  # alice, its opener, still sees it parked


def test_an_operator_may_follow_read_resume_cancel_and_reset_any_session(gateway: Gateway) -> None:
    session, turn_id = new_session(), f"t_{uuid.uuid4().hex}"
    park(gateway, session, turn_id)  # alice's session
    admin = gateway.client("admin")

    with admin.stream(
        "GET", gateway.path("ops", session, f"/turns/{turn_id}/events"), headers=sse_headers(gateway, "admin")
    ) as r:
        assert r.status_code == 200
        assert [m.event for m in read_events(r)][-1] == "input.requested"
    assert admin.get(gateway.path("ops", session, "/pending")).json()["pending"]["turn_id"] == turn_id
    resumed = admin.post(
        gateway.path("ops", session, f"/turns/{turn_id}/resume"),
        json={"input_id": "approve-refund", "value": True},
        params={"wait": "true"},
    )
    assert resumed.status_code == 200 and resumed.json()["status"] == "completed", resumed.text
    assert admin.get(gateway.path("ops", session, f"/turns/{turn_id}")).json()["status"] == "completed"
    assert admin.post(gateway.path("ops", session, f"/turns/{turn_id}/cancel")).status_code == 409  # seen: it ended
    assert admin.post(gateway.path("ops", session, "/cancel")).json()["status"] == "nothing-to-cancel"
    reset = admin.post(gateway.path("ops", session, "/reset"))
    assert reset.status_code == 200 and reset.json()["previous_session"] == f"{session}#g0"
    assert gateway.stack.sql("select owner from june_gateway_sessions where session = %s", session) == [("op-alice",)]


def test_a_session_opened_elsewhere_is_for_operators_only(gateway: Gateway) -> None:
    """A session a producer (or another channel) opened has no owner here: a user may not claim it."""
    session = new_session()
    turn_id = gateway.stack.turn("ops", session, "hello")
    gateway.stack.wait_terminal("ops", session, turn_id)
    alice = gateway.client("op")
    assert alice.get(gateway.path("ops", session, "/pending")).status_code == 404
    assert alice.post(gateway.path("ops", session, "/turns"), json={"text": "mine now"}).status_code == 404
    assert gateway.client("admin").get(gateway.path("ops", session, "/pending")).json()["pending"] is None
    assert gateway.stack.sql("select count(*) from june_turns where session = %s", session) == [(1,)]


def test_a_principal_confined_to_a_prefix_uses_its_namespace_and_nothing_else(gateway: Gateway) -> None:
    erin = gateway.client("tenant")
    outside = erin.post(gateway.path("ops", new_session(), "/turns"), json={"text": "hi"})
    assert outside.status_code == 404  # outside "erin-": refused before anything is looked up or sent
    mine = new_session("erin-")
    assert (
        erin.post(gateway.path("ops", mine, "/turns"), json={"text": "hi"}, params={"wait": 1}).json()["text"]
        == "ok: hi"
    )
    channel = new_session("erin-")  # opened by another service, inside her namespace
    gateway.stack.wait_terminal("ops", channel, gateway.stack.turn("ops", channel, "hello"))
    assert erin.get(gateway.path("ops", channel, "/pending")).status_code == 200
    taken = new_session("erin-")  # opened through the gateway by someone else first: theirs
    assert gateway.client("op").post(gateway.path("ops", taken, "/turns"), json={"text": "hi"}).status_code == 202
    assert erin.get(gateway.path("ops", taken, "/pending")).status_code == 404


@pytest.fixture
def hooked(gateway: Gateway) -> Iterator[tuple[str, list[tuple[str, str, str, str]]]]:
    """A gateway whose app hook lets the payments team follow and read every session, and fails on 'broken-'."""
    calls: list[tuple[str, str, str, str]] = []

    def authorize_session(principal: Principal, agent: str, session: str, action: str) -> bool | None:
        calls.append((principal.id, agent, session, action))
        if session.startswith("broken-"):
            raise RuntimeError("the directory is down")
        if principal.claims.get("team") == "payments" and action in ("follow", "pending"):
            return True
        return None

    tokens: TokenTable = gateway.app.state.settings.tokens
    served = ServedApp(create_app(settings_for(gateway.stack, tokens, authorize_session=authorize_session)))
    try:
        yield served.url, calls
    finally:
        served.stop()


def test_the_apps_authorize_session_hook_grants_beyond_the_owner_rule(
    gateway: Gateway, hooked: tuple[str, list[tuple[str, str, str, str]]]
) -> None:
    url, calls = hooked
    bob = httpx.Client(base_url=url, headers=gateway.auth("viewer"), timeout=60)
    alice = httpx.Client(base_url=url, headers=gateway.auth("op"), timeout=60)
    try:
        session = new_session()
        assert (
            bob.post(gateway.path("ops", session, "/turns"), json={"text": "hi"}, params={"wait": 1}).status_code == 200
        )
        assert ("viewer-bob", "ops", session, "start") in calls
        assert alice.get(gateway.path("ops", session, "/pending")).status_code == 200  # the hook: payments reads
        assert alice.post(gateway.path("ops", session, "/reset")).status_code == 404  # the owner rule: bob's
        assert ("op-alice", "ops", session, "reset") in calls
        for broken in ("broken-" + session, "broken-never-opened"):  # a failing hook: 503 either way
            r = alice.get(gateway.path("ops", broken, "/pending"))
            assert r.status_code == 503 and r.json() == {"detail": "session access could not be decided; retry later"}
    finally:
        bob.close()
        alice.close()


def test_a_turn_started_over_http_is_an_inbound_message_of_the_attested_principal(gateway: Gateway) -> None:
    session = new_session()
    r = gateway.client("op").post(gateway.path("ops", session, "/turns"), json={"text": "hi"}, params={"wait": 1})
    started = next(e for e in gateway.stack.events("ops", session) if e["type"] == "turn.started")
    assert r.json()["status"] == "completed"
    event = started["trigger"]["event"]
    assert started["trigger"]["kind"] == "inbound"
    assert (event["source"], event["kind"], event["user"]) == ("http", "message", {"id": "op-alice", "attested": True})


def test_a_turn_started_over_http_carries_what_the_person_said_in_its_inbound_event(gateway: Gateway) -> None:
    # Given a turn started over HTTP
    session = new_session()
    r = gateway.client("op").post(gateway.path("ops", session, "/turns"), json={"text": "hi there"}, params={"wait": 1})
    assert r.json()["status"] == "completed"
    # Then its turn.started, which a follower of the session replays, holds the text the person typed
    started = next(e for e in gateway.stack.events("ops", session) if e["type"] == "turn.started")
    assert started["trigger"]["event"]["text"] == "hi there"


@pytest.fixture
def delegating(gateway: Gateway) -> Iterator[tuple[str, dict[str, str]]]:
    """A gateway over the agents that delegate (``boss`` starts child turns on ``scout``), for alice and bob."""
    tag = uuid.uuid4().hex
    tokens = {"alice": f"alice-{tag}", "bob": f"bob-{tag}"}
    table = TokenTable.of(
        {
            tokens["alice"]: Principal("alice", frozenset({"boss", "scout"})),
            tokens["bob"]: Principal("bob", frozenset({"boss", "scout"})),
        }
    )
    served = ServedApp(create_app(settings_for(gateway.stack, table, agents=("boss", "scout"))))
    try:
        yield served.url, {who: f"Bearer {token}" for who, token in tokens.items()}
    finally:
        served.stop()


def test_the_owner_of_a_session_follows_and_answers_its_child_sessions_and_nobody_else_does(
    gateway: Gateway, delegating: tuple[str, dict[str, str]]
) -> None:
    from june_worker.engine.children import child_session_id, child_turn_id
    from june_worker.engine.store import SessionRef

    from ..integration.conftest import wait_for

    url, auth = delegating
    alice, bob = (httpx.Client(base_url=url, headers={"Authorization": auth[w]}, timeout=60) for w in ("alice", "bob"))
    try:
        # Given alice's turn whose tool delegated to a child agent that asks a person ("go")
        session, turn_id = new_session("boss-"), f"t_{uuid.uuid4().hex}"
        r = alice.post(gateway.path("boss", session, "/turns"), json={"text": "delegate 1 k ask", "turn_id": turn_id})
        assert r.status_code == 202, r.text
        child_turn = child_turn_id(SessionRef("boss", session), turn_id, "c1")
        child = gateway.path("scout", child_session_id(session, child_turn, "c1"))

        def child_parked() -> bool:
            try:
                rows = gateway.stack.sql("select status from june_turns where turn_id = %s", child_turn)
            except psycopg.errors.UndefinedTable:
                return False  # no worker made the schema yet
            return rows == [("suspended",)]

        wait_for(child_parked, timeout_s=60, what="the child turn to ask")
        got = alice.get(child + "/pending")
        assert got.status_code == 200, got.text  # the child session is hers, as her session is
        pending = got.json()["pending"]
        assert (pending["turn_id"], pending["input"]["id"]) == (child_turn, "go")

        # Then bob, who sees the same agents, learns nothing of it and cannot answer it
        unknown = bob.get(gateway.path("scout", new_session(), "/pending"))
        for method, suffix, body in PROBES:
            if suffix == "/turns/{turn}/resume":
                body = {"input_id": "go", "value": True}
            with bob.stream(method, child + suffix.format(turn=child_turn), json=body) as got:
                assert got.status_code == 404, (method, suffix)
        assert unknown.status_code == 404
        # and alice may not start a turn of her own in it (only its parent does)
        assert alice.post(child + "/turns", json={"text": "hi"}).status_code == 404

        # When alice answers the child's request
        answer = alice.post(child + f"/turns/{child_turn}/resume", json={"input_id": "go", "value": True})
        assert answer.status_code == 202, answer.text

        # Then the child goes on, and her turn completes with its result
        def parent_status() -> str | None:
            rows = gateway.stack.sql(
                "select status from june_turns where agent = 'boss' and session = %s and turn_id = %s", session, turn_id
            )
            return rows[0][0] if rows and rows[0][0] in ("completed", "failed", "cancelled") else None

        assert wait_for(parent_status, timeout_s=60, what="the parent turn to end") == "completed"
    finally:
        alice.close()
        bob.close()
