"""The operator console's routes (``/v1/console``) and the gateway's ``/metrics``, on real workers.

Operators only; lists are pages along keyset cursors; the inbox says who may answer and an
answer goes through the ordinary resume route as the caller; failed turns carry their phase,
step and error; a turn's timeline has its steps and events with durations; the live feed sends a
``change`` per structural event. Every test here fails on main (d2b81ad): none of it existed.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from june_worker import Agent, Runtime, ToolContext, tool
from june_worker.engine.events import Suspended
from june_worker.gateway.auth import Principal
from june_worker.gateway.console import inbox_page, timeline
from june_worker.models import Reply, ScriptedModel
from june_worker.observe.state import StateCollector
from june_worker.stores.postgres import PostgresStore
from tests.integration.conftest import _database, wait_for
from tests.unit.kit import WindowModel

from .console_kit import console_gateway, console_stack
from .kit import Gateway, parse_sse

__all__ = ["console_gateway", "console_stack"]  # fixtures, imported for pytest


def _session() -> str:
    return f"c-{uuid.uuid4().hex[:10]}"


def _wait(gw: Gateway, who: str, agent: str, session: str, text: str) -> dict[str, object]:
    r = gw.client(who).post(gw.path(agent, session, "/turns"), json={"text": text}, params={"wait": 1})
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


@pytest.mark.parametrize(
    "path", ["/v1/console/sessions", "/v1/console/approvals", "/v1/console/failed", "/v1/console/events", "/metrics"]
)
def test_the_console_and_metrics_are_for_operators_only(console_gateway: Gateway, path: str) -> None:
    assert console_gateway.client("viewer").get(path).status_code == 403
    assert console_gateway.client(None).get(path).status_code == 401
    if path != "/v1/console/events":
        assert console_gateway.client("admin").get(path).status_code == 200


def test_the_inbox_lists_a_parked_approval_and_only_a_permitted_operators_answer_resumes_it(
    console_gateway: Gateway,
) -> None:
    gw, session = console_gateway, _session()
    parked = _wait(gw, "admin", "ops", session, "refund")
    assert parked["status"] == "suspended"

    items = gw.client("admin").get("/v1/console/approvals", params={"limit": 200}).json()["items"]
    (item,) = [i for i in items if i["session"] == session]
    assert (item["agent"], item["turn_id"], item["input_id"]) == ("ops", parked["turn_id"], "approve-refund")
    assert (item["prompt"], item["who_may_answer"], item["may_answer"]) == ("Refund 5.0?", "policy operator", None)
    assert item["schema"] == {"type": "boolean"} and item["age_s"] >= 0

    path = gw.path("ops", session, f"/turns/{parked['turn_id']}/resume")
    refused = gw.client("mallory").post(path, json={"input_id": "approve-refund", "value": True})
    assert refused.status_code == 403  # an operator sees every session, yet the agent decides who answers
    answered = gw.client("admin").post(path, json={"input_id": "approve-refund", "value": True}, params={"wait": 1})
    assert answered.json()["status"] == "completed"
    items = gw.client("admin").get("/v1/console/approvals", params={"limit": 200}).json()["items"]
    assert [i for i in items if i["session"] == session] == []


def test_the_inbox_shows_a_subagents_request_as_waiting_on_its_child_with_nothing_to_answer(
    console_gateway: Gateway,
) -> None:
    from june_worker.engine.children import child_turn_id
    from june_worker.engine.store import SessionRef
    from june_worker.gateway import create_app

    from .conftest import AGENTS, settings_for
    from .kit import ServedApp

    gw, session, key = console_gateway, _session(), uuid.uuid4().hex[:8]
    served = ServedApp(create_app(settings_for(gw.stack, gw.app.state.settings.tokens, agents=(*AGENTS, "boss"))))
    admin = httpx.Client(base_url=served.url, headers=gw.auth("admin"), timeout=60)
    try:
        # Given a turn parked on its child turn (the child is still working)
        turn_id = gw.stack.turn("boss", session, f"delegate 1 {key} hold")

        assert gw.stack.wait_terminal("boss", session, turn_id, timeout_s=60)["type"] == "input.requested"
        got = admin.get("/v1/console/approvals", params={"limit": 200})
        assert got.status_code == 200, got.text
        (item,) = [i for i in got.json()["items"] if i["session"] == session]

        # Then its item says what it waits on, and offers no answer: the child's end answers it
        child_turn = child_turn_id(SessionRef("boss", session), turn_id, "c1")
        assert item["input_id"] == f"child:scout:{child_turn}" and item["turn_id"] == turn_id
        assert item["child"] == {"agent": "scout", "turn_id": child_turn}
        assert item["may_answer"] is False and item["prompt"] == f"waiting on child agent scout (turn {child_turn})"
    finally:
        gw.stack.redis.set(f"it:scout:{key}:release", "1")
        admin.close()
        served.stop()


def test_failed_turns_show_their_phase_step_and_error(console_gateway: Gateway) -> None:
    gw, session = console_gateway, _session()
    failed = _wait(gw, "admin", "boom", session, "go")
    assert failed["status"] == "failed"
    items = gw.client("admin").get("/v1/console/failed", params={"limit": 200}).json()["items"]
    (item,) = [i for i in items if i["session"] == session]
    assert (item["agent"], item["turn_id"], item["phase"], item["step"]) == (
        "boom",
        failed["turn_id"],
        "model",
        "model:1",
    )
    assert (item["error_type"], item["error"]) == ("RuntimeError", "model exploded (dependency skew)")
    path = f"/v1/console/agents/boom/sessions/{session}/turns/{failed['turn_id']}/timeline"
    timeline = gw.client("admin").get(path)
    assert timeline.status_code == 200, timeline.text
    t = timeline.json()
    assert (t["status"], t["phase"], t["step"], t["error"]) == ("failed", "model", "model:1", item["error"])
    assert [e["type"] for e in t["events"]] == ["turn.started", "turn.failed"]


@pytest.fixture
def ghost_gateway(console_gateway: Gateway) -> Iterator[httpx.Client]:
    """An operator's client of a gateway that also offers ``ghost``, an agent no worker serves."""
    from june_worker.gateway import create_app

    from .conftest import AGENTS, settings_for
    from .kit import ServedApp

    gw = console_gateway
    served = ServedApp(create_app(settings_for(gw.stack, gw.app.state.settings.tokens, agents=(*AGENTS, "ghost"))))
    admin = httpx.Client(base_url=served.url, headers=gw.auth("admin"), timeout=60)
    try:
        yield admin
    finally:
        admin.close()
        served.stop()


