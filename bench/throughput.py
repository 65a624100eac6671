"""Worker throughput, event latency through a worker, and recovery after SIGKILL, on real Celery workers.

    .venv/bin/python bench/throughput.py [--quick] [--parts throughput,latency,recovery] [--brokers redis,amqp]
        [--layouts 1x1,2x1,1x2] [--rounds 5]

Every part starts its own ``celery -A june_worker worker`` processes (prefork, ``-l WARNING``,
``--without-gossip --without-mingle --without-heartbeat``, ``JUNE_AGENTS=bench.agents:ALL``,
``-I bench.tasks``) on a throwaway database ``june_bench_<random>`` of ``JUNE_DATABASE_URL`` and
on ``JUNE_REDIS_URL`` (broker, result backend and streams) under a unique queue name and key
prefix, and removes all of it at the end (see ``bench/_harness.py``).

**throughput**, on each broker of ``--brokers`` (Redis at ``JUNE_REDIS_URL``; RabbitMQ at
``JUNE_BENCH_AMQP_URL``, default ``amqp://guest:guest@127.0.0.1:5672//``, with the shipped
settings: quorum queues, publisher confirms; results and streams stay on Redis): turns per
second for the 3-step turn of the ``bench`` agent (scripted model asks for the sync tool
``tick``, the tool runs, the model answers: 4 commits, 5 structural events), next to the rate
of ``bench.empty``, a task that does nothing, run by the same workers under the same Celery
settings. ``--layouts`` takes any ``AxB``: ``A`` workers of ``-c B`` each (``2x1``: two
single-process workers; ``1x2``: one worker with two pool processes). Every layout runs on a
stack of its own, all started together, and each round runs one batch of each kind on each
layout in turn (the order rotating), so that the machine's load drifts over all of them alike and
layouts can be compared round by round. A batch is sent to a staging queue nobody consumes and
then moved into the workers' queue in one atomic Redis call (on RabbitMQ: sent to the workers'
queue while they do not consume it, then released with one ``add_consumer`` control call to this
stack's workers), so the producer does not compete for the CPUs while the workers drain it. The
rate is the batch size over the time from that move to the last task's end (an empty task's
``date_done``; a turn's ``finished_at`` in Postgres: turn tasks store no result). Turn batches:
each turn in its own session, and ``--per-session`` turns per session (sent back to back).
Every turn of a batch is checked ``completed`` in Postgres. A fourth kind, the **floor**, is
``bench.commits``: a task that makes a turn's four commits and nothing else (four one-row INSERTs in
autocommit, each a round trip and an fsync, on a connection the pool process keeps), so that its
rate over the empty task's says how close to the empty task a turn could come at all while it
commits every step. Figures: the median over rounds of
each rate, and of turns/s divided by the empty-task rate of the same round. Next to them, the CPU
time per task (from ``/proc``) of the workers' main processes (they take every message from the
broker and hand it to the pool) and of their pool processes, of the Postgres client backends of
the bench database (sampled every 50 ms, so connections opened during a batch count too;
autovacuum workers apart, the bench's own queries left out) and of the broker's server
(redis-server, or RabbitMQ's node; shared with whatever else uses it), which the load of other
work on the machine (also printed) distorts far less than it distorts rates. For each pooled
layout ``AxB`` that ran next to ``(A*B)x1``, the ratio of their Postgres CPU per turn, round by
round (target: at most 1.2).

**latency**: the ``stamp`` agent's turns on one worker ``-c 1``, one at a time, each in a new
session followed by a reader in another process blocked in XREAD (``JuneProducer.follow``).
Measured: from the instant a step's commit returned in the worker (the engine's
``before-publish`` hook, as a probe) to the reader holding the decoded event, for
``turn.started``, ``action.requested`` and ``action.completed``; next to it, in the same turns,
how long the worker's ``publish()`` call took (commit returned → ``after-*-commit`` hook), a
delta (one plain XADD by the worker, no commit) from the model's yield to the reader, and a
PING round trip from the bench process. Target: commit to reader p99 under 1.5 ms.

**recovery**: two workers ``-c 1`` and beat; a ``hold`` turn blocks in its tool; at a random
moment within one lease heartbeat (``lease / 3``) the whole process group of the worker running
it gets SIGKILL; measured: from the kill to the bench reading ``turn.completed`` (finished by
the other worker), with the default settings (lease 30 s, sweep 10 s) and with
``JUNE_LEASE_S=5 JUNE_SWEEP_S=1``; broken down into the lease's expiry and the sweeper's
re-send (``dispatched_at``), next to the bound ``lease + sweep`` and an ordinary turn's
send-to-completed time on the same stack.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime
from multiprocessing.connection import Connection
from typing import Any

from _harness import MOVE_LUA, BenchStack, children, cpu_s, machine, machine_busy_s, median, pct, sigterm_as_exit


def layout(text: str) -> list[int]:
    """``AxB``: A workers of ``-c B`` each, as the list of their concurrencies (``2x1`` -> ``[1, 1]``)."""
    workers, sep, pool = text.strip().lower().partition("x")
    if not sep or not workers.isdigit() or not pool.isdigit() or int(workers) < 1 or int(pool) < 1:
        raise argparse.ArgumentTypeError(f"layout {text!r}: expected AxB, A workers of -c B each (e.g. 2x1, 1x4)")
    return [int(pool)] * int(workers)


# --- throughput ----------------------------------------------------------------------------------------


def wait_results(stack: BenchStack, ids: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    """The stored result of every task in ``ids``, polled in send order, a window at a time."""
    pending = list(ids)
    out: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while pending:
        head = pending[:256]
        values = stack.redis.mget([f"celery-task-meta-{t}" for t in head])
        keep = []
        for task_id, raw in zip(head, values, strict=True):
            meta = json.loads(raw) if raw else None
            if meta is not None and meta.get("status") in ("SUCCESS", "FAILURE", "REVOKED"):
                out[task_id] = meta
            else:
                keep.append(task_id)
        pending = keep + pending[len(head) :]
        if pending and len(keep) == len(head):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} of {len(ids)} tasks not done after {timeout_s:.0f}s")
            time.sleep(0.05)
    return out


def wait_turns(stack: BenchStack, batch: str, n: int, timeout_s: float) -> float:
    """Wait until the ``n`` turns of ``batch`` have ended (turn tasks store no result: Postgres is the record);
    return when the last one ended (the database's clock, this machine's). Raises unless all completed."""
    query = (
        "select count(*) filter (where status not in ('queued', 'running')), count(*) filter (where status = "
        "'completed'), max(finished_at) from june_turns where agent = 'bench' and session like %s"
    )
    deadline = time.monotonic() + timeout_s
    while True:
        [(ended, completed, last)] = stack.sql(query, f"{stack.tag}-{batch}-%")
        if ended == n:
            if completed != n:
                raise RuntimeError(f"turn batch {batch}: {completed} of {n} turns completed")
            return float(last)
        if time.monotonic() > deadline:
            raise TimeoutError(f"turn batch {batch}: {ended} of {n} turns ended after {timeout_s:.0f}s")
        time.sleep(0.05)


@dataclass
class Batch:
    rate: float
    """tasks per second"""
    main_ms: float
    """CPU of the workers' main processes (they take messages from the broker and hand them to the pool) per task"""
    pool_ms: float
    """CPU of the workers' pool processes (they run the tasks) per task"""
    pg_ms: float
    """CPU of the Postgres client backends serving the bench database (the workers' connections), per task"""
    vacuum_ms: float
    """CPU of autovacuum workers on the bench database during the batch, per task (apart: it comes and goes)"""
    redis_ms: float
    """CPU of the broker's server per task: redis-server or RabbitMQ's node (shared with whatever else uses it)"""
    others: float
    """share of the machine's CPUs busy with work not counted above, during the batch"""

    @property
    def worker_ms(self) -> float:
        return self.main_ms + self.pool_ms

    @property
    def cpu_ms(self) -> float:
        return self.worker_ms + self.pg_ms + self.redis_ms


