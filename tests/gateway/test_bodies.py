"""Request bodies the routes cannot read: a 4xx with a JSON ``detail``, never a 500.

The routes that take a body (``POST .../turns`` and ``POST .../turns/{turn_id}/resume``) read JSON
only. A body sent as anything else (``text/plain``, XML, a form, no ``Content-Type``) is a 415
naming what was sent, the kept-alive connection serves the next request, and the gateway logs
no traceback. A JSON body whose wrong value the answer cannot echo as it came (``NaN``, a lone
surrogate) is the ordinary 422, and an answer JSON has no value for (``NaN``) is a 422 naming ``value``.
A derandomized fuzz of media types and bytes checks that no body at all gets a 5xx.
"""

from __future__ import annotations

import json
import socket
import uuid
from typing import BinaryIO

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .kit import Gateway

BODY_ROUTES = ["/turns", "/turns/t_{turn}/resume"]
NOT_JSON = [
    ("text/plain", b"refund order 42"),
    ("application/xml", b"<turn><text>refund order 42</text></turn>"),
    ("application/x-www-form-urlencoded", b"text=refund+order+42"),  # what curl -d sends
    ("multipart/form-data; boundary=b", b'--b\r\nContent-Disposition: form-data; name="text"\r\n\r\nhi\r\n--b--\r\n'),
    (None, b'{"text": "refund order 42"}'),  # JSON, but not said to be
]


def route(gateway: Gateway, suffix: str) -> str:
    return gateway.path("ops", f"s-{uuid.uuid4().hex[:12]}", suffix.format(turn=uuid.uuid4().hex))


def request(gateway: Gateway, method: str, path: str, content_type: str | None, body: bytes) -> bytes:
    """One HTTP/1.1 request, keeping the connection alive, as bytes."""
    head = f"{method} {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {gateway.tokens['op']}\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def read_response(reader: BinaryIO) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one response read off a kept-alive connection (by its Content-Length)."""
    status_line = reader.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    headers: dict[str, str] = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, reader.read(int(headers["content-length"]))


@pytest.mark.parametrize("suffix", BODY_ROUTES)
@pytest.mark.parametrize(("content_type", "body"), NOT_JSON)
def test_a_body_not_sent_as_json_is_415_naming_what_was_sent(
    gateway: Gateway, suffix: str, content_type: str | None, body: bytes
) -> None:
    # Given a route that reads a JSON body
    client = gateway.client()
    headers = {"Content-Type": content_type} if content_type else {}

    # When it is sent a body of another type
    r = client.post(route(gateway, suffix), content=body, headers=headers)

    # Then the answer is a 415 whose JSON detail says what was expected and what came
    assert r.status_code == 415, r.text
    assert r.headers["content-type"] == "application/json"
    got = content_type.split(";")[0] if content_type else "no Content-Type"
    assert r.json() == {
        "detail": f"the request body must be JSON, sent with Content-Type: application/json (got {got})"
    }


@pytest.mark.parametrize("suffix", BODY_ROUTES)
def test_the_connection_serves_the_next_request_after_a_body_not_sent_as_json(gateway: Gateway, suffix: str) -> None:
    # Given a kept-alive connection whose first request sent a text/plain body
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock, sock.makefile("rb") as reader:
        sock.sendall(request(gateway, "POST", route(gateway, suffix), "text/plain", b"refund order 42"))
        first, _, _ = read_response(reader)

        # When the next request goes on the same connection
        sock.sendall(request(gateway, "GET", "/v1/agents", None, b""))
        status, _, body = read_response(reader)

    # Then it is answered as on a fresh one
    assert first == 415
    assert status == 200 and "ops" in json.loads(body)["agents"]


