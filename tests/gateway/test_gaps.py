"""Gaps are told over SSE: a follower whose ``Last-Event-ID`` was trimmed out of the session stream gets a
``stream.gap`` event naming the first missing seq (when it can be known) and the route that reloads the
missing events from Postgres, then the events the stream still holds; never a silent resume after the gap.
"""

from __future__ import annotations

import urllib.parse
import uuid
from typing import Any

import pytest

from .kit import Gateway, read_events, sse_headers


def trimmed_turn(
    gateway: Gateway, session: str | None = None
) -> tuple[str, str, list[dict[str, Any]], list[dict[str, Any]]]:
    """A completed ``order`` turn whose stream was then trimmed to its last 3 entries.

    Returns (session, turn id, the entries before the trim, the entries after it)."""
    session = session or f"s-{uuid.uuid4().hex[:12]}"
    r = gateway.client().post(
        gateway.path("ops", quoted(session), "/turns"), json={"text": "order 2 book"}, params={"wait": "true"}
    )
    assert r.status_code == 200 and r.json()["status"] == "completed", r.text
    stack = gateway.stack
    before = stack.events("ops", session)
    stack.redis.xtrim(stack.stream_key("ops", session), maxlen=3, approximate=False)
    after = stack.events("ops", session)
    assert len(after) == 3 and after[-1]["type"] == "turn.completed"
    return session, r.json()["turn_id"], before, after


def quoted(session: str) -> str:
    return urllib.parse.quote(session, safe="")


def first_seq(entries: list[dict[str, Any]]) -> int:
    return next(e["seq"] for e in entries if e["seq"] is not None)


def test_a_follower_whose_last_event_id_was_trimmed_away_is_told_then_gets_what_the_stream_holds(
    gateway: Gateway,
) -> None:
    # Given a follower that got the turn's first event, and a stream since trimmed to the turn's last 3 entries
    session, turn_id, before, after = trimmed_turn(gateway)
    path = gateway.path("ops", session, f"/turns/{turn_id}/events")
    # When it reconnects with the id of the event it got
    with gateway.client().stream("GET", path, headers=sse_headers(gateway, last_event_id=before[0]["id"])) as r:
        got = list(read_events(r, until_terminal=turn_id))
    # Then it is told of the gap first: where the stream goes on, and where to reload from
    gap = got[0]
    assert gap.event == "stream.gap"
    data = gap.json()
    assert data["next_seq"] == first_seq(after) and data["first_missing_seq"] is None
    assert data["after_id"] == before[0]["id"] and gap.id == data["resume_id"]
    assert data["reload"].startswith(f"/v1/agents/ops/sessions/{session}/log?after_seq=")
    assert f"before seq {first_seq(after)}" in data["message"]
    # And then the entries the stream still holds, up to the turn's end
    assert [(m.id, m.event) for m in got[1:]] == [(e["id"], e["type"]) for e in after]


def test_following_a_trimmed_stream_from_its_start_is_told_that_seq_1_is_missing_and_the_log_reloads_it(
    gateway: Gateway,
) -> None:
    session, turn_id, before, after = trimmed_turn(gateway)
    path = gateway.path("ops", session, f"/turns/{turn_id}/events")

    with gateway.client().stream("GET", path, headers=sse_headers(gateway)) as r:
        got = list(read_events(r, until_terminal=turn_id))

    data = got[0].json()
    assert got[0].event == "stream.gap"
    assert (data["first_missing_seq"], data["next_seq"]) == (1, first_seq(after))
    assert data["reload"] == f"/v1/agents/ops/sessions/{session}/log?after_seq=0"
    # The reload route gives the session's committed events, every seq once, from Postgres
    log = gateway.client().get(data["reload"]).json()
    structural = [e for e in before if e["seq"] is not None]
    assert [(e["seq"], e["type"]) for e in log["events"]] == [(e["seq"], e["type"]) for e in structural]
    assert log["next_after_seq"] is None


@pytest.mark.parametrize("odd", ["a?b", "c#d", "e%25f", "g%h?i#j"])
def test_the_reload_link_of_a_gap_works_for_a_session_id_with_reserved_characters(gateway: Gateway, odd: str) -> None:
    # Given a trimmed stream of a session whose id needs percent-encoding
    session, turn_id, before, _after = trimmed_turn(gateway, f"{odd}-{uuid.uuid4().hex[:6]}")
    path = gateway.path("ops", quoted(session), f"/turns/{turn_id}/events")
    # When it is followed from its start
    with gateway.client().stream("GET", path, headers=sse_headers(gateway)) as r:
        gap = next(iter(read_events(r, until_terminal=turn_id)))
    # Then the gap's reload link encodes the session id, and reading it gives the session's committed events
    assert gap.event == "stream.gap" and gap.json()["session"] == session
    reload = gap.json()["reload"]
    assert reload == f"/v1/agents/ops/sessions/{quoted(session)}/log?after_seq=0"
    log = gateway.client().get(reload)
    assert log.status_code == 200, log.text
    structural = [e["seq"] for e in before if e["seq"] is not None]
    assert [e["seq"] for e in log.json()["events"]] == structural


def test_the_log_route_pages_by_seq(gateway: Gateway) -> None:
    session, _turn_id, before, _after = trimmed_turn(gateway)
    seqs = [e["seq"] for e in before if e["seq"] is not None]
    client, log = gateway.client(), gateway.path("ops", session, "/log")

    first = client.get(log, params={"after_seq": 0, "limit": 2}).json()
    rest = client.get(log, params={"after_seq": first["next_after_seq"], "limit": 100}).json()

    assert [e["seq"] for e in first["events"]] == seqs[:2] and first["next_after_seq"] == seqs[1]
    assert [e["seq"] for e in rest["events"]] == seqs[2:] and rest["next_after_seq"] is None