def run_batch(stack: BenchStack, kind: str, n: int, per_session: int = 1) -> Batch:
    """Send ``n`` tasks to the staging queue, release them at once, measure until the last one is done."""
    batch = uuid.uuid4().hex[:6]
    ids: list[str] = []
    # Redis: a staging list moved into the queue at once; RabbitMQ: the queue itself, consumed on release.
    staging = stack.staging_queue if stack.broker == "redis" else stack.queue
    if kind in ("empty", "commits"):
        for _ in range(n):
            ids.append(stack.send(f"bench.{kind}", {}, queue=staging).id)
    else:
        for s in range(n // per_session):
            session = stack.session(f"{batch}-{s}")
            for _ in range(per_session):
                task_id = str(uuid.uuid4())
                stack.turn("bench", session, queue=staging, task_id=task_id)
                ids.append(task_id)
    mains = [proc.pid for proc in stack.procs if proc.alive()]
    pool = [p for pid in mains for p in children(pid)]

    def sample() -> tuple[float, float, float, float]:
        return sum(map(cpu_s, mains)), sum(map(cpu_s, pool)), stack.broker_cpu_s(), machine_busy_s()

    with stack.postgres_cpu() as pg:
        before = sample()
        c0 = time.monotonic()
        t0 = time.time()
        if stack.broker == "redis":
            moved = stack.redis.eval(MOVE_LUA, 2, staging, stack.queue)
            assert moved == len(ids), f"moved {moved} of {len(ids)} messages"
        else:
            stack.consume(stack.queue, True)
        if kind in ("empty", "commits"):
            results = wait_results(stack, ids, timeout_s=60 + len(ids) / 5)
        else:
            t_last = wait_turns(stack, batch, len(ids), timeout_s=60 + len(ids) / 5)
        elapsed = time.monotonic() - c0
        if stack.broker != "redis":
            stack.consume(stack.queue, False)
        main, pooled, broker, busy = (b - a for a, b in zip(before, sample(), strict=True))
    if kind in ("empty", "commits"):
        failed = [m for m in results.values() if m["status"] != "SUCCESS"]
        if failed:
            raise RuntimeError(f"{len(failed)} {kind} tasks failed, e.g. {failed[0]}")
        t_end = max(datetime.fromisoformat(m["date_done"]).timestamp() for m in results.values())
    else:
        t_end = t_last
    stack.forget(ids)
    stack.sent.clear()
    ours = main + pooled + pg.clients_s + pg.autovacuum_s + broker
    return Batch(
        rate=len(ids) / (t_end - t0),
        main_ms=main * 1000 / len(ids),
        pool_ms=pooled * 1000 / len(ids),
        pg_ms=pg.clients_s * 1000 / len(ids),
        vacuum_ms=pg.autovacuum_s * 1000 / len(ids),
        redis_ms=broker * 1000 / len(ids),
        others=max(0.0, busy - ours) / (elapsed * (os.cpu_count() or 1)),
    )


@dataclass
class LayoutResult:
    broker: str
    layout: str
    empty: list[Batch] = field(default_factory=list)
    one: list[Batch] = field(default_factory=list)
    many: list[Batch] = field(default_factory=list)
    floor: list[Batch] = field(default_factory=list)
    """``bench.commits``: four one-row commits in a task, what a turn cannot do without."""

    def ratio(self, name: str) -> float:
        """Median over rounds of turns/s over the empty-task rate of the same round."""
        turns: list[Batch] = getattr(self, name)
        return median(t.rate / e.rate for t, e in zip(turns, self.empty, strict=True))

    def rate(self, name: str) -> float:
        return median(b.rate for b in getattr(self, name))

    def ms(self, name: str, what: str = "cpu_ms") -> float:
        """Median over rounds of one CPU figure per task (``cpu_ms``, ``pg_ms``, ``main_ms``, ...)."""
        return median(getattr(b, what) for b in getattr(self, name))


def start_layout(stack: BenchStack, name: str, warmup: int = 40) -> None:
    """Start the workers of layout ``name`` on ``stack``, wait until they consume, and warm them up (``warmup`` empty
    tasks, then as many turns)."""
    # on RabbitMQ the workers consume the turn queue only while a batch is released (run_batch)
    queues = stack.control_queue if stack.broker == "amqp" else None
    procs = [stack.worker(f"w{i}", concurrency=c, queues=queues) for i, c in enumerate(layout(name))]
    stack.wait_ready(*procs)
    if warmup > 0:  # pool processes, connections, prepared statements
        run_batch(stack, "empty", warmup)
        run_batch(stack, "turns", warmup)


def throughput(args: argparse.Namespace) -> list[LayoutResult]:
    """Every layout of one broker runs on its own stack, all started together; each round runs one batch of
    each kind on each layout in turn (the order rotating), so that a drift of the machine's load hits every
    layout alike and layouts can be compared round by round."""
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    for name in names:
        layout(name)  # refuse a bad layout before starting anything
    results: list[LayoutResult] = []
    kinds = [
        ("empty", args.empty, 1),
        ("one", args.turns, 1),
        ("many", args.turns, args.per_session),
        ("floor", args.turns, 1),
    ]
    for broker in args.brokers.split(","):
        with ExitStack() as stacks:
            runs = []
            for name in names:
                stack = stacks.enter_context(BenchStack("throughput", broker=broker))
                start_layout(stack, name, args.layout_warmup)
                runs.append((stack, LayoutResult(broker, name)))
            for r in range(args.rounds):
                order = runs[r % len(runs) :] + runs[: r % len(runs)]
                for stack, res in order:
                    turn = r % len(kinds)
                    for kind, n, k in kinds[turn:] + kinds[:turn]:  # rotate: drift hits every kind alike
                        time.sleep(0.3)
                        task = {"empty": "empty", "floor": "commits"}.get(kind, "turns")
                        getattr(res, kind).append(run_batch(stack, task, n, k))
                    e, o, m, f = res.empty[-1], res.one[-1], res.many[-1], res.floor[-1]
                    print(
                        f"#   {broker} {res.layout} round {r + 1}: empty {e.rate:6.1f}/s  turns {o.rate:5.1f}/s  "
                        f"turns ({args.per_session}/session) {m.rate:5.1f}/s  floor {f.rate:5.1f}/s  | CPU ms/task empty "
                        f"{e.main_ms:.1f}+{e.pool_ms:.1f}+{e.redis_ms:.1f}  turn {o.main_ms:.1f}+{o.pool_ms:.1f}+"
                        f"{o.pg_ms:.2f}+{o.redis_ms:.1f} (main+pool+pg+broker)  "
                        f"| others used {100 * median([e.others, o.others, m.others]):.0f}% of the CPUs",
                        flush=True,
                    )
            results += [res for _, res in runs]
    report(results, args)
    return results


def report(results: list[LayoutResult], args: argparse.Namespace) -> None:
    k = args.per_session
    print()
    print(
        f"| broker | layout | empty task/s | turns/s, 1 per session | ratio | turns/s, {k} per session | ratio | "
        "CPU ms per empty task | CPU ms per turn | CPU ratio | of a turn: main | pool | Postgres | broker | autovacuum | "
        "floor task/s | ratio | CPU ms per floor task |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for res in results:
        print(
            f"| {res.broker} | {res.layout} | {res.rate('empty'):.0f} | {res.rate('one'):.1f} | "
            f"{res.ratio('one'):.2f} | {res.rate('many'):.1f} | {res.ratio('many'):.2f} | "
            f"{res.ms('empty'):.2f} | {res.ms('one'):.2f} | {res.ms('empty') / res.ms('one'):.2f} | "
            f"{res.ms('one', 'main_ms'):.2f} | {res.ms('one', 'pool_ms'):.2f} | {res.ms('one', 'pg_ms'):.2f} | "
            f"{res.ms('one', 'redis_ms'):.2f} | {res.ms('one', 'vacuum_ms'):.2f} | "
            f"{res.rate('floor'):.0f} | {res.ratio('floor'):.2f} | {res.ms('floor'):.2f} |"
        )
    print(
        f"(medians over {args.rounds} rounds, batches of {args.empty} empty tasks and {args.turns} turns; ratio: median "
        "over rounds of turns/s / empty tasks/s of the same round; CPU: worker processes (main: the ones that take "
        "messages from the broker; pool: the ones that run tasks) + Postgres client backends of the bench database "
        "+ the broker's server (redis-server or RabbitMQ's node, shared), per task; CPU ratio: empty / turn, what "
        "the ratio would be if the CPUs were the only limit; autovacuum: CPU of autovacuum workers on the bench "
        "database during the batch, not in the total; floor: bench.commits, four one-row INSERTs in autocommit per "
        "task on the pool process's own connection, what a 3-step turn's four durable commits cost with no engine)"
    )
    for res in results:
        ratio = res.ratio("one")
        print(
            f"target turns/s >= 1/3 of the empty-task rate, {res.broker} {res.layout}: {'met' if ratio >= 1 / 3 else 'MISSED'} "
            f"({res.rate('one'):.1f} turns/s, ratio {ratio:.2f})"
        )
    compare_pooled(results)


def compare_pooled(results: list[LayoutResult]) -> None:
    """Each pooled layout ``AxB`` (B > 1) against ``(A*B)x1``, the same number of pool processes as separate
    workers, when both ran: Postgres CPU per turn, and all CPU per turn, as ratios taken round by round."""
    by = {(r.broker, r.layout): r for r in results}
    for res in results:
        sizes = layout(res.layout)
        if sizes[0] == 1:
            continue
        separate = by.get((res.broker, f"{len(sizes) * sizes[0]}x1"))
        if separate is None:
            continue
        for kind, per in (("one", "1 per session"), ("many", "several per session")):
            for what, label in (("pg_ms", "Postgres CPU"), ("cpu_ms", "all CPU")):
                ratios = [
                    getattr(p, what) / getattr(s, what)
                    for p, s in zip(getattr(res, kind), getattr(separate, kind), strict=True)
                    if getattr(s, what) > 0  # a batch too small to take one CPU tick (10 ms) has nothing to divide by
                ]
                if not ratios:
                    print(f"{label} per turn ({per}), {res.broker} {res.layout} / {separate.layout}: too little CPU")
                    continue
                line = (
                    f"{label} per turn ({per}), {res.broker} {res.layout} / {separate.layout}: median "
                    f"{median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f})"
                )
                if what == "pg_ms" and kind == "one":
                    line = f"target: {line}: {'met' if median(ratios) <= 1.2 else 'MISSED'} (<= 1.2)"
                print(line)


# --- event latency through a worker ----------------------------------------------------------------------


def follow_turns(redis_url: str, prefix: str, conn: Connection) -> None:
    """In its own process: for each (session, turn_id) received, follow that turn and send back what arrived when."""
    from producers import JuneProducer

    producer = JuneProducer(redis_url, key_prefix=prefix)
    while True:
        job = conn.recv()
        if job is None:
            return
        session, turn_id = job
        events = producer.follow("stamp", session, turn_id=turn_id, timeout_s=30, block_ms=5000)
        conn.send("following")
        got = []
        for event in events:  # the first next() sends the XREAD
            now = time.monotonic_ns()
            got.append((event.type, event.data.get("step"), now, event.data.get("text")))
        conn.send(got)


def latency(args: argparse.Namespace) -> None:
    env = {"JUNE_BENCH_PROBE": "1", "JUNE_BENCH_PAUSE_MS": str(args.pause_ms)}
    commit_ns: dict[str, list[int]] = {"turn.started": [], "action.requested": [], "action.completed": []}
    delta_ns: list[int] = []
    publish_ns: list[int] = []
    ping_ns: list[int] = []
    turn_ms: list[float] = []
    with BenchStack("latency", env=env) as stack:
        stack.wait_ready(stack.worker("w0"))
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        reader = ctx.Process(target=follow_turns, args=(stack.redis_url, stack.prefix, theirs), daemon=True)
        reader.start()
        try:
            for i in range(args.warmup + args.latency_turns):
                session = stack.session(f"lat-{i}")
                turn_id = f"t_{uuid.uuid4().hex}"
                ours.send((session, turn_id))
                assert ours.poll(30) and ours.recv() == "following"
                time.sleep(0.005)  # the reader is in XREAD now
                t_send = time.monotonic_ns()
                payload = {"turn_id": turn_id, "agent": "stamp", "session": session, "text": "go"}
                stack.send("june.turn", payload, argsrepr=turn_id)
                assert ours.poll(30), f"turn {turn_id} did not finish; worker log:\n{stack.procs[0].tail()}"
                got = ours.recv()
                for _ in range(3):
                    p0 = time.monotonic_ns()
                    stack.redis.ping()
                    ping_ns.append(time.monotonic_ns() - p0)
                if i < args.warmup:
                    continue
                final = [g for g in got if g[0] == "turn.completed"]
                assert final, f"turn {turn_id} ended with {got[-1][0]}"
                stamps: dict[str, int] = json.loads(final[0][3])
                turn_ms.append((final[0][2] - t_send) / 1e6)
                publish_ns.extend(v - stamps[k[len("after:") :]] for k, v in stamps.items() if k.startswith("after:"))
                for kind, step, at, text in got:
                    if kind == "turn.started":
                        commit_ns[kind].append(at - stamps["turn:open"])
                    elif kind == "action.requested":
                        commit_ns[kind].append(at - next(v for k, v in stamps.items() if k.startswith("model:")))
                    elif kind == "action.completed":
                        commit_ns[kind].append(at - stamps[step])
                    elif kind == "message.delta":
                        delta_ns.append(at - int(text))
        finally:
            ours.send(None)
            reader.join(5)
            if reader.is_alive():
                reader.terminate()
    every = [v for vs in commit_ns.values() for v in vs]

    def row(name: str, values: list[int]) -> str:
        us = [v / 1000 for v in values]
        return f"| {name:<44} | {len(us):5} | {pct(us, 50):7.0f} | {pct(us, 99):7.0f} | {max(us):7.0f} |"

    print()
    print(f"# {args.latency_turns} turns (+{args.warmup} warm-up), worker pauses {args.pause_ms} ms before each step")
    print("| measure (µs)                                 |     n |     p50 |     p99 |     max |")
    print("|----------------------------------------------|------:|--------:|--------:|--------:|")
    print(row("commit returned → reader (all structural)", every))
    for kind, values in commit_ns.items():
        print(row(f"  {kind}", values))
    print(row("publish() call in the worker", publish_ns))
    print(row("delta: model yield → reader (plain XADD)", delta_ns))
    print(row("PING round trip from the bench, baseline", ping_ns))
    print(f"(a whole turn, send → turn.completed read: median {median(turn_ms):.1f} ms, p99 {pct(turn_ms, 99):.1f} ms)")
    p99_ms = pct(every, 99) / 1e6
    print(f"target commit → reader p99 < 1.5 ms: {'met' if p99_ms < 1.5 else 'MISSED'} ({p99_ms:.3f} ms)")


# --- recovery after SIGKILL ---------------------------------------------------------------------------------


def wait_terminal(stack: BenchStack, agent: str, session: str, turn_id: str, timeout_s: float) -> tuple[str, float]:
    last = None
    for event in stack.producer.follow(agent, session, turn_id=turn_id, timeout_s=timeout_s, include_deltas=False):
        last = event
    if last is None or not last.terminal:
        raise TimeoutError(f"turn {turn_id} did not end within {timeout_s:.0f}s")
    return last.type, time.time()


def recovery(args: argparse.Namespace) -> None:
    alive_s = 3.0  # JUNE_ALIVE_S default: a worker whose heartbeat lapsed this long is dead
    settings = [
        ("defaults", {}, 30.0, 10.0, args.recovery_runs),
        ("short lease", {"JUNE_LEASE_S": "5", "JUNE_SWEEP_S": "1"}, 5.0, 1.0, args.short_runs),
    ]
    rows = []
    for label, env, lease_s, sweep_s, runs in settings:
        if runs < 1:
            continue
        total, expiry, redispatch, normal = [], [], [], []
        with BenchStack("recovery", env=env) as stack:
            workers = [stack.worker(f"w{i}") for i in range(2)]
            stack.wait_ready(*workers)
            stack.beat()
            for i in range(args.baseline_turns):  # the baseline: the same stack, nobody dies (2 warm the workers up)
                session = stack.session(f"normal-{i}")
                t0 = time.time()
                turn_id = stack.turn("bench", session)
                kind, t1 = wait_terminal(stack, "bench", session, turn_id, 30)
                assert kind == "turn.completed", kind
                if i >= 2:
                    normal.append(t1 - t0)
            for run in range(runs):
                session = stack.session(f"rec-{run}")
                turn_id = stack.turn("hold", session)
                got = stack.redis.blpop([f"{stack.prefix}:hold:{turn_id}:pids"], timeout=30)
                if got is None:
                    raise TimeoutError(f"the hold tool of {turn_id} never ran")
                pid = int(got[1].split(":")[0])
                # Die at a random moment of the step: the lease was renewed up to one heartbeat (lease/3) ago.
                time.sleep(random.uniform(0, lease_s / 3))
                pgid = os.getpgid(pid)
                victim = next((p for p in stack.procs if p.pid == pgid and p.alive()), None)
                if victim is None:
                    raise RuntimeError(f"pid {pid} (group {pgid}) is not a worker this bench started; not killing it")
                t_kill = time.time()
                victim.kill()
                [(lease_expires, alive_until)] = stack.sql(
                    "select s.lease_expires, w.alive_until from june_sessions s "
                    "left join june_workers w on w.owner = s.lease_owner where s.agent = 'hold' and s.session = %s",
                    session,
                )
                lease_expires = min(lease_expires, alive_until or lease_expires)  # a dead holder's lease is free
                kind, t_done = wait_terminal(stack, "hold", session, turn_id, lease_s + sweep_s + 60)
                assert kind == "turn.completed", kind
                [(dispatched_at,)] = stack.sql(
                    "select dispatched_at from june_turns where agent = 'hold' and session = %s", session
                )
                total.append(t_done - t_kill)
                expiry.append(lease_expires - t_kill)
                redispatch.append((dispatched_at or t_done) - t_kill)
                print(
                    f"#   {label} run {run + 1}: recovered in {total[-1]:5.2f} s (lease free at "
                    f"+{expiry[-1]:5.2f} s, re-sent by the sweeper at +{redispatch[-1]:5.2f} s)",
                    flush=True,
                )
                stack.stop(victim)
                replacement = stack.worker(f"w{run + 2}")
                stack.wait_ready(replacement)
        rows.append((label, lease_s, sweep_s, total, expiry, redispatch, normal))
    print()
    print(
        "| settings | runs | kill → completed, median | min–max | lease free after kill (liveness or expiry) | "
        "sweeper re-sent | bound min(alive, lease)+sweep | ordinary turn |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, lease_s, sweep_s, total, expiry, redispatch, normal in rows:
        print(
            f"| {label} (lease {lease_s:g} s, sweep {sweep_s:g} s) | {len(total)} | {median(total):.2f} s | "
            f"{min(total):.2f}–{max(total):.2f} s | {median(expiry):.2f} s | {median(redispatch):.2f} s | "
            f"{min(alive_s, lease_s) + sweep_s:g} s | {median(normal) * 1000:.0f} ms |"
        )
    for label, _, _, total, *_ in rows:
        print(f"target < 15 s ({label}): {'met' if max(total) < 15 else 'MISSED'} (max {max(total):.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batches, few rounds, one recovery run each")
    parser.add_argument("--parts", default="throughput,latency,recovery")
    parser.add_argument(
        "--layouts", default="1x1,2x1,1x2", help="comma-separated AxB: A workers of -c B each (e.g. 2x1,1x2,1x4)"
    )
    parser.add_argument("--brokers", default="redis,amqp", help="throughput on these brokers: redis, amqp")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=400, help="turns per batch")
    parser.add_argument("--empty", type=int, default=1000, help="empty tasks per batch")
    parser.add_argument("--per-session", type=int, default=5, help="turns per session in the second turn batch")
    parser.add_argument("--layout-warmup", type=int, default=40, help="empty tasks, then turns, warming each layout up")
    parser.add_argument("--latency-turns", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--pause-ms", type=float, default=2.0, help="worker's pause before each step (latency)")
    parser.add_argument("--recovery-runs", type=int, default=3, help="kills with the default settings")
    parser.add_argument("--short-runs", type=int, default=8, help="kills with JUNE_LEASE_S=5 JUNE_SWEEP_S=1")
    parser.add_argument(
        "--baseline-turns", type=int, default=6, help="ordinary turns before the kills (recovery), the first 2 warm-up"
    )
    args = parser.parse_args()
    if args.baseline_turns < 3:
        parser.error(f"--baseline-turns {args.baseline_turns}: expected at least 3 (2 warm the workers up)")
    if args.quick:
        args.rounds, args.turns, args.empty = 2, 100, 300
        args.latency_turns, args.warmup = 60, 5
        args.recovery_runs, args.short_runs = 1, 3
    parts = args.parts.split(",")
    print(f"# throughput.py  {machine()}  parts: {', '.join(parts)}{'  (quick)' if args.quick else ''}", flush=True)
    with sigterm_as_exit():
        if "throughput" in parts:
            print("\n## worker throughput", flush=True)
            throughput(args)
        if "latency" in parts:
            print("\n## event latency through a worker", flush=True)
            latency(args)
        if "recovery" in parts:
            print("\n## recovery after SIGKILL", flush=True)
            recovery(args)


if __name__ == "__main__":
    main()