def _failed_item(client: httpx.Client, session: str) -> dict[str, Any]:
    items = client.get("/v1/console/failed", params={"limit": 200}).json()["items"]
    (item,) = [i for i in items if i["session"] == session]
    return dict(item)


def test_a_turn_rejected_for_an_unknown_agent_is_listed_among_failed_turns_with_its_reason(
    console_gateway: Gateway, ghost_gateway: httpx.Client
) -> None:
    # Given a turn a worker refused: its agent is one the gateway offers but no worker serves
    session = _session()
    r = ghost_gateway.post(f"/v1/agents/ghost/sessions/{session}/turns", json={"text": "hi"}, params={"wait": 1})
    assert r.status_code == 200 and r.json()["status"] == "failed", r.text

    # When an operator reads the failed turns
    item = _failed_item(ghost_gateway, session)

    # Then it is there, rejected at intake, with the worker's reason
    assert (item["agent"], item["turn_id"], item["status"]) == ("ghost", r.json()["turn_id"], "rejected")
    assert (item["phase"], item["step"], item["error_type"]) == ("intake", None, None)
    assert "unknown agent 'ghost'" in item["error"]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"text": ["not", "text"]}, "text: Input should be a valid string"),  # a malformed payload
        ({"text": "hi", "target": "nowhere"}, "target: Input should be a valid dictionary"),  # no target to deliver to
    ],
    ids=["malformed-payload", "undeliverable-target"],
)
def test_a_turn_rejected_for_its_payload_is_listed_among_failed_turns_with_its_reason(
    console_gateway: Gateway, fields: dict[str, Any], reason: str
) -> None:
    # Given a turn message a worker refused (sent by a producer, as another service would)
    gw, session, turn_id = console_gateway, _session(), f"t_{uuid.uuid4().hex}"
    gw.stack.send("june.turn", {"turn_id": turn_id, "agent": "ops", "session": session, **fields})
    assert gw.stack.wait_terminal("ops", session, turn_id)["phase"] == "intake"

    # When an operator reads the failed turns
    item = _failed_item(gw.client("admin"), session)

    # Then it is there, rejected at intake, with what was wrong
    assert (item["turn_id"], item["status"], item["phase"]) == (turn_id, "rejected", "intake")
    assert reason in item["error"]


