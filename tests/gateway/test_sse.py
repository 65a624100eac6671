"""SSE done right: Last-Event-ID catch-up, many followers, heartbeats, time limits, slow and vanishing clients.

The SSE id of an event is its Redis stream id, so the events of a stream cut anywhere and
resumed with ``Last-Event-ID`` are, concatenated, exactly the turn's entries in the stream:
nothing missed, nothing repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx

from june_wire.redis_url import aconnect, connect
from june_worker.engine.events import MessageDelta
from june_worker.engine.store import SessionRef
from june_worker.events import EventKeys, RedisStreamSink
from june_worker.gateway import create_app
from june_worker.gateway.client import parse_sse
from june_worker.gateway.sse import follow_events
from tests.integration.conftest import wait_for

from .conftest import settings_for
from .kit import Gateway, ServedApp, read_events, sse_headers, stream_entries, wait_event


def new_session() -> str:
    return f"s-{uuid.uuid4().hex[:12]}"


def test_a_stream_cut_mid_turn_and_resumed_with_last_event_id_misses_nothing_and_repeats_nothing(
    gateway: Gateway,
) -> None:
    session, client = new_session(), gateway.client()
    got: list[tuple[str, str]] = []
    with client.stream("POST", gateway.path("dribble", session, "/turns"), json={"text": "go"},
                       headers=sse_headers(gateway)) as r:  # fmt: skip
        turn_id = r.headers["x-turn-id"]
        for message in read_events(r):
            got.append((str(message.id), message.event))
            if len(got) == 40:
                break  # cut 1: mid-stream, a few deltas in
    follow = gateway.path("dribble", session, f"/turns/{turn_id}/events")
    for cut in (300, 700):
        with client.stream("GET", follow, headers=sse_headers(gateway, last_event_id=got[-1][0])) as r:
            for n, message in enumerate(read_events(r), start=1):
                got.append((str(message.id), message.event))
                if n == cut:
                    break  # cuts 2 and 3
    with client.stream("GET", follow, headers=sse_headers(gateway, last_event_id=got[-1][0])) as r:
        got.extend((str(m.id), m.event) for m in read_events(r))
    assert got[-1][1] == "turn.completed"
    in_stream = [(e["id"], e["type"]) for e in stream_entries(gateway.stack, "dribble", session, turn_id)]
    assert got == in_stream  # every entry, once, in order: deltas too
    structural = [t for _, t in got if not t.endswith(".delta")]
    assert structural == ["turn.started", "message.completed", "turn.completed"]
    assert len(got) > 1000


async def test_fifty_concurrent_followers_of_one_session_all_receive_the_whole_turn(gateway: Gateway) -> None:
    session, followers = new_session(), 50
    first = gateway.client().post(
        gateway.path("bulk", session, "/turns"), json={"text": "stream 1"}, params={"wait": 1}
    )
    assert first.status_code == 200
    connected = 0
    all_connected = asyncio.Event()
    turn: dict[str, str] = {}
    turn_known = asyncio.Event()

    async def follow(client: httpx.AsyncClient) -> list[tuple[str, str]]:
        nonlocal connected
        seen: list[tuple[str, str]] = []
        url = gateway.path("bulk", session, "/events")
        async with client.stream("GET", url, params={"after": "$"}, headers=sse_headers(gateway)) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            block: list[str] = []
            async for line in lines:
                if line == ": connected":
                    connected += 1
                    if connected == followers:
                        all_connected.set()
                    await turn_known.wait()
                if line:
                    block.append(line)
                    continue
                for message in parse_sse([*block, ""]):
                    seen.append((str(message.id), message.event))
                    if message.event == "turn.completed" and message.json()["turn_id"] == turn["id"]:
                        return seen
                block = []
        raise AssertionError("the stream ended before the turn did")

    limits = httpx.Limits(max_connections=followers + 5)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=limits) as client:
        tasks = [asyncio.create_task(follow(client)) for _ in range(followers)]
        await asyncio.wait_for(all_connected.wait(), 30)
        r = await client.post(gateway.path("bulk", session, "/turns"), json={"text": "stream 300 16"},
                              headers=gateway.auth())  # fmt: skip
        turn["id"] = r.json()["turn_id"]
        turn_known.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    whole = [(e["id"], e["type"]) for e in stream_entries(gateway.stack, "bulk", session, turn["id"])]
    assert len(whole) == 303 and whole[-1][1] == "turn.completed"
    for seen in results:
        assert seen == whole


def raw_lines(response: httpx.Response) -> Iterator[str]:
    yield from response.iter_lines()


def test_an_idle_stream_gets_heartbeat_comments(gateway: Gateway) -> None:
    session, client = new_session(), gateway.client()
    client.post(gateway.path("ops", session, "/turns"), json={"text": "hi"}, params={"wait": 1})
    started = time.monotonic()
    beats = 0
    with client.stream("GET", gateway.path("ops", session, "/events"), params={"after": "$"},
                       headers=sse_headers(gateway)) as r:  # fmt: skip
        for line in raw_lines(r):
            assert not line.startswith("data:"), "nothing happened in the session"
            if line == ": heartbeat":
                beats += 1
                if beats == 3:
                    break
    assert time.monotonic() - started >= 1.0  # heartbeat_s is 0.5: three of them take a second at least


def test_a_stream_ends_after_its_time_limit_and_a_reconnect_continues(gateway: Gateway) -> None:
    app = create_app(settings_for(gateway.stack, gateway.app.state.settings.tokens, max_stream_s=1.0))
    served = ServedApp(app)
    try:
        session = new_session()
        with httpx.Client(base_url=served.url, headers=gateway.auth(), timeout=30) as client:
            turn_id = client.post(gateway.path("dribble", session, "/turns"), json={"text": "go"}).json()["turn_id"]
            follow = gateway.path("dribble", session, f"/turns/{turn_id}/events")
            got: list[tuple[str, str]] = []
            limited = 0
            while not got or got[-1][1] != "turn.completed":
                assert limited < 60
                headers = sse_headers(gateway, last_event_id=got[-1][0] if got else None)
                with client.stream("GET", follow, headers=headers) as s:
                    lines = list(s.iter_lines())  # the server ends the response after a second
                limited += ": stream time limit reached; reconnect with Last-Event-ID" in lines
                got.extend((str(m.id), m.event) for m in parse_sse(lines))
    finally:
        served.stop()
    assert limited >= 2
    assert got == [(e["id"], e["type"]) for e in stream_entries(gateway.stack, "dribble", session, turn_id)]


def test_a_slow_client_is_read_only_as_fast_as_it_consumes(gateway: Gateway) -> None:
    session = new_session()
    big = gateway.client().post(gateway.path("bulk", session, "/turns"), json={"text": "stream 3000 4000"},
                                params={"wait": 1})  # fmt: skip
    turn_id = big.json()["turn_id"]
    total = len(stream_entries(gateway.stack, "bulk", session, turn_id))
    assert total == 3003
    stats = gateway.backend.stats
    sent_before = stats.events_sent
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])))
    try:
        request = (
            f"GET {gateway.path('bulk', session, f'/turns/{turn_id}/events')} HTTP/1.1\r\nHost: gw\r\n"
            f"Authorization: Bearer {gateway.tokens['op']}\r\nAccept: text/event-stream\r\n\r\n"
        )
        sock.sendall(request.encode())
        head = sock.recv(1024)
        assert head.startswith(b"HTTP/1.1 200")
        # The client reads nothing more: the gateway must stop reading Redis, not buffer the stream.
        wait_for(lambda: stats.stalled_since is not None and time.monotonic() - stats.stalled_since > 1.0,
                 timeout_s=30, what="the stream to wait on its client")  # fmt: skip
        stalled_at = stats.events_sent - sent_before
        assert stalled_at < total // 2, f"{stalled_at} of {total} events were handed to a client that reads nothing"
        data = bytearray(head)
        sock.settimeout(30)
        while not data.endswith(b"0\r\n\r\n"):  # then it reads everything: the whole turn arrives
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            data.extend(chunk)
    finally:
        sock.close()
    body = _dechunk(bytes(data).split(b"\r\n\r\n", 1)[1])
    events = list(parse_sse(body.decode().split("\n")))
    assert [m.id for m in events] == [e["id"] for e in stream_entries(gateway.stack, "bulk", session, turn_id)]


def _dechunk(raw: bytes) -> bytes:
    out, rest = bytearray(), raw
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out.extend(rest[:size])
        rest = rest[size + 2 :]
    return bytes(out)


def test_a_client_that_leaves_costs_nothing(gateway: Gateway) -> None:
    session, client = new_session(), gateway.client()
    pool: Any = gateway.backend.redis.connection_pool
    r = client.post(gateway.path("dribble", session, "/turns"), json={"text": "go"})
    turn_id = r.json()["turn_id"]
    wait_event(gateway, "dribble", session, turn_id, "turn.started")
    with client.stream("GET", gateway.path("dribble", session, "/events"), headers=sse_headers(gateway)) as s:
        for n, _ in enumerate(read_events(s), start=1):
            if n == 20:
                assert gateway.backend.stats.open >= 1
                break  # the client leaves mid-turn
    wait_for(lambda: gateway.backend.stats.open == 0, timeout_s=10, what="the gateway to close the stream")
    wait_for(lambda: len(pool._in_use_connections) == 0, timeout_s=10, what="its Redis connection to be released")
    end = wait_event(gateway, "dribble", session, turn_id, "turn.completed")  # the worker never noticed
    assert end["text"] == "streamed 2000"


def test_following_a_session_from_the_start_or_only_what_comes_next(gateway: Gateway) -> None:
    session, client = new_session(), gateway.client()
    old = client.post(gateway.path("ops", session, "/turns"), json={"text": "one"}, params={"wait": 1}).json()
    history = [e["id"] for e in gateway.stack.events("ops", session)]
    with client.stream("GET", gateway.path("ops", session, "/events"), headers=sse_headers(gateway)) as s:
        replay = [m.id for m in read_events(s, until_terminal=old["turn_id"])]
    assert replay == history
    with client.stream("GET", gateway.path("ops", session, "/events"), params={"after": "$"},
                       headers=sse_headers(gateway)) as s:  # fmt: skip
        lines = s.iter_lines()
        assert next(lines) == "retry: 1000" and next(lines) == ": connected"
        new = client.post(gateway.path("ops", session, "/turns"), json={"text": "two"}).json()["turn_id"]
        fresh = list(read_events_from(lines, new))
    assert fresh[0].event == "turn.started" and fresh[0].json()["turn_id"] == new
    assert not {m.id for m in fresh} & set(history)


def read_events_from(lines: Iterator[str], turn_id: str) -> Iterator[Any]:
    for message in parse_sse(lines):
        yield message
        if message.event == "turn.completed" and message.json()["turn_id"] == turn_id:
            return


async def test_a_dead_attempts_delta_arriving_in_a_later_heartbeat_window_is_not_sent(redis_url: str) -> None:
    # Given a session stream followed over SSE (windows of 0.2 s), where attempt 2 of a step is typing
    keys, ref = EventKeys(prefix=f"june-test-{uuid.uuid4().hex[:10]}"), SessionRef("ops", new_session())
    writer = connect(redis_url)
    reader = aconnect(redis_url)
    sink = RedisStreamSink(writer, keys=keys, firehose=False)
    sink.publish_delta(ref, MessageDelta(turn_id="t1", step="model:1", text="fresh", attempt=2))
    chunks = follow_events(reader, keys, ref, turn_id=None, last_id="0-0", heartbeat_s=0.2, max_stream_s=60, batch=100)
    sent: list[tuple[str, int]] = []
    late = False
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if chunk.startswith(b"id: "):
                    data = json.loads(chunk.decode().split("data: ", 1)[1])
                    sent.append((data["text"], data["attempt"]))
                    if data["text"] == "more":
                        break
                elif chunk == b": heartbeat\n\n" and sent and not late:
                    # When, after a window ended, the dead attempt 1's delta arrives late, then attempt 2's next one
                    sink.publish_delta(ref, MessageDelta(turn_id="t1", step="model:1", text="zombie", attempt=1))
                    sink.publish_delta(ref, MessageDelta(turn_id="t1", step="model:1", text="more", attempt=2))
                    late = True
    finally:
        await reader.aclose()
        writer.delete(keys.session_stream(ref))
        writer.close()
    # Then the dead attempt's delta is not sent: the filter carries from one window to the next
    assert late and sent == [("fresh", 2), ("more", 2)]
