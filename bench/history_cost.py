"""A whole turn's cost on sessions whose transcripts already hold 10, 1,000 and 10,000 messages.

    .venv/bin/python bench/history_cost.py [--quick] [-n 300] [--history 10,1000,10000] [--history-turns N]

The bench agent's turn on sessions whose transcripts already hold ``--history`` messages (past turns
of the same shape, 4 messages each, with their turn rows and step records, written straight into the
tables), the sessions' turns interleaved, each measured whole (``control.intake``, wall clock): by a
host that keeps transcripts in memory (the worker's default), then by a host with
``JUNE_TRANSCRIPT_CACHE=0`` on sessions of its own, in the same run; the first turn of each session
(nothing held yet) is shown apart, with the Postgres round trips per turn (named as in
``bench/turn_cost.py``, whose meter this uses).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
import uuid
from typing import Any

import psycopg
from _harness import BenchStack, machine, median, pct, sigterm_as_exit
from agents import ALL
from turn_cost import Meter

from june_worker.engine.events import Completed
from june_worker.engine.store import TurnPayload
from june_worker.engine.types import AssistantMessage, ToolCall, ToolMessage, UserMessage
from june_worker.stores._sql import message_body
from june_worker.worker import control
from june_worker.worker.host import WorkerHost
from june_worker.worker.payloads import TurnMessage
from june_worker.worker.settings import WorkerSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer turns")
    parser.add_argument("-n", type=int, default=300, help="turns per session and host are n / 2")
    parser.add_argument("--history", default="10,1000,10000", help="messages already in the sessions")
    parser.add_argument("--history-turns", type=int, default=0, help="turns per session and host (default: n / 2)")
    args = parser.parse_args()
    if args.quick:
        args.n = 60
    sizes = [int(x) for x in args.history.split(",") if x.strip()]
    print(f"# history_cost.py  {machine()}", flush=True)
    with sigterm_as_exit(), BenchStack("history-cost") as stack:
        history(stack, Meter(), sizes, args.history_turns or max(args.n // 2, 2))


def write_history(stack: BenchStack, session: str, size: int) -> None:
    """``size`` messages of past bench turns (user, call, result, answer), with their turn rows and step records,
    written into the tables as if those turns had run (ended; nothing for retention to have pruned yet)."""
    turns = -(-size // 4)
    messages: list[tuple[Any, ...]] = []
    steps: list[tuple[Any, ...]] = []
    rows: list[tuple[Any, ...]] = []
    for k in range(turns):
        t, i = f"t_hist_{session}_{k}", 4 * k
        shape = [
            UserMessage(turn_id=t, text="go"),
            AssistantMessage(turn_id=t, tool_calls=[ToolCall(id="c1", name="tick", input={"n": 0})]),
            ToolMessage(turn_id=t, call_id="c1", name="tick", result={"n": 1}),
            AssistantMessage(turn_id=t, text="done"),
        ]
        messages += [("bench", session, i + j, t, m.role, message_body(m)) for j, m in enumerate(shape)][: size - i]
        steps += [
            ("bench", session, f"model:{i + 1}", t, '{"finish":{"reason":"tool_calls","raw":null}}'),
            ("bench", session, f"tool:{i + 1}:c1", t, '{"result":{"n":1},"error":null}'),
            ("bench", session, f"model:{i + 3}", t, '{"finish":{"reason":"stop","raw":null}}'),
        ]
        result = Completed(turn_id=t, text="done").model_dump_json()
        rows.append(("bench", session, t, k + 1, "completed", TurnPayload(text="go").model_dump_json(), result))
    with psycopg.connect(stack.db_url, autocommit=True) as conn:
        conn.execute(
            "insert into june_sessions (agent, session, status, next_position) values ('bench', %s, 'done', %s)",
            (session, turns + 1),
        )
        with conn.cursor() as cur:
            with cur.copy("copy june_messages (agent, session, idx, turn_id, role, body) from stdin") as copy:
                for row in messages:
                    copy.write_row(row)
            with cur.copy("copy june_steps (agent, session, step_id, turn_id, data) from stdin") as copy:
                for row in steps:
                    copy.write_row(row)
            with cur.copy(
                "copy june_turns (agent, session, turn_id, position, status, payload, result) from stdin"
            ) as copy:
                for row in rows:
                    copy.write_row(row)
        conn.execute("update june_turns set finished_at = extract(epoch from now()) where session = %s", (session,))
        conn.execute("analyze")


@dataclasses.dataclass
class Measured:
    first_ms: float = 0.0
    walls: list[float] = dataclasses.field(default_factory=list)
    trips: int = 0


def history(stack: BenchStack, meter: Meter, sizes: list[int], turns: int) -> None:
    """A whole turn on sessions that already hold ``sizes`` messages, the sizes interleaved, by a host that holds
    transcripts and then by one that does not, in this one run."""
    hosts = {
        "held": WorkerHost(WorkerSettings.from_env(stack.env), agents={a.name: a for a in ALL()}),
        "off": WorkerHost(
            WorkerSettings.from_env({**stack.env, "JUNE_TRANSCRIPT_CACHE": "0"}), agents={a.name: a for a in ALL()}
        ),
    }
    sessions = {(mode, size): stack.session(f"hist-{mode}-{size}") for mode in hosts for size in sizes}
    for (_, size), session in sessions.items():
        write_history(stack, session, size)
    found: dict[tuple[str, int], Measured] = {key: Measured() for key in sessions}

    def turn(mode: str, size: int) -> float:
        msg = {"turn_id": f"t_{uuid.uuid4().hex}", "agent": "bench", "session": sessions[(mode, size)], "text": "go"}
        before = sum(c for k, c in meter.count.items() if k.startswith("pg:"))
        t0 = time.perf_counter()
        out = control.intake(hosts[mode], TurnMessage.model_validate(msg))
        wall = (time.perf_counter() - t0) * 1000
        assert out["status"] == "completed", out
        found[(mode, size)].trips += sum(c for k, c in meter.count.items() if k.startswith("pg:")) - before
        return wall

    try:
        for i in range(20):  # warm-up on sessions of their own: connections, prepared statements
            for mode in hosts:
                msg = {"turn_id": f"t_{uuid.uuid4().hex}", "agent": "bench", "session": stack.session(f"w{mode}{i}")}
                control.intake(hosts[mode], TurnMessage.model_validate({**msg, "text": "go"}))
        meter.install()
        for (
            mode
        ) in hosts:  # one host after the other (the other's slow turns would load the machine), sizes interleaved
            for size in sizes:  # nothing held yet: the whole transcript is read
                found[(mode, size)].first_ms = turn(mode, size)
                found[(mode, size)].trips = 0
            for _ in range(turns):
                for size in sizes:
                    found[(mode, size)].walls.append(turn(mode, size))
    finally:
        meter.uninstall()
        logging.getLogger("june_worker.worker").setLevel(logging.ERROR)
        for host in hosts.values():
            host.close()
    print()
    print(f"A whole turn (wall, ms) on sessions that already hold a history, {turns} turns each, sizes interleaved:")
    print(
        "| transcripts held | history (messages) | first turn | median |   p90 |   p99 | to 10 msgs | pg trips/turn |"
    )
    print(
        "|------------------|-------------------:|-----------:|-------:|------:|------:|-----------:|--------------:|"
    )
    for mode, label in (("held", "in memory"), ("off", "off (cache 0)")):
        base = median(found[(mode, sizes[0])].walls)
        for size in sizes:
            m = found[(mode, size)]
            print(
                f"| {label:<16} | {size:>18,} | {m.first_ms:10.2f} | {median(m.walls):6.2f} | {pct(m.walls, 90):5.2f} "
                f"| {pct(m.walls, 99):5.2f} | {median(m.walls) / base:9.2f}x | {m.trips / len(m.walls):13.2f} |"
            )
    print(
        "(first turn: the session's first on that host, nothing held; to 10 msgs: median over the smallest history's)"
    )


if __name__ == "__main__":
    main()