@pytest.mark.parametrize("suffix", BODY_ROUTES)
@pytest.mark.parametrize(("content_type", "body"), NOT_JSON[:3])
def test_a_body_not_sent_as_json_leaves_no_traceback_in_the_log(
    gateway: Gateway, suffix: str, content_type: str, body: bytes
) -> None:
    # Given the gateway's log so far
    mark = len(gateway.logs.lines)

    # When a route that reads JSON is sent another type
    r = gateway.client().post(route(gateway, suffix), content=body, headers={"Content-Type": content_type})

    # Then nothing was logged as an error, with or without a traceback
    assert r.status_code == 415
    logged = gateway.logs.lines[mark:]
    assert not [line for line in logged if "Traceback" in line or line.startswith(("ERROR", "CRITICAL"))], logged


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_json_body_with_a_value_json_cannot_echo_is_the_ordinary_422(gateway: Gateway, value: bytes) -> None:
    # Given a JSON body whose text is a number JSON has no literal for (Python's parser takes it)
    body = b'{"text": ' + value + b"}"

    # When a turn is started with it
    r = gateway.client().post(route(gateway, "/turns"), content=body, headers={"Content-Type": "application/json"})

    # Then it is the 422 naming the field, echoing the value as text
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert (error["loc"], error["type"], error["input"]) == (["body", "text"], "string_type", value.decode())


def test_a_json_body_with_a_lone_surrogate_is_the_ordinary_422(gateway: Gateway) -> None:
    # Given a JSON body whose text holds a lone surrogate (valid JSON, yet no UTF-8 string)
    body = b'{"text": "\\ud800 hi"}'

    # When a turn is started with it
    r = gateway.client().post(route(gateway, "/turns"), content=body, headers={"Content-Type": "application/json"})

    # Then it is the 422 naming the field, echoing the value escaped
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert (error["loc"], error["type"], error["input"]) == (["body", "text"], "string_unicode", "\\ud800 hi")


def test_an_answer_json_has_no_value_for_is_422_naming_value_and_the_turn_stays_parked(gateway: Gateway) -> None:
    # Given a turn parked on an approval
    client, session, turn_id = gateway.client(), f"s-{uuid.uuid4().hex[:12]}", f"t_{uuid.uuid4().hex}"
    parked = client.post(
        gateway.path("ops", session, "/turns"), json={"text": "refund", "turn_id": turn_id}, params={"wait": "true"}
    )
    assert parked.json()["status"] == "suspended", parked.text

    # When it is answered with NaN (Python's JSON parser takes it; JSON has no such value)
    r = client.post(
        gateway.path("ops", session, f"/turns/{turn_id}/resume"),
        content=b'{"input_id": "approve-refund", "value": NaN}',
        headers={"Content-Type": "application/json"},
    )

    # Then it is a 422 naming value, and the turn still waits for its answer
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "value"] and "NaN and Infinity are not JSON values" in error["msg"]
    assert client.get(gateway.path("ops", session, "/pending")).json()["pending"]["turn_id"] == turn_id


MEDIA_TYPES = st.one_of(
    st.none(),
    st.sampled_from(["application/json", "application/merge-patch+json", "text/plain", "application/xml"]),
    st.from_regex(r"[a-z]{1,10}/[a-z0-9.+\-]{1,15}(; ?[a-z]{1,8}=[a-z0-9\-]{1,8})?", fullmatch=True),
)
BODIES = st.one_of(
    st.binary(max_size=300),
    st.recursive(
        st.none() | st.booleans() | st.floats() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=10,
    ).map(lambda v: json.dumps(v).encode()),
)


@pytest.mark.parametrize("suffix", BODY_ROUTES)
def test_no_body_of_any_media_type_gets_a_server_error(gateway: Gateway, suffix: str) -> None:
    client = gateway.client()

    @settings(max_examples=60, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(content_type=MEDIA_TYPES, body=BODIES)
    def run(content_type: str | None, body: bytes) -> None:
        # Given any bytes, said to be of any media type (or none)
        headers = {"Content-Type": content_type} if content_type else {}

        # When they are sent to a route that reads JSON
        r = client.post(route(gateway, suffix), content=body, headers=headers)

        # Then the answer is a client error (or a turn sent) with a JSON detail, never a 5xx
        assert r.status_code < 500, (content_type, body, r.status_code, r.text)
        assert r.status_code == 202 or "detail" in r.json(), r.text

    run()
