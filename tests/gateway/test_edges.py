"""The gateway's rough edges, one rule per test: links, stream ids, the schema, bounded bodies, what is logged.

* A session id with ``?``, ``#`` or ``%`` gets links that work (the 202's ``Location`` and ``events``).
* A stream id past Redis's range is the client's mistake: 422 naming it, not a Redis failure.
* The schema says what the routes answer: JSON errors on the SSE routes; a body that is not UTF-8
  or is nested too deep is the 422 of any other body that is not JSON.
* A body over the limit is a 413; a 422 echoes a bounded part of what was sent.
* A refused answer's value reaches no log and no task result; a token in a query string is not
  written to the access log.
"""

from __future__ import annotations

import json
import socket
import urllib.parse
import uuid

import httpx
import pytest

from tests.integration.conftest import wait_for

from .kit import Gateway, read_events, sse_headers

MAX_PART = 2**64 - 1


def new_session() -> str:
    return f"s-{uuid.uuid4().hex[:12]}"


# --- 3. links to sessions whose id needs percent-encoding -----------------------------------------


@pytest.mark.parametrize("odd", ["a?b", "c#d", "e%25f", "g%h?i#j"])
def test_the_links_of_a_202_work_for_a_session_id_with_reserved_characters(gateway: Gateway, odd: str) -> None:
    session = f"{odd}-{uuid.uuid4().hex[:6]}"
    quoted = urllib.parse.quote(session, safe="")
    client = gateway.client()
    r = client.post(f"/v1/agents/ops/sessions/{quoted}/turns", json={"text": "hello"})
    assert r.status_code == 202, r.text
    turn_id = r.json()["turn_id"]
    assert r.json()["session"] == session
    assert r.headers["location"] == r.json()["events"] == f"/v1/agents/ops/sessions/{quoted}/turns/{turn_id}/events"
    with client.stream("GET", r.headers["location"], headers=sse_headers(gateway)) as events:
        assert events.status_code == 200
        last = list(read_events(events))[-1]
    assert (last.event, last.json()["session"], last.json()["text"]) == ("turn.completed", session, "ok: hello")
    status = client.get(r.headers["location"].removesuffix("/events"))
    assert status.status_code == 200 and status.json()["status"] == "completed"


# --- 4. stream ids past Redis's range ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "value"),
    [("query", "99999999999999999999"), ("header", "99999999999999999999"), ("header", f"1-{MAX_PART + 1}")],
)
def test_a_stream_id_past_redis_range_is_422_naming_it_not_a_redis_failure(
    gateway: Gateway, where: str, value: str
) -> None:
    session = new_session()
    done = gateway.client().post(gateway.path("ops", session, "/turns"), json={"text": "hi"}, params={"wait": 1})
    turn_id = done.json()["turn_id"]
    mark = len(gateway.logs.lines)
    urls = [gateway.path("ops", session, "/events")]
    if where == "header":
        urls.append(gateway.path("ops", session, f"/turns/{turn_id}/events"))
    for url in urls:
        params = {"after": value} if where == "query" else {}
        headers = sse_headers(gateway, last_event_id=value if where == "header" else None)
        r = gateway.client().get(url, params=params, headers=headers)
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == (["query", "after"] if where == "query" else ["header", "Last-Event-ID"])
    assert not [line for line in gateway.logs.lines[mark:] if "Redis" in line]


def test_the_largest_stream_id_redis_takes_is_accepted(gateway: Gateway) -> None:
    session = new_session()
    gateway.client().post(gateway.path("ops", session, "/turns"), json={"text": "hi"}, params={"wait": 1})
    with gateway.client().stream(
        "GET", gateway.path("ops", session, "/events"), params={"after": f"{MAX_PART}-{MAX_PART}"},
        headers=sse_headers(gateway),
    ) as r:  # fmt: skip
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines) == "retry: 1000" and next(lines) == ": connected"
        assert next(lines) == ""
        assert next(lines) == ": heartbeat"  # nothing after the last id there is; not "event store unavailable"


# --- 5. the schema says what the routes answer ---------------------------------------------------------


