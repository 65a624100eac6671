"""What a turn in flight costs a worker: many turns in one process (threads) next to one turn per process (prefork).

Each turn (the ``wait`` agent of bench/agents.py) makes two model calls and one async tool call, each waiting W
seconds, as real turns wait on a model and a service: a turn waits 3 W in all. All turns are sent at once, each
in a session of its own, to

* ONE worker process in the new mode (``june worker --turns-per-process N``, Celery's threads pool), and
* a prefork worker with ``-c 8`` (one turn per pool process),

each on a queue of its own, first with W = 0 (what the turns cost when nothing waits: their wall time and the
workers' CPU per turn) in ``--cpu-rounds`` rounds, the modes alternating (the order swapped every round, so that
the machine's drift hits both alike), then with W (``--wait``, default 2 s). For each, it prints the turns in
flight at the peak (rows ``running`` at once), the wall time, the worker process tree's PSS per in-flight turn
(its peak minus its idle PSS, over the peak in flight), the Postgres connections the worker held at most, and
``overlap`` = wall(W) / (3 W + wall(W = 0)): 1 when the turns' waits overlap perfectly, the number of waves when
they do not. Its last line::

    inflight: <turns> turns in flight, <MB> MB per in-flight turn, <n> Postgres connections, overlap <r>

is the new mode's. The CPU line compares the modes on turns per CPU-second of the worker processes (turns/s per
core), W = 0: the ratio of each round, and their median. Needs JUNE_DATABASE_URL / JUNE_REDIS_URL (defaults:
the machine's own).

    python bench/inflight.py                     # 1,000 turns, W = 2 s, prefork 64 turns
    python bench/inflight.py --turns 20 --prefork-turns 8 --wait 0.2 --cpu-rounds 2   # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import BenchStack, Proc, cpu_s, machine, sigterm_as_exit, wait_for  # noqa: E402

MODES = ("threads", "prefork")


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo.extend(int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def pss_mb(pids: list[int]) -> float:
    """The proportional set size of these processes, in MB (shared pages split between their sharers)."""
    total_kb = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
                    break
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total_kb / 1024


@dataclass
class Run:
    mode: str
    wait_s: float
    turns: int
    wall_s: float = 0.0
    peak_inflight: int = 0
    peak_pss_mb: float = 0.0
    idle_pss_mb: float = 0.0
    connections: int = 0
    cpu_s: float = 0.0
    samples: list[tuple[float, int, float, int]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Turns per CPU-second of the worker's processes."""
        return self.turns / max(self.cpu_s, 1e-9)

    @property
    def mb_per_turn(self) -> float:
        return (self.peak_pss_mb - self.idle_pss_mb) / max(self.peak_inflight, 1)

    def line(self) -> str:
        return (
            f"{self.mode:<8} W={self.wait_s:<4g} {self.turns:>5} turns: peak {self.peak_inflight:>5} in flight, "
            f"wall {self.wall_s:7.2f}s, PSS {self.idle_pss_mb:6.1f} -> {self.peak_pss_mb:7.1f} MB "
            f"({self.mb_per_turn:6.2f} MB per in-flight turn; the whole tree over the turns in flight: "
            f"{self.peak_pss_mb / max(self.peak_inflight, 1):6.2f} MB), {self.connections} Postgres connections, "
            f"worker CPU {self.cpu_s:6.2f}s ({self.rate:7.1f} turns per CPU-second)"
        )


def _connections(stack: BenchStack, mode: str) -> int:
    """The Postgres connections the mode's worker holds (its processes name them: PGAPPNAME, see :func:`start`)."""
    rows = stack.sql(
        "select count(*) from pg_stat_activity where datname = current_database() and application_name = %s",
        app_name(mode),
    )
    return int(rows[0][0])


def measure(stack: BenchStack, worker: Proc, mode: str, turns: int, wait_s: float, queue: str) -> Run:
    """Send ``turns`` turns at once to ``queue`` and watch the worker until every one ended."""
    run = Run(mode, wait_s, turns)
    pids = tree(worker.pid)
    run.idle_pss_mb = pss_mb(pids)
    cpu0 = sum(cpu_s(p) for p in pids)
    label = f"{mode}-{wait_s:g}-{time.monotonic_ns()}"
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            running = int(stack.sql("select count(*) from june_turns where status = 'running'")[0][0])
            pss = pss_mb(tree(worker.pid))
            conns = _connections(stack, worker.name)
            run.samples.append((time.monotonic(), running, pss, conns))
            run.peak_inflight = max(run.peak_inflight, running)
            run.peak_pss_mb = max(run.peak_pss_mb, pss)
            run.connections = max(run.connections, conns)
            stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    t0 = time.monotonic()
    sampler.start()
    for i in range(turns):
        stack.turn("wait", stack.session(f"{label}-{i}"), f"wait {wait_s}", queue=queue)
    try:
        wait_for(
            lambda: (
                int(
                    stack.sql(
                        "select count(*) from june_turns where status = 'completed' and session like %s", f"%{label}%"
                    )[0][0]
                )
                >= turns
            ),
            timeout_s=600 + 20 * wait_s,
            every_s=0.05,
            what=f"{turns} turns ({mode}, W={wait_s})",
        )
    finally:
        run.wall_s = time.monotonic() - t0
        stop.set()
        sampler.join()
    run.cpu_s = sum(cpu_s(p) for p in tree(worker.pid)) - cpu0
    return run


