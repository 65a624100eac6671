"""Where a turn's blocking calls run with many turns per process (june_worker/worker/inflight.py).

A turn's ready commits and publishes go to its lane (one of a few threads shared by all turns), everything else
(a sync tool in its step's transaction, reads) to the turn's own thread. Whichever takes them, a turn's calls run
one at a time in the order asked, and the run ends only once the lane has done the turn's calls. No call of one
turn that waits (a sync tool's own work) holds up another turn's commits.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from june_worker.worker.inflight import EventLoopThread, StoreLanes, TurnThread


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    thread = EventLoopThread(name="test-loop")
    yield thread.loop
    thread.close()


@pytest.fixture
def lanes() -> Iterator[StoreLanes]:
    made = StoreLanes(2)
    yield made
    made.close()


def run_turn(
    loop: asyncio.AbstractEventLoop, lanes: StoreLanes | None, body: Callable[[TurnThread], Coroutine[Any, Any, Any]]
) -> tuple[threading.Thread, dict[str, Any]]:
    """Start a run of ``body`` on a pool-like thread of its own, as the worker does for a turn's message."""
    turn = TurnThread(loop, lanes)
    out: dict[str, Any] = {}

    def serve() -> None:
        out["ident"] = threading.get_ident()
        try:
            out["result"] = turn.run(body(turn))
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread, out


def finished(thread: threading.Thread, out: dict[str, Any]) -> Any:
    thread.join(10)
    assert not thread.is_alive(), "the run did not end"
    if "error" in out:
        raise out["error"]
    return out["result"]


def test_without_lanes_every_call_runs_on_the_turns_own_thread(loop: asyncio.AbstractEventLoop) -> None:
    async def body(turn: TurnThread) -> list[int]:
        return [await turn.statement(threading.get_ident), await turn.blocking(threading.get_ident)]

    thread, out = run_turn(loop, None, body)
    assert finished(thread, out) == [out["ident"], out["ident"]]


def test_a_ready_commit_runs_on_a_lane_and_a_sync_tools_call_on_the_turns_own_thread(
    loop: asyncio.AbstractEventLoop, lanes: StoreLanes
) -> None:
    async def body(turn: TurnThread) -> tuple[int, int, int]:
        on_loop = threading.get_ident()
        return await turn.statement(threading.get_ident), await turn.blocking(threading.get_ident), on_loop

    thread, out = run_turn(loop, lanes, body)
    on_lane, on_own, on_loop = finished(thread, out)
    assert on_own == out["ident"]
    assert on_lane not in (out["ident"], on_loop)


def test_a_turns_calls_run_in_the_order_asked_whichever_thread_takes_them(
    loop: asyncio.AbstractEventLoop, lanes: StoreLanes
) -> None:
    seen: list[str] = []
    slow_publish = threading.Event()

    def publish() -> None:  # handed over without waiting for it (a sink's publish), and slow
        slow_publish.wait(5)
        seen.append("publish")

    async def body(turn: TurnThread) -> None:
        await turn.statement(lambda: seen.append("commit 1"))
        turn.submit(publish)
        loop.call_later(0.2, slow_publish.set)
        await turn.blocking(lambda: seen.append("sync tool"))  # must wait for the publish asked before it
        await turn.statement(lambda: seen.append("commit 2"))
        turn.submit(lambda: seen.append("last publish"))

    thread, out = run_turn(loop, lanes, body)
    finished(thread, out)
    # the run ended only once the lane had done the turn's last publish
    assert seen == ["commit 1", "publish", "sync tool", "commit 2", "last publish"]


def test_a_publish_asked_inside_a_commit_runs_at_once(loop: asyncio.AbstractEventLoop, lanes: StoreLanes) -> None:
    seen: list[str] = []

    async def body(turn: TurnThread) -> None:
        def commit_then_publish() -> None:  # the engine publishes a commit's events inside the commit's call
            seen.append("commit")
            turn.submit(lambda: seen.append("publish"))
            seen.append("commit returned")

        await turn.statement(commit_then_publish)

    thread, out = run_turn(loop, lanes, body)
    finished(thread, out)
    assert seen == ["commit", "publish", "commit returned"]


def test_what_a_commit_raises_reaches_its_turn_and_the_lane_serves_on(
    loop: asyncio.AbstractEventLoop, lanes: StoreLanes
) -> None:
    async def body(turn: TurnThread) -> str:
        with pytest.raises(ZeroDivisionError):
            await turn.statement(lambda: 1 / 0)
        return await turn.statement(lambda: "still served")

    for _ in range(3):  # every lane, in turn
        thread, out = run_turn(loop, lanes, body)
        assert finished(thread, out) == "still served"


def test_a_sync_tool_that_waits_holds_up_no_other_turns_commits(loop: asyncio.AbstractEventLoop) -> None:
    one_lane = StoreLanes(1)  # both turns share the lane: only the tool's own thread may wait
    try:
        release = threading.Event()
        committed = threading.Event()

        async def slow_tool(turn: TurnThread) -> None:
            await turn.blocking(lambda: release.wait(10))

        async def other(turn: TurnThread) -> None:
            await turn.statement(committed.set)

        slow_thread, slow_out = run_turn(loop, one_lane, slow_tool)
        other_thread, other_out = run_turn(loop, one_lane, other)
        assert committed.wait(5), "a turn's commit waited for another turn's sync tool"
        finished(other_thread, other_out)
        release.set()
        finished(slow_thread, slow_out)
    finally:
        one_lane.close()


def test_new_runs_are_spread_over_the_lanes(loop: asyncio.AbstractEventLoop, lanes: StoreLanes) -> None:
    async def body(turn: TurnThread) -> int:
        return await turn.statement(threading.get_ident)

    idents = set()
    for _ in range(4):
        thread, out = run_turn(loop, lanes, body)
        idents.add(finished(thread, out))
    assert len(idents) == 2


def test_a_lane_outlives_a_call_that_raises_past_its_turn(lanes: StoreLanes) -> None:
    served = threading.Event()

    def escapes() -> None:
        raise SystemExit("not caught by the call itself")

    lanes.put(0, escapes)
    lanes.put(0, served.set)
    assert served.wait(5), "the lane stopped serving after a call raised"
