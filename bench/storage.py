"""Stored bytes of long threads on Postgres, before and after the relay and the retention pruning, against the
messages' own bytes: what the files of every june table and index grow by, not an estimate of the rows.

``--threads`` threads (default 10) of ``--turns`` turns (default 200): each turn a ``--bytes``-byte user
message (default 200, words of random letters) and a model reply of the same size, one model step per turn,
run through the engine on Postgres with the Redis stream sink (every event reaches its stream). Session ids are
Slack thread ids (``slack:C0123ABCD:1733050000.000001``...), agent ``ops``. Then the sweeper's relay marks the
sessions relayed and one retention pass runs with every period at zero: relayed outbox events, ended turns and
their step records go; the transcript stays.

Measured: the growth of ``pg_total_relation_size`` (heap, TOAST, free-space and visibility maps, and every
index) summed over every ``june_*`` table, from the freshly migrated database, after a ``VACUUM`` at each
point. Three points: after the threads ran; after relay and pruning (the files as they stand: a heap is cut
back, an index keeps its emptied pages for the rows to come); and after ``VACUUM FULL`` (the kept rows packed:
what the threads cost for good, once the space pruning freed is reused). Figures are per thread, so the
fixed cost of a relation's first pages is spread over the threads; several threads keep a page's rounding
small. Redis is not counted: a session's keys expire (``JUNE_STREAM_TTL_S``).

    python bench/storage.py [--threads 10] [--turns 200] [--bytes 200]

Postgres: ``JUNE_DATABASE_URL`` (default postgresql://postgres@127.0.0.1:5432/test; a database of its own is
made and dropped); Redis: ``JUNE_REDIS_URL`` (default redis://127.0.0.1:6379/0; its keys under a prefix of
its own are deleted at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import string
import sys
from dataclasses import replace
from pathlib import Path

import psycopg
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import machine, throwaway_database  # noqa: E402
from june_wire.keys import EventKeys  # noqa: E402
from june_worker.engine import Agent, Runtime  # noqa: E402
from june_worker.events.redis_stream import RedisStreamSink  # noqa: E402
from june_worker.models.scripted import Reply, ScriptedModel  # noqa: E402
from june_worker.stores import PostgresStore  # noqa: E402
from june_worker.worker.queue import SessionQueue  # noqa: E402
from june_worker.worker.retention import prune  # noqa: E402
from june_worker.worker.settings import WorkerSettings  # noqa: E402

Conn = psycopg.Connection[tuple[object, ...]]

_SIZES = r"""
select c.relname, pg_table_size(c.oid), pg_indexes_size(c.oid)
  from pg_class c
 where c.relnamespace = current_schema()::regnamespace and c.relkind = 'r' and c.relname like 'june\_%'
 order by c.relname
"""


# What one transcript row holds, column by column (bytes as stored), and how many rows there are.
_COLUMNS = """
select avg(octet_length(june_message(role, turn_id, body))), avg(octet_length(body::text)), avg(pg_column_size(body)), avg(pg_column_size(session)),
       avg(pg_column_size(turn_id)), avg(pg_column_size(agent) + pg_column_size(idx) + pg_column_size(role)), count(*)
  from june_messages
"""


# The two smaller measures, for comparison with the files: the stored values (each transcript, step and outbox row's
# JSON and turn id: what bench/step_overhead.py's bytes/step counts, and what the "about 4x" was), and the rows
# (pg_column_size of every row of every june table: tuple headers and every column, but no page, pointer or index).
_VALUES = """
select (select coalesce(sum(octet_length(body::text) + octet_length(turn_id)), 0) from june_messages)
     + (select coalesce(sum(octet_length(data::text) + coalesce(octet_length(turn_id), 0)), 0) from june_steps)
     + (select coalesce(sum(octet_length(body::text) + octet_length(turn_id)), 0) from june_events)
