"""Chaos: N turns over M sessions on 2 workers while a killer SIGKILLs worker processes and Redis restarts once.

What it does:

* starts its own ``redis-server`` (broker, task results and event streams) on a free port, with
  AOF (``appendfsync everysec``) as docker-compose.yml runs it, and its own database;
* starts 2 workers (``--pool prefork -c 2`` each, or with ``--mode threads`` one process of up to 100 turns
  each under june's supervisor, ``june worker --turns-per-process 100``) and beat (the sweeper, every second);
* sends ``--turns`` turns of the ``chaos`` agent (model, sync tool writing one row, model) over
  ``--sessions`` sessions at ``--rate`` turns a second; a send that fails (Redis restarting) is
  sent again under the same turn id until the broker takes it: a turn counts as accepted once
  its send returned;
* every 2-5 s SIGKILLs a random worker process, a worker's main process or one of its pool
  processes; a main process that dies takes its pool with it (its process group) and a new
  worker takes its place; Celery replaces a pool process by itself;
* restarts Redis once (SIGTERM, then the same server again on its AOF), halfway through sending;
* goes on killing until every accepted turn has ended (at most ``--settle-s``), then lets the relay
  catch up (at most as long again, 60 s at most);
* replaces a worker whose main process exited on its own, as a supervisor would (Celery's consumer may
  exit on a broker connection lost while Redis restarts), and says so.

It prints, and exits 1 if any is not zero: lost turns (accepted, never completed), failed turns,
duplicate and missing sync writes, duplicate (the same seq twice, or the same event under two seqs:
a second turn.started of a turn, an action twice) and missing structural events in the session
streams, stuck sessions (a turn still queued or running); and, for the turns a killed process
held, how long after the kill each completed (p50 / p99).

    python bench/chaos.py --turns 500 --sessions 50
    python bench/chaos.py --turns 500 --sessions 50 --mode threads
    python bench/chaos.py --turns 500 --sessions 50 --mode threads --broker amqp --durable
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import (  # noqa: E402
    BenchStack,
    Proc,
    children,
    machine,
    median,
    pct,
    repeated_events,
    sigterm_as_exit,
    wait_for,
)
from june_wire.keys import EventKeys, SessionRef  # noqa: E402

TERMINAL = ("completed", "failed", "cancelled", "rejected")


TURNS_PER_PROCESS = 100
"""A threads-mode worker's turns in flight at most."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnRedis:
    """A redis-server of this bench's own, with AOF, that can be restarted on its data."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="june-chaos-redis-"))
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        args = [
            shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.dir), "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            args, stdout=(self.dir / "log").open("ab"), stderr=subprocess.STDOUT, start_new_session=True
        )

        def answers() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(answers, timeout_s=20, what="redis-server")

    def restart(self) -> float:
        """Stop (SIGTERM: the AOF is flushed), start again; return how long it was down."""
        assert self.proc is not None
        down = time.monotonic()
        self.proc.terminate()
        self.proc.wait(20)
        self.start()
        return time.monotonic() - down

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Kill:
    at: float
    pid: int
    what: str
    turns: list[str] = field(default_factory=list)


class Chaos:
    def __init__(
        self, stack: BenchStack, rng: random.Random, every: tuple[float, float], *, mode: str = "prefork"
    ) -> None:
        self.stack = stack
        self.mode = mode
        """``prefork`` (-c 2) or ``threads`` (many turns per process, under june's supervisor: killing its child
        process is killing the one process of all its turns)."""
        self.rng = rng
        self.every = every
        self.kills: list[Kill] = []
        self.exited: list[str] = []
        """Workers whose main process exited on its own (replaced, as a supervisor would): why, from their logs."""
        self.stop = threading.Event()
        self.workers = 0
        self.lock = threading.Lock()

    def start_worker(self) -> Proc:
        self.workers += 1
        if self.mode == "threads":
            proc = self.stack.worker(f"w{self.workers}", pool="threads", concurrency=TURNS_PER_PROCESS)
        else:
            proc = self.stack.worker(f"w{self.workers}", pool="prefork", concurrency=2)
        self.stack.wait_ready(proc)
        return proc

    def held_turns(self, pids: list[int]) -> list[str]:
        """The turns the sessions leased by these processes are running now (owner = host:pid:token)."""
        owners = [f"%:{pid}:%" for pid in pids]
        rows = self.stack.sql(
            """
            select t.turn_id from june_sessions s
              join lateral (select turn_id from june_turns t where t.agent = s.agent and t.session = s.session
                              and t.status in ('queued', 'running') order by position limit 1) t on true
             where s.lease_owner like any(%s)
            """,
            owners,
        )
        return [r[0] for r in rows]

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(*self.every)):
            self._round("killer", kill=True)

    def supervise(self, done: threading.Event) -> None:
        """After the kills, until ``done``: only replace workers that exit, as a supervisor goes on doing. A worker
        may exit on the broker's restart late (Celery's consumer, as above): with none left, no sweep would run and
        the relay the report waits for would never come."""
        while not done.wait(0.5):
            self._round("supervisor", kill=False)

    def _round(self, who: str, *, kill: bool) -> None:
        with self.lock:
            try:
                self._replace_exited()
                if kill:
                    self._kill_one()
            except Exception as exc:  # (a worker slow to start on a busy machine): the next round goes on
                print(f"# {who}: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _replace_exited(self) -> None:
        """Start a new worker for each one whose main process exited without being killed here, as a deployment's
        supervisor does (docker-compose.yml: ``restart: unless-stopped``): Celery's own exit on a lost broker
        connection (an ``Unrecoverable error`` of the consumer) would otherwise leave turns with no worker."""
        for proc in [p for p in self.stack.procs if p.name.startswith("w") and not p.alive()]:
            why = next((line for line in proc.text().splitlines() if "Unrecoverable error" in line), "")
            self.exited.append(why.strip() or f"{proc.name} exited")
            self.stack.stop(proc)
            self.start_worker()

    def _kill_one(self) -> None:
        workers = [p for p in self.stack.procs if p.name.startswith("w") and p.alive()]
        if not workers:
            return
        victim = self.rng.choice(workers)
        pool = children(victim.pid)
        pid = self.rng.choice([victim.pid, *pool])
        main = pid == victim.pid
        doomed = [pid, *pool] if main else [pid]
        turns = self.held_turns(doomed)
        at = time.time()
        if main:
            victim.kill()  # the process group: its pool goes with it, as when a machine dies
            self.stack.stop(victim)
            self.start_worker()
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return
        self.kills.append(Kill(at=at, pid=pid, what="main" if main else "pool", turns=turns))


def send_all(
    stack: BenchStack, redis: OwnRedis, turns: int, sessions: int, rate: float, *, durable: bool = False
) -> tuple[list[tuple[str, str]], float]:
    accepted: list[tuple[str, str]] = []
    restarted_down_s = 0.0
    start = time.monotonic()
    for n in range(turns):
        if n == turns // 2:
            restarted_down_s = redis.restart()
        session = stack.session(f"s{n % sessions}")
        turn_id = f"t_{stack.tag}{n:06d}"
        payload = {"turn_id": turn_id, "agent": "chaos", "session": session, "text": f"turn {n}"}
        while True:
            try:
                if durable:  # recorded in Postgres first: the sweeper sends it again if the broker loses it
                    stack.durable_producer().start_turn("chaos", session, f"turn {n}", turn_id=turn_id)
                else:
                    stack.send("june.turn", payload, argsrepr=f"{{chaos {session} {turn_id}}}")
                break
            except Exception:  # the broker is restarting: the same turn again, under the same id
                time.sleep(0.2)
        accepted.append((session, turn_id))
        time.sleep(max(0.0, start + (n + 1) / rate - time.monotonic()))
    return accepted, restarted_down_s


def ended(stack: BenchStack, accepted: list[tuple[str, str]]) -> int:
    rows = stack.sql("select count(*) from june_turns where status in ('completed', 'failed', 'cancelled', 'rejected')")
    return int(rows[0][0])


def structural_events(stack: BenchStack, session: str) -> list[dict[str, Any]]:
    out = []
    for _, fields in stack.redis.xrange(stack.stream_key("chaos", session)):
        if not fields["type"].endswith(".delta"):
            out.append(json.loads(fields["data"]))
    return out


def structural_seqs(stack: BenchStack, session: str) -> list[int]:
    return [int(e["seq"]) for e in structural_events(stack, session)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=500)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--rate", type=float, default=20.0, help="turns sent per second")
    parser.add_argument("--pause-ms", type=float, default=20.0, help="each model and tool step waits this long")
    parser.add_argument("--kill-every", type=float, nargs=2, default=(2.0, 5.0), metavar=("MIN_S", "MAX_S"))
    parser.add_argument("--settle-s", type=float, default=240.0, help="how long to wait for every turn to end")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--mode", choices=("prefork", "threads"), default="prefork",
        help="workers of -c 2 pool processes, or of one process running many turns (--turns-per-process)",
    )  # fmt: skip
    parser.add_argument(
        "--broker", choices=("redis", "amqp"), default="redis",
        help="the broker: the Redis that restarts (default), or RabbitMQ (JUNE_BENCH_AMQP_URL; only events and "
        "results are on the restarting Redis then)",
    )  # fmt: skip
    parser.add_argument(
        "--durable", action="store_true", help="send through JuneProducer(durable=True): each turn recorded first"
    )
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)

    redis = OwnRedis()
    os.environ["JUNE_REDIS_URL"] = redis.url
    env = {"JUNE_LEASE_S": "5", "JUNE_ALIVE_S": "1", "JUNE_SWEEP_S": "1", "JUNE_BENCH_PAUSE_MS": str(args.pause_ms)}
    try:
        with sigterm_as_exit(), BenchStack("chaos", env=env, broker=args.broker) as stack:
            stack.sql("create table chaos_writes (turn_id text not null, call_id text not null)")
            chaos = Chaos(stack, rng, tuple(args.kill_every), mode=args.mode)
            chaos.start_worker()
            chaos.start_worker()
            beat = stack.beat()
            killer = threading.Thread(target=chaos.run, name="killer", daemon=True)
            began = time.monotonic()
            killer.start()
            accepted, down_s = send_all(stack, redis, args.turns, args.sessions, args.rate, durable=args.durable)
            try:
                wait_for(lambda: ended(stack, accepted) >= len(accepted), timeout_s=args.settle_s, every_s=0.5,
                         what="every accepted turn to end")  # fmt: skip
            except TimeoutError as exc:
                print(f"# {exc}", file=sys.stderr)
            chaos.stop.set()
            killer.join()
            chaos_s = time.monotonic() - began
            settled = threading.Event()
            supervisor = threading.Thread(target=chaos.supervise, args=(settled,), name="supervisor", daemon=True)
            supervisor.start()
            try:
                report(stack, chaos, accepted, args, seed, chaos_s, down_s, beat)
            finally:
                settled.set()
                supervisor.join()
    finally:
        redis.close()


def explain_relay(stack: BenchStack, sessions: list[str], beat: Proc) -> None:
    """What a relay that did not catch up left behind, for the next reader: each session's stream against its
    outbox and its relay state, and the sweeper's process (beat) with the end of its log."""
    for s in sessions:
        seqs = sorted(set(structural_seqs(stack, s)))
        row = stack.sql(
            "select event_seq, relayed_seq, relay_due, lease_owner from june_sessions where agent = 'chaos' and session = %s",
            s,
        )
        print(
            f"# {s}: stream holds {len(seqs)} seqs (last {seqs[-1] if seqs else 0}); session row {row}", file=sys.stderr
        )
        marker = stack.redis.get(EventKeys(stack.prefix).session_marker(SessionRef("chaos", s)))
        print(f"#   its stream's marker in Redis: {marker}", file=sys.stderr)
    print(f"# beat {'alive' if beat.alive() else 'exited'}; its log ends:", file=sys.stderr)
    for line in beat.text().splitlines()[-6:]:
        print(f"#   {line[:200]}", file=sys.stderr)
    for q in (stack.queue, stack.control_queue):
        print(f"# broker queue {q}: {stack.redis.llen(q)} messages waiting", file=sys.stderr)
    for proc in stack.procs:
        if proc is beat:
            continue
        told = [line for line in proc.text().splitlines() if "WARNING" in line or "ERROR" in line or "CRITICAL" in line]
        print(f"# {proc.name} ({'alive' if proc.alive() else 'exited'}): {len(told)} warnings or errors, the last:",
              file=sys.stderr)  # fmt: skip
        for line in told[-6:]:
            print(f"#   {line[:300]}", file=sys.stderr)


