"""The operator console's list queries at 10,000 sessions and 100,000 turns, with and without their indexes.

    .venv/bin/python bench/console.py [--sessions 10000] [--turns-per-session 10] [-n 50]

Seeds a throwaway database ``june_bench_<random>`` of ``JUNE_DATABASE_URL`` (dropped at the end)
in bulk SQL: sessions over three agents with a tenth parked on an input, a fiftieth new with
every turn rejected (as for an agent no worker serves any more), the rest done or running,
``--turns-per-session`` turns each (3 % of the others failed), five events per turn. Then times each
query the console's pages run (june_worker/gateway/console.py, the very functions the routes
call): the first page of 50, a page deep in the list (after its cursor), the approvals inbox,
failed turns, a session's turns and a turn's timeline; each ``-n`` times, median and p95. Then
drops the console's indexes (migrations 9, 12 and 15), times again, and puts them back.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
from _harness import BenchStack, machine, pct, sigterm_as_exit

from june_worker.gateway import console
from june_worker.gateway.auth import Principal
from june_worker.stores import PostgresStore

AGENTS = ["ops", "support", "billing"]
INDEXES = {
    "june_sessions_activity": "create index june_sessions_activity on june_sessions (updated_at, agent, session)",
    "june_sessions_parked": "create index june_sessions_parked on june_sessions (parked_at, agent, session)"
    " where suspended is not null",
    "june_turns_failed": "create index june_turns_failed on june_turns (finished_at, agent, session, turn_id)"
    " where status in ('failed', 'rejected')",
}

SEED = """
insert into june_sessions (agent, session, status, suspended, event_seq, relayed_seq, next_position, updated_at,
                           parked_at)
select agent, session,
       case when i % 10 = 0 then 'suspended' when i % 50 = 1 then 'running' when i % 50 = 2 then 'new'
            else 'done' end,
       case when i % 10 = 0 then json_build_object(
           'turn_id', 't_' || session || '_' || %(tps)s, 'call_id', 'c1', 'opening_text', '',
           'request', json_build_object('id', 'approve', 'prompt', 'Refund order ' || session || '?',
                                        'schema', json_build_object('type', 'boolean'),
                                        'answerers', json_build_object('policy', 'operator', 'scope', null))) end,
       %(tps)s * 5, %(tps)s * 5, %(tps)s + 1,
       extract(epoch from now()) - (i * 60.0),
       case when i % 10 = 0 then extract(epoch from now()) - (i * 60.0) end
  from (select i, (array['ops', 'support', 'billing'])[1 + i % 3] as agent, 's-' || lpad(i::text, 6, '0') as session
          from generate_series(1, %(sessions)s) i) s;
insert into june_turns (agent, session, turn_id, position, status, payload, attempts, result, created_at, finished_at)
select s.agent, s.session, 't_' || s.session || '_' || p, p,
       case when s.status = 'new' then 'rejected'
            when s.status = 'suspended' and p = %(tps)s then 'suspended'
            when (hashtext(s.session || p) % 100 + 100) % 100 < 3 then 'failed' else 'completed' end,
       '{"text": "hello"}'::json, 1,
       case when s.status = 'new'
            then json_build_object('status', 'rejected', 'turn_id', 't_' || s.session || '_' || p,
                                   'reason', 'unknown agent ' || s.agent)
            when (hashtext(s.session || p) % 100 + 100) % 100 < 3
            then json_build_object('status', 'failed', 'turn_id', 't_' || s.session || '_' || p, 'phase', 'tool',
                                   'step', 'tool:1:c1', 'error', json_build_object('message', 'boom ' || p,
                                   'type', 'RuntimeError'))
            else '{"status": "completed", "text": "ok"}'::json end,
       s.updated_at - (%(tps)s - p) * 30, s.updated_at - (%(tps)s - p) * 30 + 2
  from june_sessions s, generate_series(1, %(tps)s) p;
insert into june_events (agent, session, seq, turn_id, type, body, created_at)
select t.agent, t.session, (t.position - 1) * 5 + k, t.turn_id,
       (array['turn.started', 'message.completed', 'action.requested', 'action.completed', 'turn.completed'])[k],
       json_build_object('seq', (t.position - 1) * 5 + k, 'turn_id', t.turn_id, 'step', 'model:1'),
       t.created_at + k * 0.2
  from june_turns t, generate_series(1, 5) k;
