"""Where a turn's time goes in the worker host, without Celery: every round trip of ``june.turn``'s work, by statement.

    .venv/bin/python bench/turn_cost.py [--quick] [-n 300] [--history 10,1000,10000] [--history-turns N]

Runs :func:`june_worker.worker.control.intake` (what the ``june.turn`` task calls) in this
process, on a :class:`~june_worker.worker.host.WorkerHost` over a throwaway database
``june_bench_<random>`` of ``JUNE_DATABASE_URL`` and ``JUNE_REDIS_URL`` under a unique key prefix
(both removed at the end), for ``-n`` turns of the ``bench`` agent (model, sync tool, model),
each in a new session. Every Postgres statement (``psycopg.Cursor.execute``) and every Redis
command or pipeline the turn sends is counted and timed (wall clock, from the call to its
return) and named after the code that sends it. What no round trip explains (the engine,
pydantic, the event loop) is the remainder. Next to it: a bare ``select 1`` and a PING, timed
in the same run, as the price of one round trip on this machine.

Then the same turn on sessions whose transcripts already hold ``--history`` messages (10, 1,000 and
10,000 by default: past turns of the same shape, 4 messages each, with their turn rows and step
records, written straight into the tables), the sessions' turns interleaved, each measured whole
(``control.intake``, wall clock): by a host that keeps transcripts in memory (the worker's default),
then by a host with ``JUNE_TRANSCRIPT_CACHE=0`` on sessions of its own, in the same run; the first
turn of each session (nothing held yet) is shown apart.

The rule a reader must not break: these figures are one process with nothing else to do; the
Celery task adds its own costs around them (see ``bench/throughput.py``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import resource
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import redis
from _harness import BenchStack, machine, median, pct, sigterm_as_exit
from agents import ALL

from june_worker.engine.events import Completed
from june_worker.engine.store import TurnPayload
from june_worker.engine.types import AssistantMessage, ToolCall, ToolMessage, UserMessage
from june_worker.events.redis_stream import RedisStreamSink
from june_worker.worker import control
from june_worker.worker.host import WorkerHost
from june_worker.worker.payloads import TurnMessage
from june_worker.worker.settings import WorkerSettings

# What sends each statement, by how the SQL starts (file names as of this bench's writing).
NAMES = [
    ("select (select suspended::text", "worker/queue.py SessionQueue.intake_view (turn row + park)"),
    ("select turn_id, position, status", "stores/postgres.py get_turn"),
    ("select suspended::text from june_sessions", "stores/postgres.py pending"),
    ("select r.recorded", "worker/queue.py SessionQueue.intake (turn + lease + new messages)"),
    (
        "select s.generation, s.status, s.suspended::text, s.event_seq, s.reset_pending, s.park_expires_at, tr",
        "worker/queue.py SessionQueue.read (new messages)",
    ),
    ("with existing as", "stores/postgres.py enqueue_turn"),
    ("with acquired as", "worker/queue.py SessionQueue.take (lease + first turn)"),
    ("insert into june_sessions (agent, session, lease_owner", "worker/queue.py SessionQueue.acquire"),
    ("select s.reset_pending", "worker/queue.py SessionQueue.next_turn"),
    ("with released as", "worker/queue.py SessionQueue.release_or_next"),
    ("update june_sessions s set lease_owner = null", "worker/queue.py SessionQueue.release"),
    ("select coalesce(json_agg(body", "stores/postgres.py events (outbox relay)"),
    ("select s.generation", "stores/postgres.py load (transcript)"),
    ("with upd as", "stores/postgres.py commit (a step's checkpoint)"),
]


def name_sql(query: Any) -> str:
    text = " ".join((query if isinstance(query, str) else repr(query)).split())
    for prefix, name in NAMES:
        if text.startswith(prefix):
            return f"pg: {name}"
    return f"pg: {text[:60]}"


class Meter:
    """Counts and times round trips by name while installed."""

    def __init__(self) -> None:
        self.count: collections.Counter[str] = collections.Counter()
        self.wall: collections.Counter[str] = collections.Counter()
        self._undo: list[Callable[[], None]] = []

    def _wrap(self, owner: Any, attr: str, name: Callable[..., str]) -> None:
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            key = name(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.wall[key] += time.perf_counter() - t0
                self.count[key] += 1

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, original))

    def install(self) -> None:
        self._wrap(psycopg.Cursor, "execute", lambda cur, query, *a, **k: name_sql(query))
        # the worker's sink is pipelined: it sends without waiting and reads the replies at the next publish
        self._wrap(
            RedisStreamSink, "_send", lambda sink, cmds, ref: "redis: pipelined send " + ",".join(c[0] for c in cmds)
        )
        self._wrap(RedisStreamSink, "_read_unread", lambda sink, keep=0: "redis: pipelined replies read (owed)")
        self._wrap(redis.Redis, "execute_command", lambda client, *args, **k: f"redis: {args[0]}")
        self._wrap(
            redis.client.Pipeline,
            "execute",
            lambda pipe, *a, **k: "redis: pipeline " + ",".join(str(c[0][0]) for c in pipe.command_stack),
        )

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def clear(self) -> None:
        self.count.clear()
        self.wall.clear()


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 turns")
    parser.add_argument("-n", type=int, default=300, help="turns measured")
    parser.add_argument(
        "--history", default="10,1000,10000", help="messages already in the sessions of the history table ('' skips it)"
    )
    parser.add_argument("--history-turns", type=int, default=0, help="turns per session and host (default: n / 2)")
    args = parser.parse_args()
    if args.quick:
        args.n = 60
    sizes = [int(x) for x in args.history.split(",") if x.strip()]
    print(f"# turn_cost.py  {machine()}  {args.n} turns of the bench agent, each in a new session", flush=True)
    meter = Meter()
    with sigterm_as_exit(), BenchStack("turn-cost") as stack:
        breakdown(stack, meter, args.n)
        if sizes:
            history(stack, meter, sizes, args.history_turns or max(args.n // 2, 2))


def breakdown(stack: BenchStack, meter: Meter, n: int) -> None:
    """Every round trip of a turn, by the code that sends it, over ``n`` turns each in a new session."""
    host = WorkerHost(WorkerSettings.from_env(stack.env), agents={a.name: a for a in ALL()})
    try:

        def turn(label: str) -> dict[str, Any]:
            payload = {"turn_id": f"t_{uuid.uuid4().hex}", "agent": "bench", "session": stack.session(label)}
            return control.intake(host, TurnMessage.model_validate({**payload, "text": "go"}))

        for i in range(20):  # warm-up: pool connections, prepared statements, the script cache
            turn(f"warm-{i}")
        meter.install()
        c0, t0 = cpu_s(), time.perf_counter()
        for i in range(n):
            out = turn(f"t{i}")
            assert out["status"] == "completed", out
        wall_ms = (time.perf_counter() - t0) * 1000 / n
        cpu_ms = (cpu_s() - c0) * 1000 / n
        totals = dict(meter.wall)
        counts = dict(meter.count)
        meter.clear()
        pings, selects = [], []
        with host.store.pool.connection() as conn:
            for _ in range(200):
                p0 = time.perf_counter()
                host.redis.ping()
                p1 = time.perf_counter()
                conn.execute("select 1").fetchone()
                pings.append(p1 - p0)
                selects.append(time.perf_counter() - p1)
    finally:
        meter.uninstall()
        logging.getLogger("june_worker.worker").setLevel(logging.ERROR)  # its listener thread minds the close
        host.close()
    print("| round trip (sent by)                                              | per turn | ms per turn |")
    print("|-------------------------------------------------------------------|---------:|------------:|")
    io_ms = 0.0
    for key in sorted(totals, key=lambda k: -totals[k]):
        ms = totals[key] * 1000 / n
        io_ms += ms
        print(f"| {key:<65} | {counts[key] / n:8.2f} | {ms:11.3f} |")
    trips = sum(counts.values()) / n
    print(f"| {'all of the above':<65} | {trips:8.2f} | {io_ms:11.3f} |")
    print(f"| {'the rest: engine, pydantic, event loop, host':<65} |          | {wall_ms - io_ms:11.3f} |")
    print(f"| {'a whole turn (wall)':<65} |          | {wall_ms:11.3f} |")
    print(
        f"(CPU of this process per turn: {cpu_ms:.2f} ms; in the same run a bare `select 1` took "
        f"{median(selects) * 1000:.3f} ms and a PING {median(pings) * 1000:.3f} ms, medians)",
        flush=True,
    )


# --- turns on sessions with a history ---------------------------------------------------------------------


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
        messages += [("bench", session, i + j, t, m.role, m.model_dump_json()) for j, m in enumerate(shape)][: size - i]
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
