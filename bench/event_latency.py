"""Event latency: from ``RedisStreamSink.publish`` (right after the step's commit) to a reader
blocked in XREAD (``june_worker.events.follow``, another process) receiving the event.

Next to it, in the same run: a delta's latency to the same reader (a plain XADD, no script: the
floor for any event), and the round trip of a bare PING on the sink's own connection. Target:
publish-to-reader p99 under 1.5 ms.

    .venv/bin/python bench/event_latency.py [--url redis://127.0.0.1:6379/0] [-n 3000]

The reader runs in its own process (as the HTTP gateway would), so the two never share a GIL;
timestamps are CLOCK_MONOTONIC, which is system-wide on Linux. The publisher pauses
``--pause-ms`` before each measured call so that each event finds the reader blocked again
(on a 2-CPU machine a reader still busy with the previous event adds scheduler delays of
milliseconds that have nothing to do with Redis). Keys go under a throwaway
prefix and are deleted at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time
import uuid
from multiprocessing.connection import Connection

import redis

from june_worker.engine.events import MessageCompleted, MessageDelta, TurnCompleted
from june_worker.engine.store import Commit, SessionRef
from june_worker.events import EventKeys, RedisStreamSink, follow
from june_worker.stores import SQLiteStore


def reader(url: str, prefix: str, agent: str, session: str, out: Connection) -> None:
    client = redis.Redis.from_url(url)
    stream = follow(client, agent, session, last_id="$", keys=EventKeys(prefix=prefix))
    out.send("ready")  # "$" is pinned: everything published from now on is seen
    for item in stream:
        out.send((item.event.type, item.event.seq, time.monotonic_ns()))
        if item.event.type == "turn.completed":
            return


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def row(name: str, values_ns: list[int]) -> str:
    us = [v / 1000 for v in values_ns]
    return f"| {name:<38} | {pct(us, 50):7.1f} | {pct(us, 99):7.1f} | {max(us):8.1f} | {statistics.fmean(us):7.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("JUNE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("-n", type=int, default=3000, help="events measured")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--no-firehose", action="store_true", help="publish to the session stream only")
    parser.add_argument("--pause-ms", type=float, default=1.0, help="time between measured calls")
    parser.add_argument(
        "--idle", action="store_true", help="sleep between calls (the CPU may halt) instead of spinning (a busy worker)"
    )
    args = parser.parse_args()

    prefix = f"june-bench-{uuid.uuid4().hex[:8]}"
    keys = EventKeys(prefix=prefix)
    ref = SessionRef("bench", f"s-{uuid.uuid4().hex[:8]}")
    store = SQLiteStore(":memory:")
    sink = RedisStreamSink.from_url(args.url, keys=keys, store=store, firehose=not args.no_firehose)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=reader, args=(args.url, prefix, ref.agent, ref.session, theirs), daemon=True)
    proc.start()
    assert ours.poll(30) and ours.recv() == "ready", "the reader did not start"

    commit_ns: list[int] = []
    publish_ns: list[int] = []
    latency_ns: list[int] = []
    delta_ns: list[int] = []
    ping_ns: list[int] = []
    pause_ns = int(args.pause_ms * 1e6)

    def between() -> None:
        """Let the reader block in XREAD again: by sleeping (--idle) or by spinning like a busy worker."""
        if args.idle:
            time.sleep(pause_ns / 1e9)
            return
        until = time.monotonic_ns() + pause_ns
        while time.monotonic_ns() < until:
            pass

    try:
        for i in range(args.warmup + args.n):
            between()
            p0 = time.monotonic_ns()
            sink.client.ping()
            p1 = time.monotonic_ns()
            between()
            c0 = time.monotonic_ns()
            events = store.commit(ref, Commit(events=[MessageCompleted(turn_id="t_bench", step=f"m:{i}", text="ok")]))
            t0 = time.monotonic_ns()
            sink.publish(ref, events)
            t1 = time.monotonic_ns()
            assert ours.poll(10), f"event {events[0].seq} never reached the reader"
            kind, seq, received = ours.recv()
            assert seq == events[0].seq, (kind, seq, events[0].seq)
            between()
            d0 = time.monotonic_ns()
            sink.publish_delta(ref, MessageDelta(turn_id="t_bench", step=f"m:{i}", text="tok"))
            assert ours.poll(10), f"delta {i} never reached the reader"
            kind, _, delta_received = ours.recv()
            assert kind == "message.delta", kind
            if i >= args.warmup:
                commit_ns.append(t0 - c0)
                publish_ns.append(t1 - t0)
                latency_ns.append(received - t0)
                delta_ns.append(delta_received - d0)
                ping_ns.append(p1 - p0)
        sink.publish(ref, store.commit(ref, Commit(events=[TurnCompleted(turn_id="t_bench", text="done")])))
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.terminate()
        stale = list(sink.client.scan_iter(match=f"{prefix}:*", count=1000))
        if stale:
            sink.client.delete(*stale)
        info = sink.client.info("server")
        sink.client.close()
        store.close()

    print(
        f"# event latency: {args.n} events (+{args.warmup} warm-up), firehose {'off' if args.no_firehose else 'on'}, "
        f"{'sleeping' if args.idle else 'spinning'} {args.pause_ms} ms between calls, "
        f"redis {info.get('redis_version')}, python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs"
    )
    print("| measure (µs)                           |     p50 |     p99 |      max |    mean |")
    print("|----------------------------------------|--------:|--------:|---------:|--------:|")
    print(row("publish → reader blocked in XREAD", latency_ns))
    print(row("delta (plain XADD) → reader, baseline", delta_ns))
    print(row("publish() call (EVALSHA pipeline)", publish_ns))
    print(row("PING round trip, same connection", ping_ns))
    print(row("SQLite commit (in memory), for scale", commit_ns))
    p99_ms = pct([v / 1e6 for v in latency_ns], 99)
    print(f"target p99 < 1.5 ms: {'met' if p99_ms < 1.5 else 'MISSED'} ({p99_ms:.3f} ms)")


if __name__ == "__main__":
    main()