analyze june_sessions; analyze june_turns; analyze june_events;
"""


def timed(fn: Callable[[], Any], n: int) -> tuple[float, float]:
    fn()  # warm: the statement is prepared, its pages are cached
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples), pct(samples, 95)


def measure(conn: psycopg.Connection[Any], n: int) -> dict[str, tuple[float, float]]:
    operator = Principal("op-bench", None, operator=True)
    now = time.time()
    # a cursor 40 pages deep: the console's "Older" clicked 40 times
    cursor = None
    for _ in range(40):
        cursor = console.sessions_page(conn, AGENTS, None, 50, cursor)[1]
    failed_cursor = None
    for _ in range(20):
        failed_cursor = console.failed_page(conn, AGENTS, 50, failed_cursor)[1]
    inbox_cursor = console.inbox_page(conn, AGENTS, operator, 50, None, now)[1]
    return {
        "sessions: first page (50)": timed(lambda: console.sessions_page(conn, AGENTS, None, 50, None), n),
        "sessions: page 41 (after its cursor)": timed(lambda: console.sessions_page(conn, AGENTS, None, 50, cursor), n),
        "sessions: first page, status=running": timed(
            lambda: console.sessions_page(conn, AGENTS, "running", 50, None), n
        ),
        "sessions: first page, status=rejected": timed(
            lambda: console.sessions_page(conn, AGENTS, "rejected", 50, None), n
        ),
        "sessions: status=new (none: every session read)": timed(
            lambda: console.sessions_page(conn, AGENTS, "new", 50, None), n
        ),
        "approvals inbox: first page (50)": timed(lambda: console.inbox_page(conn, AGENTS, operator, 50, None, now), n),
        "approvals inbox: page 2": timed(lambda: console.inbox_page(conn, AGENTS, operator, 50, inbox_cursor, now), n),
        "failed turns: first page (50)": timed(lambda: console.failed_page(conn, AGENTS, 50, None), n),
        "failed turns: page 21": timed(lambda: console.failed_page(conn, AGENTS, 50, failed_cursor), n),
        "a session's turns": timed(lambda: console.session_turns(conn, "ops", "s-004998", 50), n),
        "a turn's timeline": timed(lambda: console.timeline(conn, "ops", "s-004998", "t_s-004998_5"), n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--turns-per-session", type=int, default=10)
    parser.add_argument("-n", type=int, default=50, help="runs of each query")
    args = parser.parse_args()
    total = args.sessions * args.turns_per_session
    print(f"# console.py  {machine()}  {args.sessions} sessions, {total} turns, {total * 5} events", flush=True)
    with sigterm_as_exit(), BenchStack("console") as stack:
        PostgresStore(stack.db_url).close()  # the schema, the console's indexes and june_turns_all_rejected included
        with psycopg.connect(stack.db_url, autocommit=True) as conn:
            t0 = time.perf_counter()
            seed = SEED.replace("%(sessions)s", str(int(args.sessions))).replace(
                "%(tps)s", str(int(args.turns_per_session))
            )
            conn.execute(seed.encode(), prepare=False)  # no parameters: several statements in one simple query
            print(f"(seeded in {time.perf_counter() - t0:.1f} s)", flush=True)
            counts = conn.execute(
                "select (select count(*) from june_sessions), (select count(*) from june_turns),"
                " (select count(*) from june_sessions where suspended is not null),"
                " (select count(*) from june_turns where status = 'failed'),"
                " (select count(*) from june_turns where status = 'rejected')"
            ).fetchone()
            print(
                f"(rows: {counts[0]} sessions, {counts[1]} turns, {counts[2]} parked, {counts[3]} failed,"
                f" {counts[4]} rejected)"
            )
            with_indexes = measure(conn, args.n)
            for name in INDEXES:
                conn.execute(f"drop index {name}")
            conn.execute("analyze june_sessions; analyze june_turns")
            without = measure(conn, args.n)
            for sql in INDEXES.values():
                conn.execute(sql)
    print("| query (june_worker/gateway/console.py) | with its indexes: median / p95 ms | without: median / p95 ms |")
    print("|---|---:|---:|")
    for name, (med, p95) in with_indexes.items():
        wmed, wp95 = without[name]
        print(f"| {name} | {med:.2f} / {p95:.2f} | {wmed:.2f} / {wp95:.2f} |")


if __name__ == "__main__":
    main()
