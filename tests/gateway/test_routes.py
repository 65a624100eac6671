"""Every /v1 route and status code, against the gateway served by uvicorn, with real workers, Redis and Postgres.

Status codes as the seed maps them: 403 a principal who may not answer; 409 wrong turn, wrong
input id, not suspended, reset pending, or a parked session refusing another turn (S77); 500
an ``authorize_answer`` that throws (the answer is not applied); 422 malformed requests,
naming the field; 404 unknown agent (or one the token is not granted: the same 404, word for
word), session or turn; 401 without a known token.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import pytest

from june_worker.engine.store import SessionRef
from june_worker.stores.postgres import PostgresStore
from june_worker.worker.queue import SessionQueue
from tests.integration.conftest import wait_for

from .kit import Gateway, read_events, sse_headers, wait_event


def new_session() -> str:
    return f"s-{uuid.uuid4().hex[:12]}"


def park(
    gw: Gateway, agent: str = "ops", session: str | None = None, text: str = "refund", who: str = "op"
) -> tuple[str, str]:
    """Start a turn (as ``who``) that parks for approval; return (session, turn_id) once it is parked."""
    session = session or new_session()
    r = gw.client(who).post(gw.path(agent, session, "/turns"), json={"text": text}, params={"wait": "true"})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "suspended", r.json()
    return session, r.json()["turn_id"]


def detail(r: httpx.Response) -> str:
    return str(r.json()["detail"])


# --- agents and authentication -------------------------------------------------------------------


def test_agents_lists_the_principal_and_only_its_granted_agents(gateway: Gateway) -> None:
    assert gateway.client("op").get("/v1/agents").json()["principal"] == "op-alice"
    assert gateway.client("narrow").get("/v1/agents").json() == {
        "principal": "op-carol",
        "agents": ["dribble", "form"],
        "operator": False,
    }


@pytest.mark.parametrize("authorization", [None, "Bearer not-a-configured-token-at-all", "Basic b3A6b3A=", "Bearer"])
def test_every_v1_route_refuses_a_request_without_a_known_token(gateway: Gateway, authorization: str | None) -> None:
    openapi = httpx.get(f"{gateway.url}/openapi.json").json()
    routes = [(m, p) for p, ops in openapi["paths"].items() for m in ops if p.startswith("/v1/")]
    assert len(routes) == 17  # the turn routes (11) and the operator console's (6)
    headers = {"Authorization": authorization} if authorization else {}
    with httpx.Client(base_url=gateway.url, headers=headers) as client:
        for method, path in routes:
            url = path.format(agent="ops", session="s1", turn_id="t_1")
            r = client.request(method.upper(), url, json={"text": "hi", "input_id": "a", "value": True})
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            assert r.headers["www-authenticate"] == "Bearer"


def test_an_agent_the_token_is_not_granted_is_the_same_404_as_an_unknown_one(gateway: Gateway) -> None:
    narrow = gateway.client("narrow")
    ungranted = narrow.post(gateway.path("ops", "s1", "/turns"), json={"text": "hi"})
    unknown = narrow.post(gateway.path("nope", "s1", "/turns"), json={"text": "hi"})
    assert (ungranted.status_code, unknown.status_code) == (404, 404)
    assert detail(ungranted) == "unknown agent 'ops'" and detail(unknown) == "unknown agent 'nope'"
    session, _ = park(gateway)
    assert narrow.get(gateway.path("ops", session, "/pending")).status_code == 404  # the session exists


@pytest.mark.parametrize(
    ("method", "suffix"),
    [("GET", "/pending"), ("GET", "/events"), ("GET", "/log"), ("POST", "/cancel"), ("POST", "/reset"),
     ("POST", "/turns/t_x/resume"), ("GET", "/turns/t_x"), ("GET", "/turns/t_x/events"), ("POST", "/turns/t_x/cancel")],
)  # fmt: skip
def test_an_unknown_session_is_404(gateway: Gateway, method: str, suffix: str) -> None:
    r = gateway.client().request(method, gateway.path("ops", new_session(), suffix), json={"input_id": "a", "value": 1})
    assert r.status_code == 404, r.text
    assert "unknown session" in detail(r) or "unknown turn" in detail(r)


@pytest.mark.parametrize("suffix", ["/turns/t_nope", "/turns/t_nope/events", "/turns/t_nope/cancel"])
def test_an_unknown_turn_of_a_known_session_is_404(gateway: Gateway, suffix: str) -> None:
    session, _ = park(gateway)
    method = "POST" if suffix.endswith("cancel") else "GET"
    r = gateway.client().request(method, gateway.path("ops", session, suffix))
    assert r.status_code == 404 and "unknown turn 't_nope'" in detail(r)


# --- starting turns ------------------------------------------------------------------------------


def test_a_turn_is_202_at_once_and_completes_later(gateway: Gateway) -> None:
    """S147: detached: 202 with the turn id before the model (here: a tool) has finished."""
    key = uuid.uuid4().hex
    session = new_session()
    client = gateway.client()
    r = client.post(gateway.path("ops", session, "/turns"), json={"text": f"slow {key}"})
    assert r.status_code == 202, r.text
    body = r.json()
    turn_id = body["turn_id"]
    assert body == {"turn_id": turn_id, "agent": "ops", "session": session, "status": "queued",
                    "events": gateway.path("ops", session, f"/turns/{turn_id}/events")}  # fmt: skip
    assert r.headers["location"] == body["events"]
    assert client.get(gateway.path("ops", session, f"/turns/{turn_id}")).json()["status"] in (
        "sent",
        "queued",
        "running",
    )
    wait_for(lambda: gateway.stack.redis.get(f"it:hold:{key}"), what="the hold tool to start")
    assert client.get(gateway.path("ops", session, f"/turns/{turn_id}")).json()["status"] == "running"
    gateway.stack.redis.set(f"it:hold:{key}:release", 1)
    with client.stream("GET", body["events"], headers=sse_headers(gateway)) as events:
        last = list(read_events(events, until_terminal=turn_id))[-1]
    assert last.event == "turn.completed" and last.json()["text"] == "Done: hold -> {'attempt': 1}"
    info = client.get(gateway.path("ops", session, f"/turns/{turn_id}")).json()
    assert info["status"] == "completed" and info["result"]["text"] == "Done: hold -> {'attempt': 1}"


def test_wait_answers_with_the_final_status_and_text(gateway: Gateway) -> None:
    """S124: no resources declared; an order placed through the store handle, exactly once."""
    session = new_session()
    r = gateway.client().post(
        gateway.path("ops", session, "/turns"), json={"text": "order 3 widget"}, params={"wait": 1}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["status"] == "completed"
    assert out["text"] == "Done: create_order -> {'item': 'widget', 'qty': 3}"
    assert gateway.stack.sql("select item, qty from it_orders where turn_id = %s", out["turn_id"]) == [("widget", 3)]


def test_accept_event_stream_streams_the_turn_until_its_terminal_event(gateway: Gateway) -> None:
    session = new_session()
    with gateway.client().stream(
        "POST", gateway.path("ops", session, "/turns"), json={"text": "order 1 gadget"}, headers=sse_headers(gateway)
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        turn_id = r.headers["x-turn-id"]
        events = list(read_events(r))  # the server ends the response after the terminal event
    types = [e.event for e in events]
    assert types[0] == "turn.started" and types[-1] == "turn.completed"
    assert {"message.completed", "action.requested", "action.completed"} <= set(types)
    assert all(e.json()["turn_id"] == turn_id for e in events)
    assert [e.id for e in events] == [e["id"] for e in gateway.stack.events("ops", session)]


def test_resending_a_turn_id_is_the_same_turn(gateway: Gateway) -> None:
    session, turn_id = new_session(), f"t_{uuid.uuid4().hex}"
    client = gateway.client()
    first = client.post(gateway.path("ops", session, "/turns"), json={"text": "order 1 bolt", "turn_id": turn_id},
                        params={"wait": "true"})  # fmt: skip
    again = client.post(gateway.path("ops", session, "/turns"), json={"text": "order 1 bolt", "turn_id": turn_id},
                        params={"wait": "true"})  # fmt: skip
    assert first.json()["status"] == again.json()["status"] == "completed"
    assert first.json()["last_event_id"] == again.json()["last_event_id"]
    assert gateway.stack.sql("select count(*) from it_orders where turn_id = %s", turn_id) == [(1,)]


def test_s75_a_turn_parks_and_its_resume_streams_the_continuation(gateway: Gateway) -> None:
    session, client = new_session(), gateway.client()
    with client.stream("POST", gateway.path("ops", session, "/turns"), json={"text": "refund"},
                       headers=sse_headers(gateway)) as r:  # fmt: skip
        turn_id = r.headers["x-turn-id"]
        parked = list(read_events(r))
    assert parked[-1].event == "input.requested" and parked[-1].json()["request"]["id"] == "approve-refund"
    assert "turn.completed" not in [e.event for e in parked]
    with client.stream("POST", gateway.path("ops", session, f"/turns/{turn_id}/resume"),
                       json={"input_id": "approve-refund", "value": True}, headers=sse_headers(gateway)) as r:  # fmt: skip
        assert r.status_code == 200
        continued = list(read_events(r))
    assert continued[0].event == "turn.started" and continued[0].json()["trigger"]["kind"] == "resume"
    assert continued[-1].event == "turn.completed"
    assert continued[-1].json()["text"] == "Done: approve -> {'refunded': True}"
    assert not {e.id for e in parked} & {e.id for e in continued}


def test_s77_a_parked_session_refuses_another_turn_with_409(gateway: Gateway) -> None:
    session, parked_turn = park(gateway)
    r = gateway.client().post(gateway.path("ops", session, "/turns"), json={"text": "hello", "replace": True})
    assert r.status_code == 409
    assert parked_turn in detail(r) and "approve-refund" in detail(r)


# --- pending input and resume --------------------------------------------------------------------


def test_pending_shows_the_request_and_is_null_when_not_parked(gateway: Gateway) -> None:
    session, turn_id = park(gateway)
    pending = gateway.client().get(gateway.path("ops", session, "/pending")).json()
    assert pending["pending"]["turn_id"] == turn_id
    request = pending["pending"]["input"]
    assert (request["id"], request["prompt"], request["schema"]) == (
        "approve-refund",
        "Refund 5.0?",
        {"type": "boolean"},
    )
    other = new_session()
    gateway.client().post(gateway.path("ops", other, "/turns"), json={"text": "hi"}, params={"wait": 1})
    assert gateway.client().get(gateway.path("ops", other, "/pending")).json() == {
        "agent": "ops", "session": other, "pending": None}  # fmt: skip


def test_pending_lists_every_open_request_and_an_answer_that_leaves_others_open_says_which(gateway: Gateway) -> None:
    session = new_session()
    parked = gateway.client().post(gateway.path("pair", session, "/turns"), json={"text": "go"}, params={"wait": 1})
    assert parked.json()["status"] == "suspended"
    turn_id = parked.json()["turn_id"]
    pending = gateway.client().get(gateway.path("pair", session, "/pending")).json()["pending"]
    assert [i["id"] for i in pending["inputs"]] == ["ok-finance", "ok-legal"]
    assert pending["input"]["id"] == "ok-finance"
    resume = gateway.path("pair", session, f"/turns/{turn_id}/resume")
    first = gateway.client().post(resume, json={"input_id": "ok-legal", "value": True}, params={"wait": 1})
    assert first.status_code == 202 and first.json()["open"] == ["ok-finance"]  # at once: the turn still waits
    pending = gateway.client().get(gateway.path("pair", session, "/pending")).json()["pending"]
    assert pending["input"]["id"] == "ok-finance" and "inputs" not in pending  # one left: the one-request shape
    last = gateway.client().post(resume, json={"input_id": "ok-finance", "value": False}, params={"wait": 1})
    assert last.json()["status"] == "completed"
    assert last.json()["text"] == "Answers: [{'finance': False}, {'legal': True}]"


def test_resume_by_a_principal_the_policy_refuses_is_403_and_applies_nothing(gateway: Gateway) -> None:
    session, turn_id = park(gateway, who="viewer")  # bob's own session: he may use it, but not approve refunds
    r = gateway.client("viewer").post(
        gateway.path("ops", session, f"/turns/{turn_id}/resume"), json={"input_id": "approve-refund", "value": True}
    )
    assert r.status_code == 403 and "viewer-bob is not authorized" in detail(r)
    assert (
        gateway.client("viewer").get(gateway.path("ops", session, "/pending")).json()["pending"]["turn_id"] == turn_id
    )


def test_by_is_never_a_field_the_client_chooses(gateway: Gateway) -> None:
    session, turn_id = park(gateway)
    r = gateway.client("viewer").post(
        gateway.path("ops", session, f"/turns/{turn_id}/resume"),
        json={"input_id": "approve-refund", "value": True, "by": "op-mallory"},
    )
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "by"]


def test_an_accepted_resume_is_202_recorded_by_the_principal(gateway: Gateway) -> None:
    session, turn_id = park(gateway)
    r = gateway.client().post(
        gateway.path("ops", session, f"/turns/{turn_id}/resume"), json={"input_id": "approve-refund", "value": False}
    )
    assert r.status_code == 202
    assert r.json() == {"turn_id": turn_id, "input_id": "approve-refund", "status": "accepted", "by": "op-alice"}
    end = wait_event(gateway, "ops", session, turn_id, "turn.completed")
    assert end["text"] == "Done: approve -> {'refunded': False}"
    rows = gateway.stack.sql(
        "select data::text from june_steps where agent = 'ops' and session = %s and step_id like 'input:%%'", session
    )
    assert '"by": "op-alice"' in rows[0][0] or '"by":"op-alice"' in rows[0][0]


@pytest.mark.parametrize("case", ["wrong turn", "wrong input id", "not suspended"])
def test_resume_conflicts_are_409(gateway: Gateway, case: str) -> None:
    session, turn_id = park(gateway)
    client = gateway.client()
    if case == "not suspended":
        client.post(gateway.path("ops", session, f"/turns/{turn_id}/resume"),
                    json={"input_id": "approve-refund", "value": True}, params={"wait": 1})  # fmt: skip
    target = "t_someone_else" if case == "wrong turn" else turn_id
    input_id = "approve-other" if case == "wrong input id" else "approve-refund"
    r = client.post(gateway.path("ops", session, f"/turns/{target}/resume"), json={"input_id": input_id, "value": True})
    assert r.status_code == 409, r.text
    expected = {"wrong turn": "is not suspended", "wrong input id": "is waiting for input", "not suspended": "not"}
    assert expected[case] in detail(r)


def test_resume_while_a_reset_is_pending_is_409(gateway: Gateway) -> None:
    key, session = uuid.uuid4().hex, new_session()
    client = gateway.client()
    running = client.post(gateway.path("ops", session, "/turns"), json={"text": f"slow {key}"}).json()["turn_id"]
    wait_for(lambda: gateway.stack.redis.get(f"it:hold:{key}"), what="the hold tool to start")
    reset: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: reset.update(r=gateway.client().post(gateway.path("ops", session, "/reset")))
    )
    worker.start()
    try:
        wait_for(lambda: gateway.stack.sql("select reset_pending from june_sessions where session = %s", session)
                 == [(True,)], what="the reset to be pending")  # fmt: skip
        r = client.post(gateway.path("ops", session, f"/turns/{running}/resume"), json={"input_id": "x", "value": 1})
        assert r.status_code == 409 and "reset is pending" in detail(r)
    finally:
        gateway.stack.redis.set(f"it:hold:{key}:release", 1)
        worker.join(90)
    # answered at once (202, pending): the worker running the turn performs the reset when the turn ends
    assert (reset["r"].status_code, reset["r"].json()["status"]) == (202, "pending"), reset["r"].text
    assert wait_event(gateway, "ops", session, running, "turn.cancelled")["reason"] == "reset"


def test_an_authorize_answer_hook_that_throws_is_500_and_the_answer_is_not_applied(gateway: Gateway) -> None:
    session, turn_id = park(gateway, agent="fragile")
    url = gateway.path("fragile", session, f"/turns/{turn_id}/resume")
    for _ in range(2):  # the same answer can be retried: it was not applied
        r = gateway.client().post(url, json={"input_id": "approve-refund", "value": True})
        assert r.status_code == 500
        assert "NOT applied" in detail(r) and "authorization database is down" in detail(r)
    assert gateway.client().get(gateway.path("fragile", session, "/pending")).json()["pending"]["turn_id"] == turn_id


def test_an_answer_the_request_schema_refuses_is_422_naming_value(gateway: Gateway) -> None:
    session, turn_id = park(gateway)
    r = gateway.client().post(
        gateway.path("ops", session, f"/turns/{turn_id}/resume"), json={"input_id": "approve-refund", "value": "yes"}
    )
    assert r.status_code == 422
    assert (
        r.json()["detail"][0]["loc"] == ["body", "value"]
        and "does not satisfy the schema's 'type' rule" in r.json()["detail"][0]["msg"]
    )
    assert gateway.client().get(gateway.path("ops", session, "/pending")).json()["pending"] is not None


def test_the_default_answerer_is_the_attested_speaker(gateway: Gateway) -> None:
    """A turn started through the gateway carries its principal as an attested speaker: only they may answer.

    An operator sees the session (and may follow, cancel or reset it) but is not its speaker."""
    session, turn_id = park(gateway, agent="form", text="ship it")
    url = gateway.path("form", session, f"/turns/{turn_id}/resume")
    answer = {"input_id": "shipping", "value": {"address": "1 Main St", "express": True}}
    refused = gateway.client("admin").post(url, json=answer)
    assert refused.status_code == 403 and "'op-dave' is not authorized" in detail(refused)
    r = gateway.client("op").post(url, json=answer, params={"wait": "true"})
    assert r.status_code == 200 and r.json()["status"] == "completed"
    assert r.json()["text"] == "Shipping to {'shipping': {'address': '1 Main St', 'express': True}}"


# --- malformed requests ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("suffix", "body", "loc"),
    [
        ("/turns", {}, ["body", "text"]),
        ("/turns", {"text": "hi", "by": "op-x"}, ["body", "by"]),
        ("/turns", {"text": "hi", "turn_id": "bad id!"}, ["body", "turn_id"]),
        ("/turns", {"text": 5}, ["body", "text"]),
        ("/turns/t_1/resume", {"value": True}, ["body", "input_id"]),
        ("/turns/t_1/resume", {"input_id": "a"}, ["body", "value"]),
        ("/turns/t_1/resume", {"input_id": "", "value": 1}, ["body", "input_id"]),
    ],
)
def test_malformed_bodies_are_422_naming_the_field(gateway: Gateway, suffix: str, body: Any, loc: list[str]) -> None:
    r = gateway.client().post(gateway.path("ops", "s1", suffix), json=body)
    assert r.status_code == 422, r.text
    assert loc in [e["loc"] for e in r.json()["detail"]]


def test_a_body_that_is_not_json_is_422(gateway: Gateway) -> None:
    r = gateway.client().post(
        gateway.path("ops", "s1", "/turns"), content=b"{nope", headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"


@pytest.mark.parametrize("session", ["bad%0D%0Akey", "caf%C3%A9", "a%20b"])
def test_an_invalid_session_id_is_422_naming_it(gateway: Gateway, session: str) -> None:
    """S143/S144: a session id with CR/LF, non-ASCII or spaces is refused before anything is sent."""
    r = gateway.client().post(f"/v1/agents/ops/sessions/{session}/turns", json={"text": "hi"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "session"]


def test_a_malformed_last_event_id_is_422(gateway: Gateway) -> None:
    session, turn_id = park(gateway)
    r = gateway.client().get(gateway.path("ops", session, f"/turns/{turn_id}/events"), headers={"Last-Event-ID": "x"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["header", "Last-Event-ID"]


# --- cancel and reset ------------------------------------------------------------------------------


def test_cancel_stops_a_running_turn(gateway: Gateway) -> None:
    session, client = new_session(), gateway.client()
    with client.stream("POST", gateway.path("dribble", session, "/turns"), json={"text": "go"},
                       headers=sse_headers(gateway)) as r:  # fmt: skip
        turn_id = r.headers["x-turn-id"]
        events = read_events(r)
        for e in events:
            if e.event == "message.delta":
                break
        c = client.post(gateway.path("dribble", session, f"/turns/{turn_id}/cancel"))
        assert c.status_code == 200 and c.json() == {"status": "cancel-requested", "turn_ids": [turn_id]}
        last = list(events)[-1]
    assert last.event == "turn.cancelled" and last.json()["reason"] == "requested"
    again = client.post(gateway.path("dribble", session, f"/turns/{turn_id}/cancel"))
    assert again.status_code == 409 and "(cancelled)" in detail(again)


def test_cancelling_a_whole_session(gateway: Gateway) -> None:
    session, client = new_session(), gateway.client()
    client.post(gateway.path("ops", session, "/turns"), json={"text": "hi"}, params={"wait": 1})
    r = client.post(gateway.path("ops", session, "/cancel"))
    assert r.status_code == 200 and r.json() == {"status": "nothing-to-cancel", "turn_ids": []}


def test_reset_archives_the_session_and_ends_its_park(gateway: Gateway) -> None:
    session, turn_id = park(gateway)
    client = gateway.client()
    r = client.post(gateway.path("ops", session, "/reset"))
    assert r.status_code == 200
    assert r.json() == {"status": "reset", "previous_session": f"{session}#g0", "generation": 0, "reason": None}
    assert client.get(gateway.path("ops", session, "/pending")).json()["pending"] is None
    parked_at = wait_event(gateway, "ops", session, turn_id, "input.requested")["id"]
    follow = gateway.path("ops", session, f"/turns/{turn_id}/events")
    with client.stream("GET", follow, headers=sse_headers(gateway, last_event_id=parked_at)) as s:
        last = list(read_events(s))[-1]
    assert last.event == "turn.cancelled" and last.json()["reason"] == "reset"
    after = client.post(gateway.path("ops", session, "/turns"), json={"text": "hello again"}, params={"wait": 1})
    assert after.json()["status"] == "completed"


def test_s90_a_turn_started_while_a_reset_of_its_parked_session_is_pending_is_accepted_and_runs_after_it(
    gateway: Gateway,
) -> None:
    # Given a parked session whose reset a worker recorded but has not performed (its answer was "pending")
    session, parked_turn = park(gateway)
    store = PostgresStore(gateway.stack.db_url, migrate=False)
    try:
        SessionQueue(store.pool, lease_s=2).request_reset(SessionRef("ops", session))
    finally:
        store.close()
    # When a turn is started there
    r = gateway.client().post(gateway.path("ops", session, "/turns"), json={"text": "hello"}, params={"wait": 1})
    # Then it is not refused for the park the reset ends: it runs on the new generation
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "completed"
    assert gateway.stack.sql("select generation, reset_pending from june_sessions where session = %s", session) == [
        (1, False)
    ]
    assert wait_event(gateway, "ops", session, parked_turn, "turn.cancelled")["reason"] == "reset"


# --- the rest of the surface ------------------------------------------------------------------------


def test_healthz_openapi_and_the_page_need_no_token(gateway: Gateway) -> None:
    assert httpx.get(f"{gateway.url}/healthz").json() == {"status": "ok", "redis": "ok", "postgres": "ok"}
    schema = httpx.get(f"{gateway.url}/openapi.json").json()
    assert schema["info"]["title"] == "june gateway"
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    page = httpx.get(f"{gateway.url}/")
    assert page.status_code == 200 and "june · live turns" in page.text
    assert "script-src 'sha256-" in page.headers["content-security-policy"]