def test_a_wait_whose_turn_end_was_trimmed_away_answers_from_the_turns_row(gateway: Gateway) -> None:
    # Given a completed turn whose events were all trimmed away behind a later turn's
    session, turn_id, _before, _after = trimmed_turn(gateway)
    client = gateway.client()
    later = client.post(gateway.path("ops", session, "/turns"), json={"text": "hello"}, params={"wait": "true"})
    assert later.status_code == 200, later.text
    gateway.stack.redis.xtrim(gateway.stack.stream_key("ops", session), maxlen=2, approximate=False)
    assert all(e["turn_id"] != turn_id for e in gateway.stack.events("ops", session))
    # When the first turn is sent again with ?wait=true (its stream is read from the start)
    again = client.post(
        gateway.path("ops", session, "/turns"), json={"text": "order 2 book", "turn_id": turn_id}, params={"wait": 1}
    )
    # Then the answer is how it ended, from Postgres, not a 504 after waiting for an event that is gone
    assert again.status_code == 200, again.text
    assert (again.json()["status"], again.json()["text"]) == (
        "completed",
        "Done: create_order -> {'item': 'book', 'qty': 2}",
    )


def rebuilt_from_a_pruned_outbox(gateway: Gateway) -> tuple[str, list[dict[str, Any]], str]:
    """A completed ``order`` turn; then its session's Redis keys gone (expired), seq 1-2 pruned from the outbox,
    and a second turn, whose first publish rebuilt the stream from what the outbox still holds.

    Returns (session, the entries of the stream's first copy, the second turn's id)."""
    session, _turn_id, before, _after = trimmed_turn(gateway)
    stack = gateway.stack
    stack.sql("delete from june_events where agent = 'ops' and session = %s and seq <= 2", session)
    stack.redis.delete(stack.stream_key("ops", session), f"{stack.prefix}:relayed:{{ops:{session}}}")
    later = gateway.client().post(
        gateway.path("ops", session, "/turns"), json={"text": "hello"}, params={"wait": "true"}
    )
    assert later.status_code == 200, later.text
    info = stack.redis.xinfo_stream(stack.stream_key("ops", session))
    assert info["entries-added"] == info["length"]  # the new copy lost nothing by its own count
    assert first_seq(stack.events("ops", session)) == 3
    return session, before, later.json()["turn_id"]


def test_a_last_event_id_of_an_earlier_copy_of_the_stream_is_told_where_the_rebuilt_copy_goes_on(
    gateway: Gateway,
) -> None:
    # Given a follower that got the session's first event, and the stream since rebuilt from an outbox pruned
    # to seq 3 on
    session, before, later = rebuilt_from_a_pruned_outbox(gateway)
    # When it reconnects to the session's stream with the id of the event it got
    path = gateway.path("ops", session, "/events")
    with gateway.client().stream("GET", path, headers=sse_headers(gateway, last_event_id=before[0]["id"])) as r:
        got = list(read_events(r, until_terminal=later))
    # Then it is told of the gap first, naming the first seq the stream holds, and gets the rest after it
    assert got[0].event == "stream.gap"
    data = got[0].json()
    assert (data["first_missing_seq"], data["next_seq"], data["after_id"]) == (None, 3, before[0]["id"])
    seqs = [m.json()["seq"] for m in got[1:] if not m.event.endswith(".delta")]
    assert seqs[0] == 3 and seqs == list(range(3, 3 + len(seqs)))


def test_the_log_says_from_which_seq_it_still_holds_events_when_the_first_ones_asked_for_were_pruned(
    gateway: Gateway,
) -> None:
    # Given a session whose outbox was pruned of seq 1-2 (retention)
    session, _turn_id, before, _after = trimmed_turn(gateway)
    committed = max(e["seq"] for e in before if e["seq"] is not None)
    gateway.stack.sql("delete from june_events where agent = 'ops' and session = %s and seq <= 2", session)
    client, log = gateway.client(), gateway.path("ops", session, "/log")
    # When a follower reloads from after_seq=0, Then it is told the store holds them from seq 3 on
    pruned = client.get(log, params={"after_seq": 0}).json()
    assert pruned["first_kept_seq"] == 3 and [e["seq"] for e in pruned["events"]][:1] == [3]
    # And a reload from a seq still held says nothing is missing
    assert client.get(log, params={"after_seq": 2}).json()["first_kept_seq"] is None
    # And once every event was pruned, the log says the next seq to come is the first it will hold
    gateway.stack.sql("delete from june_events where agent = 'ops' and session = %s", session)
    empty = client.get(log, params={"after_seq": 1}).json()
    assert (empty["events"], empty["first_kept_seq"]) == ([], committed + 1)
    assert client.get(log, params={"after_seq": committed}).json()["first_kept_seq"] is None


def test_an_event_committed_while_the_log_is_read_is_never_reported_as_pruned(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a session whose events a follower holds up to the last committed seq
    session, _turn_id, before, _after = trimmed_turn(gateway)
    committed = max(e["seq"] for e in before if e["seq"] is not None)
    store = gateway.backend.store
    read_events = store.events

    def events_then_a_commit(*args: Any, **kwargs: Any) -> Any:
        found = read_events(*args, **kwargs)
        # a worker commits the session's next event right after the log read the events
        gateway.stack.sql("update june_sessions set event_seq = event_seq + 1 where session = %s", session)
        return found

    monkeypatch.setattr(store, "events", events_then_a_commit)
    # When it reloads from there
    log = gateway.client().get(gateway.path("ops", session, "/log"), params={"after_seq": committed}).json()
    # Then nothing is said to be missing: the new event is there to be read, not pruned
    assert (log["events"], log["first_kept_seq"]) == ([], None)