def report(
    stack: BenchStack, chaos: Chaos, accepted: list[tuple[str, str]], args: argparse.Namespace, seed: int,
    chaos_s: float, down_s: float, beat: Proc,
) -> None:  # fmt: skip
    status = dict(stack.sql("select turn_id, status from june_turns"))
    finished = {
        t: float(f) for t, f in stack.sql("select turn_id, finished_at from june_turns where finished_at is not null")
    }
    lost = [t for _, t in accepted if status.get(t) not in TERMINAL]
    failed = [t for _, t in accepted if status.get(t) in ("failed", "cancelled", "rejected")]
    duplicate_writes = stack.sql(
        "select turn_id, call_id, count(*) from chaos_writes group by 1, 2 having count(*) > 1"
    )
    written = {t for (t,) in stack.sql("select distinct turn_id from chaos_writes")}
    missing_writes = [t for _, t in accepted if status.get(t) == "completed" and t not in written]
    stuck = stack.sql("select distinct session from june_turns where status in ('queued', 'running')")
    # The streams: every structural event of the outbox once, in order, once the relay caught up.
    committed = dict(stack.sql("select session, event_seq from june_sessions where agent = 'chaos'"))
    sessions = sorted({s for s, _ in accepted})

    def streams_complete() -> bool:
        return all(sorted(set(structural_seqs(stack, s))) == list(range(1, committed.get(s, 0) + 1)) for s in sessions)

    try:
        wait_for(streams_complete, timeout_s=min(60.0, args.settle_s), every_s=0.5, what="the relay to catch up")
    except TimeoutError as exc:
        print(f"# {exc}", file=sys.stderr)
        explain_relay(stack, sessions, beat)
    duplicate_events = missing_events = out_of_order = 0
    for s in sessions:
        events = structural_events(stack, s)
        seqs = [int(e["seq"]) for e in events]
        # the same entry appended twice (a seq seen twice), or the same event committed twice (two seqs, one meaning)
        duplicate_events += len(seqs) - len(set(seqs)) + len(repeated_events({e["seq"]: e for e in events}.values()))
        missing_events += len(set(range(1, committed.get(s, 0) + 1)) - set(seqs))
        out_of_order += sum(1 for a, b in zip(seqs, seqs[1:], strict=False) if b <= a)
    recovery = [finished[t] - k.at for k in chaos.kills for t in k.turns if t in finished and finished[t] >= k.at]
    mains = sum(1 for k in chaos.kills if k.what == "main")
    workers = (
        f"2 workers x {TURNS_PER_PROCESS} turns in one process"
        if chaos.mode == "threads"
        else "2 workers x 2 processes"
    )
    print(f"# chaos  {machine()}  seed {seed}")
    print(
        f"# {len(accepted)} turns over {len(sessions)} sessions at {args.rate:g}/s, steps pausing {args.pause_ms:g} ms, "
        f"{workers}; broker {args.broker}{', durable enqueue' if args.durable else ''}; {len(chaos.kills)} SIGKILLs ({mains} main, {len(chaos.kills) - mains} pool) "
        f"every {args.kill_every[0]:g}-{args.kill_every[1]:g} s over {chaos_s:.0f} s; Redis restarted once "
        f"(down {down_s:.2f} s)"
    )
    rows = [
        ("lost turns", len(lost)),
        ("failed turns", len(failed)),
        ("duplicate sync writes", len(duplicate_writes)),
        ("missing sync writes", len(missing_writes)),
        ("duplicate structural events", duplicate_events),
        ("missing structural events", missing_events),
        ("structural events out of order", out_of_order),
        ("stuck sessions", len(stuck)),
    ]
    for name, count in rows:
        print(f"{name:32s} {count}")
    if chaos.exited:  # not a violation: the turns they held are recovered like a killed worker's
        print(f"{'workers exited, replaced':32s} {len(chaos.exited)}  ({chaos.exited[0][:120]})")
    if recovery:
        print(
            f"{'recovery after a kill':32s} p50 {median(recovery):.2f} s  p99 {pct(recovery, 99):.2f} s  "
            f"(max {max(recovery):.2f} s, {len(recovery)} turns held by a killed process)"
        )
    for name, items in (("lost", lost), ("failed", failed), ("missing writes", missing_writes)):
        if items:
            print(f"# {name}: {', '.join(items[:10])}", file=sys.stderr)
    if any(count for _, count in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
