"""Cancel latency: from a cancel request to ``turn.cancelled`` in the session stream, while the model streams.

    .venv/bin/python bench/cancel_latency.py [--quick] [-n 60] [--control-pool prefork|solo]

Starts, on a throwaway database of ``JUNE_DATABASE_URL`` and on ``JUNE_REDIS_URL`` (unique queue
names and key prefix, all removed at the end), one turn worker (``celery -A june_worker worker
-P prefork -c 1 -Q <turn queue>``) and one control worker (``-c 1 -Q <control queue>``): the
layout the design asks for, control messages on their own queue so that they are not stuck
behind a running turn. The ``dribble`` agent's model (``bench/agents.py``) streams a delta
every 2 ms for a minute.

Each of ``-n`` cancels: a turn starts in a new session (``JuneProducer.start_turn``), a reader
in another process follows the session (``JuneProducer.follow``, blocked in XREAD, deltas
included, as a UI would); once deltas flow, the bench measures the baseline (``bench.empty``
sent to the control queue and its result read back: a broker round trip through the same
control worker and result backend), then calls ``JuneProducer.cancel`` and measures:

* **request → turn.cancelled read**: from just before ``cancel()`` to the reader holding
  ``turn.cancelled`` (the cancel task records the request in Postgres, publishes the signal on
  the session's control channel; the turn worker's listener thread sets the running turn's
  cancel probe, the model stream is abandoned at the next delta, the cancel commits and is
  published);
* **cancel() call**: until ``cancel()`` returned the control task's summary.

Figures are medians and p99 over the ``-n`` cancels, the baseline next to them. Target:
request → ``turn.cancelled`` under 100 ms.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import time
import uuid
from multiprocessing.connection import Connection

from _harness import BenchStack, machine, median, pct, sigterm_as_exit


def follow_session(redis_url: str, prefix: str, conn: Connection) -> None:
    """In its own process: follow each (session, turn_id) received; report the first delta and the end."""
    from producers import JuneProducer

    producer = JuneProducer(redis_url, key_prefix=prefix)
    while True:
        job = conn.recv()
        if job is None:
            return
        session, turn_id = job
        events = producer.follow("dribble", session, turn_id=turn_id, timeout_s=120)
        conn.send("following")
        seen_delta = False
        for event in events:
            now = time.monotonic_ns()
            if event.delta and not seen_delta:
                seen_delta = True
                conn.send(("delta", now))
            elif event.terminal:
                conn.send((event.type, now))
        conn.send(("end", time.monotonic_ns()))


def expect(conn: Connection, kind: str, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(max(0.0, deadline - time.monotonic())):
            got, at = conn.recv()
            if got == kind:
                return int(at)
            if got == "end":
                break
    raise TimeoutError(f"no {kind} within {timeout_s:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 cancels")
    parser.add_argument("-n", type=int, default=60, help="cancels measured")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--control-pool", default="prefork", choices=["prefork", "solo"])
    args = parser.parse_args()
    if args.quick:
        args.n, args.warmup = 10, 2
    print(f"# cancel_latency.py  {machine()}  {args.n} cancels, control worker pool {args.control_pool}", flush=True)
    cancel_ms: list[float] = []
    call_ms: list[float] = []
    empty_ms: list[float] = []
    with sigterm_as_exit(), BenchStack("cancel", env={"JUNE_BENCH_DELTAS": "30000"}) as stack:
        turns = stack.worker("turns", queues=stack.queue)
        control = stack.worker("control", pool=args.control_pool, queues=stack.control_queue)
        stack.wait_ready(turns, control)
        producer = stack.producer
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        reader = ctx.Process(target=follow_session, args=(stack.redis_url, stack.prefix, theirs), daemon=True)
        reader.start()
        try:
            for i in range(args.warmup + args.n):
                session = stack.session(f"c{i}")
                turn_id = f"t_{uuid.uuid4().hex}"
                ours.send((session, turn_id))
                assert ours.poll(30) and ours.recv() == "following"
                producer.start_turn("dribble", session, "stream", turn_id=turn_id)
                expect(ours, "delta", 30)
                time.sleep(random.uniform(0.02, 0.06))
                e0 = time.monotonic_ns()
                result = stack.send("bench.empty", {}, queue=stack.control_queue, wait=True)
                result.get(timeout=30)
                e1 = time.monotonic_ns()
                result.forget()
                time.sleep(random.uniform(0.01, 0.03))
                c0 = time.monotonic_ns()
                summary = producer.cancel("dribble", session, turn_id)
                c1 = time.monotonic_ns()
                assert summary.get("status") == "cancel-requested", summary
                at = expect(ours, "turn.cancelled", 30)
                expect(ours, "end", 30)
                if i >= args.warmup:
                    cancel_ms.append((at - c0) / 1e6)
                    call_ms.append((c1 - c0) / 1e6)
                    empty_ms.append((e1 - e0) / 1e6)
        finally:
            ours.send(None)
            reader.join(5)
            if reader.is_alive():
                reader.terminate()

    def row(name: str, values: list[float]) -> str:
        return f"| {name:<52} | {median(values):8.1f} | {pct(values, 99):8.1f} | {max(values):8.1f} |"

    print("| measure (ms)                                         |   median |      p99 |      max |")
    print("|------------------------------------------------------|---------:|---------:|---------:|")
    print(row("cancel() → turn.cancelled read by the follower", cancel_ms))
    print(row("cancel() call (until its summary came back)", call_ms))
    print(row("empty task round trip, control queue (baseline)", empty_ms))
    print(f"(ratio, medians: cancel → turn.cancelled / empty round trip = {median(cancel_ms) / median(empty_ms):.2f})")
    p99 = pct(cancel_ms, 99)
    print(f"target cancel → turn.cancelled < 100 ms: {'met' if p99 < 100 else 'MISSED'} (p99 {p99:.1f} ms)")


if __name__ == "__main__":
    main()
