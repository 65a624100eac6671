"""What the console's ``june_sessions_activity`` index costs a step: a session-row update with and without it.

    .venv/bin/python bench/index_cost.py [-n 3000] [--rounds 4]

Every step's commit updates its session's row, moving ``updated_at`` (the index's first column),
so each one writes an entry in it. On a throwaway database ``june_bench_<random>`` of
``JUNE_DATABASE_URL`` with 10,000 sessions, times ``-n`` autocommit updates shaped like a commit's
(``event_seq`` and ``updated_at``), alternating with and without the index, ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import psycopg
from _harness import BenchStack, machine, sigterm_as_exit

from june_worker.stores import PostgresStore

UPDATE = (
    "update june_sessions s set event_seq = s.event_seq + 1, updated_at = extract(epoch from now())"
    " where s.agent = %s and s.session = %s"
)
INDEX = "create index june_sessions_activity on june_sessions (updated_at, agent, session)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    print(f"# index_cost.py  {machine()}  {args.n} updates per round, {args.rounds} rounds", flush=True)
    with sigterm_as_exit(), BenchStack("index-cost") as stack:
        PostgresStore(stack.db_url).close()
        with psycopg.connect(stack.db_url, autocommit=True) as conn:
            conn.execute(
                "insert into june_sessions (agent, session, updated_at)"
                " select 'ops', 's-' || i, extract(epoch from now()) - i from generate_series(1, 10000) i"
            )
            conn.execute("analyze june_sessions")

            def run() -> float:
                t0 = time.perf_counter()
                for i in range(args.n):
                    conn.execute(UPDATE, ("ops", f"s-{1 + i % 10000}"))
                return (time.perf_counter() - t0) / args.n * 1000

            with_index, without = [], []
            for _ in range(args.rounds):
                with_index.append(run())
                conn.execute("drop index june_sessions_activity")
                without.append(run())
                conn.execute(INDEX)
    for name, values in (("with the index", with_index), ("without", without)):
        rounds = ", ".join(f"{v:.3f}" for v in values)
        print(f"{name}: {rounds} ms per update (median {statistics.median(values):.3f})")


if __name__ == "__main__":
    main()