def test_the_sse_routes_document_their_errors_as_json(gateway: Gateway) -> None:
    schema = httpx.get(f"{gateway.url}/openapi.json").json()
    sse_routes = [p for p in schema["paths"] if p.endswith("/events")]
    assert len(sse_routes) == 3  # a turn's, a session's, and the operator console's feed
    for path in sse_routes:
        responses = schema["paths"][path]["get"]["responses"]
        assert list(responses["200"]["content"]) == ["text/event-stream"]
        for code in ("401", "422", "503", *(("404",) if "{session}" in path else ())):
            assert list(responses[code]["content"]) == ["application/json"], (path, code)
    r = gateway.client().get(gateway.path("ops", new_session(), "/events"), headers=sse_headers(gateway))
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("body", "why"), [(b'{"text": "caf\xe9"}', "not UTF-8"), (b"[" * 100_000 + b"]" * 100_000, "nested too deep")]
)
def test_a_body_that_is_not_utf8_or_too_deep_is_the_documented_422(gateway: Gateway, body: bytes, why: str) -> None:
    r = gateway.client().post(
        gateway.path("ops", new_session(), "/turns"), content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 422, r.text
    assert r.json() == {
        "detail": [{"type": "json_invalid", "loc": ["body"], "msg": f"JSON decode error: the body is {why}"}]
    }
    schema = httpx.get(f"{gateway.url}/openapi.json").json()
    codes = {c for ops in schema["paths"].values() for op in ops.values() for c in op["responses"]}
    assert "422" in codes and "400" not in codes


# --- 6. bounded bodies and bounded echoes ------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_before_it_is_read(gateway: Gateway) -> None:
    path = gateway.path("ops", new_session(), "/turns")
    limit = 2 * 1024 * 1024  # JUNE_GATEWAY_MAX_BODY_BYTES's default
    # Declared too large: refused from the header alone; the rest of the 10 MB is never sent.
    with socket.create_connection(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])), timeout=30) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {gateway.tokens['op']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {10 * 1024 * 1024}\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"text": "')
        reply = sock.makefile("rb").read()
    assert reply.startswith(b"HTTP/1.1 413 ")
    expected = {"detail": f"the request body is larger than {limit} bytes"}
    assert reply.endswith(json.dumps(expected, separators=(",", ":")).encode())

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"text": "'
        for _ in range(100):
            yield b"x" * 100_000

    r = gateway.client().post(path, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json() == {"detail": f"the request body is larger than {limit} bytes"}


def test_a_422_echoes_a_bounded_part_of_what_was_sent(gateway: Gateway) -> None:
    r = gateway.client().post(gateway.path("ops", new_session(), "/turns"), json={"text": "x" * 1_000_000})
    assert r.status_code == 422
    assert len(r.content) < 1000
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "text"] and error["type"] == "string_too_long"
    assert error["input"] == "x" * 200 + "… (1000000 characters)"


# --- 7. what reaches logs and task results ----------------------------------------------------------------


def test_a_refused_answers_value_reaches_no_log_and_no_task_result(gateway: Gateway) -> None:
    session, secret = new_session(), f"secret-answer-{uuid.uuid4().hex}"
    parked = gateway.client().post(gateway.path("ops", session, "/turns"), json={"text": "refund"}, params={"wait": 1})
    turn_id = parked.json()["turn_id"]
    r = gateway.client().post(
        gateway.path("ops", session, f"/turns/{turn_id}/resume"), json={"input_id": "approve-refund", "value": secret}
    )
    assert r.status_code == 422

    def worker_logged_it() -> bool:  # the control worker logs the task's outcome once it has returned
        return any("june.resume" in line and "succeeded" in line and "invalid" in line for line in worker_log(gateway))

    wait_for(worker_logged_it, what="the worker's log line of the refused resume")
    assert not [line for line in worker_log(gateway) if secret in line]
    assert secret not in gateway.logs.text()
    redis = gateway.stack.redis
    for key in redis.scan_iter(match="celery-task-meta-*"):
        assert secret not in str(redis.get(key))
    assert r.json()["detail"][0]["msg"] == (  # what the client learns: the rule its answer broke
        """answer to 'approve-refund' rejected: the answer does not satisfy the schema's 'type' rule ("boolean")"""
    )


def test_a_token_in_a_query_string_is_refused_and_not_written_to_the_access_log(gateway: Gateway) -> None:
    token = gateway.tokens["op"]
    mark = len(gateway.logs.lines)
    r = httpx.get(f"{gateway.url}/v1/agents", params={"access_token": token, "wait": "true"})
    assert r.status_code == 401
    lines = wait_for(
        lambda: [line for line in gateway.logs.lines[mark:] if "GET /v1/agents?" in line], what="access log"
    )
    assert "?[redacted]&wait=true " in lines[0]  # a name the gateway does not take is redacted with its value
    assert token not in gateway.logs.text()


@pytest.mark.parametrize(
    "query",
    [
        "wait=true;access_token={token}",  # inside the value of a parameter the gateway takes
        "{token}",  # as a parameter's name
        "{token}=1&wait=1",
        "after=1-0%26access_token%3D{token}",  # percent-encoded into a value
        "status=new{token}",
    ],
)
def test_a_token_anywhere_in_a_query_string_is_not_written_to_the_access_log(gateway: Gateway, query: str) -> None:
    # Given a token sent in the query string, not where a known parameter's value would be
    token, mark = gateway.tokens["op"], len(gateway.logs.lines)

    # When the gateway is asked with it
    r = httpx.get(f"{gateway.url}/v1/agents?{query.format(token=token)}")

    # Then it is refused, and the access log's line has the request without the token
    assert r.status_code == 401
    lines = wait_for(
        lambda: [line for line in gateway.logs.lines[mark:] if "GET /v1/agents?" in line], what="access log"
    )
    assert "[redacted]" in lines[0]
    assert token not in gateway.logs.text()
    assert token.split("-")[-1] not in gateway.logs.text()  # nor its random part, cut or re-encoded


def test_the_access_log_keeps_values_of_the_gateways_own_query_parameters(gateway: Gateway) -> None:
    # Given a console read with every query parameter in a shape the gateway takes
    mark = len(gateway.logs.lines)
    cursor = "WzEuNSwib3BzIiwicy0xIl0"  # a cursor the console makes: [1.5, "ops", "s-1"]

    # When it is asked
    gateway.client("admin").get("/v1/console/sessions", params={"limit": 5, "status": "new", "cursor": cursor})

    # Then the access log shows them as sent
    lines = wait_for(
        lambda: [line for line in gateway.logs.lines[mark:] if "GET /v1/console/sessions?" in line], what="access log"
    )
    assert f"?limit=5&status=new&cursor={cursor} " in lines[0]


def test_every_query_parameter_of_the_gateway_has_a_shape_for_the_access_log(gateway: Gateway) -> None:
    from june_worker.gateway.guards import QUERY_SHAPES

    taken = {
        param["name"]
        for route in gateway.app.openapi()["paths"].values()
        for operation in route.values()
        for param in operation.get("parameters", [])
        if param["in"] == "query"
    }
    assert taken and taken <= set(QUERY_SHAPES)  # a new one without a shape would be logged as [redacted]


def worker_log(gw: Gateway) -> list[str]:
    return [line for p in gw.stack.procs for line in p.log.read_text(errors="replace").splitlines()]