def test_a_rejected_turns_timeline_says_why_it_was_refused(console_gateway: Gateway) -> None:
    # Given a turn a worker refused for its payload
    gw, session, turn_id = console_gateway, _session(), f"t_{uuid.uuid4().hex}"
    gw.stack.send("june.turn", {"turn_id": turn_id, "agent": "ops", "session": session, "text": 5})
    gw.stack.wait_terminal("ops", session, turn_id)

    # When an operator opens its timeline
    t = gw.client("admin").get(f"/v1/console/agents/ops/sessions/{session}/turns/{turn_id}/timeline").json()

    # Then it is rejected at intake, with the reason, and its one event is the turn.failed that ended its stream
    assert (t["status"], t["phase"]) == ("rejected", "intake")
    assert "text: Input should be a valid string" in t["error"]
    assert [e["type"] for e in t["events"]] == ["turn.failed"]


def _rejected_session(gw: Gateway) -> str:
    """A session whose only turn a worker refused (a malformed payload)."""
    session, turn_id = _session(), f"t_{uuid.uuid4().hex}"
    gw.stack.send("june.turn", {"turn_id": turn_id, "agent": "ops", "session": session, "text": ["not", "text"]})
    gw.stack.wait_terminal("ops", session, turn_id)
    return session


def _listed(gw: Gateway, session: str, **params: Any) -> list[str]:
    items = gw.client("admin").get("/v1/console/sessions", params={"limit": 200, **params}).json()["items"]
    return [i["status"] for i in items if i["session"] == session]


def test_a_session_whose_only_turn_was_rejected_is_shown_rejected_and_its_row_stays_new(
    console_gateway: Gateway,
) -> None:
    # Given a session whose only turn was refused at intake
    gw = console_gateway
    session = _rejected_session(gw)

    # When an operator lists the sessions
    shown = _listed(gw, session)

    # Then the console shows it rejected, while the store keeps it new (nothing opened it)
    assert shown == ["rejected"]
    assert gw.stack.sql("select status from june_sessions where session = %s", session) == [("new",)]


def test_the_rejected_filter_lists_sessions_whose_turns_were_all_rejected_and_new_does_not(
    console_gateway: Gateway,
) -> None:
    # Given a session whose only turn was refused at intake, and one reset after a completed turn (new again)
    gw = console_gateway
    rejected, reset = _rejected_session(gw), _session()
    _wait(gw, "admin", "ops", reset, "hello")
    assert gw.client("admin").post(gw.path("ops", reset, "/reset")).json()["status"] == "reset"

    # When an operator filters the sessions by status
    # Then rejected lists the first only, and new the second only
    assert (_listed(gw, rejected, status="rejected"), _listed(gw, reset, status="rejected")) == (["rejected"], [])
    assert (_listed(gw, rejected, status="new"), _listed(gw, reset, status="new")) == ([], ["new"])


def test_a_session_shown_rejected_runs_its_next_turn_as_a_new_session_would(console_gateway: Gateway) -> None:
    # Given a session whose only turn was refused at intake
    gw = console_gateway
    session = _rejected_session(gw)

    # When a good turn is started in it
    done = _wait(gw, "admin", "ops", session, "hello")

    # Then it runs, and the session is done
    assert done["status"] == "completed"
    assert _listed(gw, session) == ["done"]