def start(stack: BenchStack, mode: str, turns: int, prefork_c: int) -> Proc:
    """The mode's worker, on a queue of its own (both run side by side, idle while the other measures)."""
    env = {"JUNE_LEASE_S": "30", "JUNE_ALIVE_S": "3", "JUNE_TASK_EVENTS": "1", "PGAPPNAME": app_name(mode)}
    if mode == "threads":
        proc = stack.worker("threads", pool="threads", concurrency=turns, queues=queue_of(stack, mode), env=env)
    else:
        proc = stack.worker("prefork", concurrency=prefork_c, queues=queue_of(stack, mode), env=env)
    stack.wait_ready(proc, timeout_s=120)
    return proc


def app_name(mode: str) -> str:
    return f"june-bench-{mode}"


def queue_of(stack: BenchStack, mode: str) -> str:
    return f"{stack.queue}.{mode}"


def warm(stack: BenchStack, proc: Proc, mode: str, n: int) -> None:
    measure(stack, proc, "warm", n, 0.0, queue_of(stack, mode))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=1000, help="turns sent at once to the one threads process")
    parser.add_argument("--prefork-turns", type=int, default=64, help="turns sent at once to the prefork worker")
    parser.add_argument("--cpu-turns", type=int, default=None, help="turns of the W = 0 runs (default --turns)")
    parser.add_argument("--prefork-c", type=int, default=8, help="the prefork worker's pool size")
    parser.add_argument("--cpu-rounds", type=int, default=5, help="W = 0 rounds, the two modes alternating")
    parser.add_argument("--wait", type=float, default=2.0, help="W: seconds each model call and the tool wait")
    args = parser.parse_args(argv)
    cpu_turns = args.cpu_turns or args.turns
    print(f"# inflight: {machine()}; W={args.wait}s (a turn waits {3 * args.wait:g}s), threads {args.turns} turns, "
          f"prefork -c {args.prefork_c} {args.prefork_turns} turns, {cpu_turns} turns at W=0")  # fmt: skip
    runs: dict[tuple[str, float], Run] = {}
    cpu_rounds: list[dict[str, Run]] = []
    with sigterm_as_exit(), BenchStack("inflight") as stack:
        procs, idle = {}, {}
        for mode in MODES:
            procs[mode] = start(stack, mode, max(args.turns, cpu_turns), args.prefork_c)
            idle[mode] = pss_mb(tree(procs[mode].pid))  # what the worker takes before any turn
        for mode in MODES:
            # the steady state: every pool thread (or process) made and every connection open, as in a worker that runs
            warm(stack, procs[mode], mode, max(args.turns, cpu_turns) if mode == "threads" else min(20, cpu_turns))
        # W = 0, the modes alternating round by round (the order swapped every round): load that drifts on the machine
        # hits both alike, and the CPU ratio is each round's, its median the figure
        for i in range(args.cpu_rounds):
            got: dict[str, Run] = {}
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                got[mode] = run = measure(stack, procs[mode], mode, cpu_turns, 0.0, queue_of(stack, mode))
                run.idle_pss_mb = idle[mode]
                print(f"{run.line()}  [round {i + 1}]", flush=True)
            cpu_rounds.append(got)
        for mode in MODES:
            n = args.turns if mode == "threads" else args.prefork_turns
            run = measure(stack, procs[mode], mode, n, args.wait, queue_of(stack, mode))
            run.idle_pss_mb = idle[mode]  # the rest is what turns in flight cost
            runs[(mode, args.wait)] = run
            print(run.line(), flush=True)
        for proc in procs.values():
            stack.stop(proc)
    new, old = runs[("threads", args.wait)], runs[("prefork", args.wait)]
    waiting = 3 * args.wait
    wall0 = {m: statistics.median(r[m].wall_s for r in cpu_rounds) for m in MODES}  # a W = 0 batch, all rounds
    overlap_new = new.wall_s / (waiting + wall0["threads"] * new.turns / cpu_turns)
    overlap_old = old.wall_s / (waiting + wall0["prefork"] * old.turns / cpu_turns)
    ratios = sorted(r["threads"].rate / r["prefork"].rate for r in cpu_rounds)
    rate_new = statistics.median(r["threads"].rate for r in cpu_rounds)
    rate_old = statistics.median(r["prefork"].rate for r in cpu_rounds)
    print(f"overlap: threads {overlap_new:.2f}, prefork -c {args.prefork_c} {overlap_old:.2f}")
    print(f"cpu: W=0 turns per worker CPU-second (median of {len(cpu_rounds)} rounds): threads {rate_new:.1f}, "
          f"prefork {rate_old:.1f}; ratio per round {', '.join(f'{r:.2f}' for r in ratios)}, "
          f"median {statistics.median(ratios):.2f}")  # fmt: skip
    print(
        f"inflight: {new.peak_inflight} turns in flight, {new.mb_per_turn:.2f} MB per in-flight turn, "
        f"{new.connections} Postgres connections, overlap {overlap_new:.2f}"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
