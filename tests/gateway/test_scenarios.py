"""Section M of scenarios.md (HTTP surface) as it applies to the Python gateway; plus S75/S77 in test_routes.py.

Which apply, and where:

* S121 collapsing a non-SSE response is a clear error: ``june_worker.gateway.client.collapse*``
  (here, on a canned response and on a real 409 from the gateway).
* S124 no resources/services declared: turns still run: ``test_routes.py::test_wait_answers_...``
  (an order placed through the store handle, once); the gateway has no host env at all.
* S127 the failure log of a failed turn: the turn's SSE ends with ``turn.failed`` carrying the
  message, ``phase`` model, ``step`` model:1 and the stack; the one log line with agent, turn,
  step and trace is the worker's (the engine logs it where the turn runs); the gateway adds none.
* S132 a healthy turn logs nothing: no warning or error on the gateway or the worker.
* S143 / S144 an invalid session key is refused: ``test_routes.py::test_an_invalid_session_id_is_422_naming_it``
  (422 naming ``session``; the seed's 400 is FastAPI's 422 for a malformed request here).
* S147 detached turn, 202 then completion: ``test_routes.py::test_a_turn_is_202_at_once_and_completes_later``.
* S148 a failing detached turn: 202, then the worker's failure log line.

Not applicable: S118 (channel factories built from the Durable Object's env; workers build
their agents from ``JUNE_AGENTS``), S128 (the direct, non-HTTP call is the engine's; tested in
the unit tier), S129 (the Python engine has no ``on_turn_error`` hook: the log is the contract),
S133-S138 and S145-S146 (the Durable Object learns its session key from a header; here the session
is in the path of every request, so there is nothing to bind or contradict), S149-S150
(channel contexts' ``runDetached``: a plain POST without ``wait`` is the detached form), S152-S162
(delivered turns and resumes: rendering to a channel target is the worker's ``deliver`` hook for
proactive turns; the gateway does not take targets).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import httpx
import pytest

from june_worker.gateway.client import GatewayResponseError, TurnNotCompletedError, collapse, collapse_text
from tests.integration.conftest import wait_for

from .kit import Gateway, sse_headers


def new_session() -> str:
    return f"s-{uuid.uuid4().hex[:12]}"


def worker_log(gw: Gateway) -> str:
    return "\n".join(p.log.read_text(errors="replace") for p in gw.stack.procs)


class CannedResponse:
    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        self.status_code = status
        self.headers = {"content-type": content_type}
        self._body = body

    def iter_lines(self) -> Iterator[str]:
        yield from self._body.decode().splitlines()

    def read(self) -> bytes:
        return self._body


def test_s121_collapsing_a_non_sse_response_is_a_clear_error() -> None:
    with pytest.raises(GatewayResponseError, match=r"expected an SSE response.*status 500.*boom"):
        collapse_text(CannedResponse(500, "application/json", b'{"error": "boom"}'))


def test_s121_against_the_gateway_a_409_is_not_collapsed_to_nothing(gateway: Gateway) -> None:
    session, client = new_session(), gateway.client()
    client.post(gateway.path("ops", session, "/turns"), json={"text": "refund"}, params={"wait": 1})
    with client.stream("POST", gateway.path("ops", session, "/turns"), json={"text": "hi"},
                       headers=sse_headers(gateway)) as r:  # fmt: skip
        with pytest.raises(GatewayResponseError, match=r"expected an SSE response.*status 409.*parked"):
            collapse(r)
    with client.stream("POST", gateway.path("ops", new_session(), "/turns"), json={"text": "hello"},
                       headers=sse_headers(gateway)) as r:  # fmt: skip
        assert collapse_text(r) == "ok: hello"
    with client.stream("POST", gateway.path("ops", new_session(), "/turns"), json={"text": "refund"},
                       headers=sse_headers(gateway)) as r:  # fmt: skip
        with pytest.raises(TurnNotCompletedError, match="suspended.*approve-refund"):
            collapse_text(r)


def test_s127_a_failed_turn_ends_its_stream_with_turn_failed_and_is_logged_once_by_the_worker(
    gateway: Gateway,
) -> None:
    session, client = new_session(), gateway.client()
    errors_before = [line for line in gateway.logs.lines if line.startswith(("ERROR", "WARNING"))]
    with client.stream("POST", gateway.path("boom", session, "/turns"), json={"text": "go"},
                       headers=sse_headers(gateway)) as r:  # fmt: skip
        turn_id = r.headers["x-turn-id"]
        end = collapse(r)
    assert end.type == "turn.failed"
    failed = end.event
    assert failed["error"]["message"] == "model exploded (dependency skew)"
    assert (failed["phase"], failed["step"], failed["error"]["type"]) == ("model", "model:1", "RuntimeError")
    assert "model exploded (dependency skew)" in failed["error"]["stack"]
    header = f'agent "boom" turn {turn_id} failed at model:1: RuntimeError: model exploded (dependency skew)'
    wait_for(lambda: header in worker_log(gateway), what="the worker's failure log")
    log = worker_log(gateway)
    assert log.count(f"turn {turn_id} failed at") == 1
    after = log[log.index(header) :]
    assert "Traceback (most recent call last)" in after.splitlines()[1]  # the stack follows the line
    assert 'raise RuntimeError("model exploded (dependency skew)")' in after
    errors_after = [line for line in gateway.logs.lines if line.startswith(("ERROR", "WARNING"))]
    assert errors_after == errors_before  # the gateway does not log it again


def test_s148_a_failing_detached_turn_is_202_then_logged(gateway: Gateway) -> None:
    r = gateway.client().post(gateway.path("boom", new_session(), "/turns"), json={"text": "go"})
    assert r.status_code == 202
    turn_id = r.json()["turn_id"]
    wait_for(lambda: f"turn {turn_id} failed at model:1: RuntimeError: model exploded" in worker_log(gateway),
             what="the failure log line")  # fmt: skip


def test_s132_a_healthy_turn_logs_nothing(gateway: Gateway) -> None:
    session = new_session()
    mark = len(gateway.logs.lines)
    r = gateway.client().post(gateway.path("ops", session, "/turns"), json={"text": "order 2 nut"}, params={"wait": 1})
    assert r.json()["text"] == "Done: create_order -> {'item': 'nut', 'qty': 2}"
    noisy = [line for line in gateway.logs.lines[mark:] if not line.startswith(("INFO", "DEBUG"))]
    assert noisy == []
    turn_id = r.json()["turn_id"]
    assert not [line for line in worker_log(gateway).splitlines() if turn_id in line and "ERROR" in line]


def test_the_gateway_logs_each_turn_it_sends_at_info_with_ids_only(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    session = new_session()
    with caplog.at_level(logging.INFO, logger="june_worker.gateway"):
        r = httpx.post(f"{gateway.url}{gateway.path('ops', session, '/turns')}", json={"text": "secret text 42"},
                       headers=gateway.auth())  # fmt: skip
    turn_id = r.json()["turn_id"]
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "june_worker.gateway"]
    assert f"turn {turn_id} of ops:{session} sent for op-alice" in lines
    assert not any("secret text 42" in line for line in lines)