"""


def rows_and_values(conn: Conn) -> tuple[int, int]:
    """(bytes of every june row, bytes of the stored values), over the whole database."""
    tables = [str(row[0]) for row in conn.execute(_SIZES).fetchall()]
    rows = sum(
        int(conn.execute(f"select coalesce(sum(pg_column_size(t.*)), 0) from {t} t").fetchone()[0]) for t in tables
    )  # type: ignore[index]
    (values,) = conn.execute(_VALUES).fetchone()  # type: ignore[misc]
    return rows, int(values)


def sizes(conn: Conn, *, full: bool = False) -> dict[str, tuple[int, int]]:
    """(table bytes, index bytes) of every june table, after a VACUUM (FULL: rewritten, packed)."""
    conn.execute("vacuum full" if full else "vacuum")
    return {str(name): (int(table), int(index)) for name, table, index in conn.execute(_SIZES).fetchall()}  # type: ignore[call-overload]


def grown(now: dict[str, tuple[int, int]], base: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {t: (now[t][0] - base.get(t, (0, 0))[0], now[t][1] - base.get(t, (0, 0))[1]) for t in now}


def text_of(rng: random.Random, size: int) -> str:
    """``size`` bytes of words of random lowercase letters: text that compresses as little as prose does, or less."""
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < size:
        words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))))
    return " ".join(words)[:size]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=10)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--bytes", type=int, default=200)
    args = parser.parse_args()
    redis_url = os.environ.get("JUNE_REDIS_URL", "redis://127.0.0.1:6379/0")
    keys = EventKeys(prefix=f"june-bench-storage-{secrets.token_hex(4)}")
    client = redis.Redis.from_url(redis_url)
    rng = random.Random(11)
    with throwaway_database("june_bench") as url:
        store = PostgresStore(url, max_size=2)
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                base = sizes(conn, full=True)  # packed: later points measure what the threads added
            sink = RedisStreamSink(client, keys=keys, store=store)
            replies = iter([text_of(rng, args.bytes) for _ in range(args.threads * args.turns)])
            agent = Agent(name="ops", model=ScriptedModel(lambda request: Reply(next(replies))))
            runtime = Runtime([agent], store, sink=sink)
            sessions = [
                runtime.session("ops", f"slack:C0123ABCD:1733050000.{n:06d}") for n in range(1, args.threads + 1)
            ]
            texts = [text_of(rng, args.bytes) for _ in range(args.threads * args.turns)]

            async def run() -> None:
                for i, session in enumerate(sessions):
                    for j in range(args.turns):
                        await session.turn(texts[i * args.turns + j])

            asyncio.run(run())
            own = 2 * args.turns * args.bytes  # per thread
            with psycopg.connect(url, autocommit=True) as conn:
                ran = grown(sizes(conn), base)
                ran_rows = rows_and_values(conn)
                # the sweeper's relay: the streams hold every event, so the sessions' marks move up
                queue = SessionQueue(store.pool, lease_s=30)
                for ref, committed in queue.unrelayed(limit=args.threads + 10):
                    queue.mark_relayed([(ref, min(sink.relayed_seq(ref), committed))])
                settings = replace(
                    WorkerSettings(), outbox_retention_s=0, turn_retention_s=0, archive_retention_s=0, prune_batch=10**7
                )
                pruned = prune(store.pool, sink, settings)
                after = grown(sizes(conn), base)
                after_rows = rows_and_values(conn)
                packed = grown(sizes(conn, full=True), base)
                columns = conn.execute(_COLUMNS).fetchone()
        finally:
            store.close()
            for key in client.scan_iter(match=f"{keys.prefix}:*"):
                client.delete(key)
            client.close()

    n = args.threads
    assert columns is not None
    json_bytes, stored, body, session_id, turn_id, small, rows = (float(str(v)) for v in columns)
    print(f"# storage  {machine()}")
    print(
        f"# {n} threads of {args.turns} turns, each a {args.bytes}-byte user message and a {args.bytes}-byte reply: "
        f"{own} bytes of messages per thread; a message's JSON is {json_bytes:.0f} bytes on average, "
        f"its row's body {stored:.0f} (without the role and turn id its columns hold, and the defaults)"
    )
    print("# bytes per thread: growth of the june tables' files (table + indexes), after VACUUM")
    print(f"{'':24s} {'ran':>16s} {'relay+prune':>16s} {'kept, packed':>16s}")
    for table in sorted(ran):
        cells = [f"{p[table][0] // n:7d}+{p[table][1] // n:<8d}" for p in (ran, after, packed)]
        if any(p[table] != (0, 0) for p in (ran, after, packed)):
            print(f"{table:24s} {cells[0]:>16s} {cells[1]:>16s} {cells[2]:>16s}")
    totals = [sum(t + i for t, i in p.values()) / n for p in (ran, after, packed)]
    print(f"{'total':24s} {totals[0]:16.0f} {totals[1]:16.0f} {totals[2]:16.0f}")
    print(
        f"to the messages' own bytes: {totals[0] / own:.2f}x after the run, {totals[1] / own:.2f}x after relay and "
        f"pruning, {totals[2] / own:.2f}x kept for good ({pruned.events} events, {pruned.turns} turns, "
        f"{pruned.steps} step records pruned); to their JSON: {totals[2] / (own / args.bytes * json_bytes):.2f}x kept"
    )
    print(
        f"smaller measures, to the messages' own bytes: the stored values (JSON and turn ids of the transcript, step and "
        f"outbox rows) {ran_rows[1] / n / own:.2f}x after the run, {after_rows[1] / n / own:.2f}x after relay and "
        f"pruning; the rows (pg_column_size, no page or index) {ran_rows[0] / n / own:.2f}x and "
        f"{after_rows[0] / n / own:.2f}x"
    )
    heap, index = (v / rows for v in packed["june_messages"])
    print(
        f"a message, kept: {heap:.0f} bytes of heap (its body {body:.0f} with its header, the session id {session_id:.0f}, "
        f"the turn id {turn_id:.0f}, agent + index + role {small:.0f}, the rest tuple header, line pointer, alignment "
        f"and page space) and {index:.0f} of primary key (agent, session id, index)"
    )


if __name__ == "__main__":
    main()