def test_session_pages_follow_their_cursor_newest_first_without_repeats_or_gaps(console_gateway: Gateway) -> None:
    gw = console_gateway
    mine = [_session() for _ in range(7)]
    for session in mine:
        _wait(gw, "admin", "ops", session, "hello")
    seen: list[dict[str, object]] = []
    cursor = None
    while True:
        params: dict[str, object] = {"limit": 3, **({"cursor": cursor} if cursor else {})}
        page = gw.client("admin").get("/v1/console/sessions", params=params).json()
        assert len(page["items"]) <= 3
        seen += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    keys = [(s["agent"], s["session"]) for s in seen]
    assert len(keys) == len(set(keys))  # nothing twice
    assert {("ops", s) for s in mine} <= set(keys)  # nothing missed
    times = [s["last_activity"] for s in seen]
    assert times == sorted(times, reverse=True)
    assert [s["status"] for s in seen if s["session"] in mine] == ["done"] * 7
    done = gw.client("admin").get("/v1/console/sessions", params={"status": "done", "limit": 200}).json()["items"]
    assert {s["status"] for s in done} == {"done"}
    bad = gw.client("admin").get("/v1/console/sessions", params={"cursor": "bm90LW91cnM"})
    assert bad.status_code == 422 and "cursor" in bad.text


def test_a_turns_timeline_has_its_steps_and_events_with_durations_and_no_text(console_gateway: Gateway) -> None:
    gw, session = console_gateway, _session()
    done = _wait(gw, "admin", "ops", session, "order 2 nut")
    turns = gw.client("admin").get(f"/v1/console/agents/ops/sessions/{session}/turns").json()["items"]
    assert [t["turn_id"] for t in turns] == [done["turn_id"]]
    t = gw.client("admin").get(f"/v1/console/agents/ops/sessions/{session}/turns/{done['turn_id']}/timeline").json()
    assert (t["status"], t["attempts"]) == ("completed", 1) and t["duration_s"] >= 0
    assert [s["step"] for s in t["steps"]] == ["model:1", "tool:1:c1", "model:3"]
    assert all(s["duration_s"] is not None and s["duration_s"] >= 0 for s in t["steps"])
    assert [e["type"] for e in t["events"]] == [
        "turn.started", "message.completed", "action.requested", "action.completed", "message.completed",
        "turn.completed",
    ]  # fmt: skip
    offsets = [e["offset_s"] for e in t["events"]]
    assert offsets == sorted(offsets) and all(e["since_previous_s"] >= 0 for e in t["events"])
    assert "nut" not in json.dumps(t)  # no tool argument, no message text
    other = gw.client("viewer").get(f"/v1/console/agents/ops/sessions/{session}/turns/{done['turn_id']}/timeline")
    assert other.status_code == 403


def test_the_live_feed_sends_a_change_for_each_structural_event_of_a_turn(console_gateway: Gateway) -> None:
    gw, session = console_gateway, _session()
    headers = {**gw.auth("admin"), "Accept": "text/event-stream"}
    with httpx.Client(base_url=gw.url, timeout=httpx.Timeout(30, connect=5)) as client:
        with client.stream("GET", "/v1/console/events", headers=headers) as feed:
            assert feed.status_code == 200
            turn_id = (
                gw.client("admin").post(gw.path("ops", session, "/turns"), json={"text": "hello"}).json()["turn_id"]
            )
            changes = []
            for message in parse_sse(feed.iter_lines()):
                change = message.json()
                if change["turn_id"] == turn_id:
                    changes.append(change)
                    if change["type"] == "turn.completed":
                        break
    assert [c["type"] for c in changes] == ["turn.started", "message.completed", "turn.completed"]
    assert all(c["agent"] == "ops" and c["session"] == session and "text" not in c for c in changes)


def test_gateway_metrics_count_requests_by_route_template_and_serve_the_state(console_gateway: Gateway) -> None:
    gw, session = console_gateway, _session()
    _wait(gw, "admin", "ops", session, "refund")  # a parked session
    gw.client("admin").get(f"/v1/console/agents/ops/sessions/{session}/turns")

    def scraped() -> dict[str, dict[tuple[tuple[str, str], ...], float]] | None:
        text = gw.client("admin").get("/metrics").text
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
        parked = out.get("june_sessions_parked", {}).get((("agent", "ops"),), 0)
        return out if parked >= 1 else None

    samples = wait_for(scraped, timeout_s=20, what="a parked session in the gateway's state gauges")
    route = (("method", "GET"), ("route", "/v1/console/agents/{agent}/sessions/{session}/turns"), ("status", "200"))
    assert samples["june_gateway_requests_total"][route] >= 1
    assert samples["june_state_up"][()] == 1
    labels = {v for series in samples.values() for key in series for _, v in key}
    assert not [v for v in labels if session in v or v.startswith("t_")]


def test_a_turns_timeline_shows_its_compaction_step(database_url: str) -> None:
    # Given a session whose second turn compacted its transcript first (on Postgres, run in process)
    databases = _database(database_url)
    db = next(databases)
    store = PostgresStore(db, max_size=2)
    try:
        runtime = Runtime([Agent(name="window", model=WindowModel(2000, extra_tokens=1500))], store)
        session = runtime.session("window", "s1")

        async def turns() -> None:
            await session.turn("hello", turn_id="t1")
            await session.turn("x" * 300, turn_id="t2")  # ~1,500 tokens reported by the first: compacts first

        asyncio.run(turns())
        # When an operator reads that turn's timeline
        with psycopg.connect(db, autocommit=True) as conn:
            t = timeline(conn, "window", "s1", "t2")
        # Then its compaction is a step with its duration and what it did, and its event says so, without text
        assert t is not None and [s["step"] for s in t["steps"]] == ["compact:3", "model:4"]
        compact = t["steps"][0]
        assert compact["duration_s"] is not None and compact["duration_s"] >= 0
        assert " in / 8 out" in compact["detail"] and "kept from message" in compact["detail"]
        (event,) = [e for e in t["events"] if e["type"] == "context.compacted"]
        assert event["step"] == "compact:3" and "messages summarised (threshold), kept from" in event["summary"]
        assert "xxxx" not in json.dumps(t)
    finally:
        store.close()
        databases.close()


@tool
async def sign_off(ctx: ToolContext, desk: int) -> dict[str, Any]:
    """Ask one desk to sign off."""
    return {"answer": await ctx.request_input(id=f"desk{desk}", prompt=f"Desk {desk}?")}


def test_a_parks_age_counts_from_when_it_parked_through_an_answer_that_leaves_another_request_open(
    database_url: str,
) -> None:
    # Given a turn parked on two requests at once (calls run in parallel), on Postgres, run in process
    calls = [{"id": f"c{i}", "name": "sign_off", "input": {"desk": i}} for i in (1, 2)]
    agent = Agent(name="desks", model=ScriptedModel([Reply("", calls=calls), "signed"]), tools=[sign_off],
                  parallel_tools=2)  # fmt: skip
    databases = _database(database_url)
    db = next(databases)
    store = PostgresStore(db, max_size=2)
    try:
        session = Runtime([agent], store).session("desks", "s1")

        def inbox() -> tuple[list[dict[str, Any]], float]:
            with psycopg.connect(db, autocommit=True) as conn:
                items, _ = inbox_page(conn, ["desks"], Principal("op", None, operator=True), 10, None, 0.0)
                (updated,) = conn.execute("select updated_at from june_sessions where session = 's1'").fetchone()
            return items, updated

        async def park_then_answer_one() -> tuple[Any, Any, Any]:
            parked = await session.result(await session.start("sign off", turn_id="t1"))
            before = inbox()
            await session.resume("t1", "desk1", True)  # the park stays, on desk2
            return parked, before, inbox()

        parked, (before, parked_updated), (after, answered_updated) = asyncio.run(park_then_answer_one())
        assert isinstance(parked, Suspended) and [i["input_id"] for i in before] == ["desk1", "desk2"]
        # When an operator reads the inbox again: Then the open request is still listed from when the turn
        # parked, though the answer was a commit of the session's after it
        assert [i["input_id"] for i in after] == ["desk2"] and answered_updated > parked_updated
        assert after[0]["parked_at"] == before[0]["parked_at"] <= parked_updated
        # and the parked-age gauge reads the same time (an hour's wait, made so here)
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("update june_sessions set parked_at = parked_at - 3600 where session = 's1'")
        collector = StateCollector(db, agents=["desks"])
        try:
            ages = {
                s.labels["agent"]: s.value
                for family in collector.collect()
                if family.name == "june_sessions_parked_oldest_seconds"
                for s in family.samples
            }
        finally:
            collector.close()
        assert ages["desks"] >= 3600
    finally:
        store.close()
        databases.close()
