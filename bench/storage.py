"""Stored bytes of a long thread, before and after the relay and the retention pruning, against the messages' own bytes.

A thread of ``--turns`` turns (default 200): each a ``--bytes``-byte user message (default 200)
and a model reply of the same size, one model step per turn, run through the engine on Postgres
with the Redis stream sink (so every event reaches its stream). Then the sweeper's relay marks the
session relayed and one retention pass runs with every retention period at zero: relayed outbox
events, ended turns and their step records go; the transcript stays.

The figure is the bytes of the session's rows (``pg_column_size`` of each row of june_messages,
june_steps, june_events, june_turns, june_sessions), next to the bytes of the messages' text.

    python bench/storage.py [--turns 200] [--bytes 200]

Postgres: ``JUNE_DATABASE_URL`` (default postgresql://postgres@127.0.0.1:5432/test; a database of
its own is made and dropped); Redis: ``JUNE_REDIS_URL`` (default redis://127.0.0.1:6379/0; its
keys under a prefix of its own are deleted at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
from dataclasses import replace
from pathlib import Path

import psycopg
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._harness import machine  # noqa: E402
from june_worker.engine import Agent, Runtime  # noqa: E402
from june_worker.engine.store import SessionRef  # noqa: E402
from june_worker.events.keys import EventKeys  # noqa: E402
from june_worker.events.redis_stream import RedisStreamSink  # noqa: E402
from june_worker.models.scripted import Reply, ScriptedModel  # noqa: E402
from june_worker.stores import PostgresStore  # noqa: E402
from june_worker.worker.queue import SessionQueue  # noqa: E402
from june_worker.worker.retention import prune  # noqa: E402
from june_worker.worker.settings import WorkerSettings  # noqa: E402

TABLES = ("june_messages", "june_steps", "june_events", "june_turns", "june_sessions")


def stored(conn: psycopg.Connection[tuple[object, ...]], ref: SessionRef) -> dict[str, int]:
    out = {}
    for table in TABLES:
        row = conn.execute(
            f"select coalesce(sum(pg_column_size(t.*)), 0) from {table} t where agent = %s and session = %s",  # noqa: S608
            (ref.agent, ref.session),
        ).fetchone()
        out[table] = int(row[0]) if row else 0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--bytes", type=int, default=200)
    args = parser.parse_args()
    admin = os.environ.get("JUNE_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
    redis_url = os.environ.get("JUNE_REDIS_URL", "redis://127.0.0.1:6379/0")
    db = f"june_bench_{secrets.token_hex(4)}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'create database "{db}"')
    url = psycopg.conninfo.make_conninfo(admin, dbname=db)
    keys = EventKeys(prefix=f"june-bench-storage-{secrets.token_hex(4)}")
    client = redis.Redis.from_url(redis_url)
    store = PostgresStore(url, max_size=2)
    try:
        sink = RedisStreamSink(client, keys=keys, store=store)
        reply = "r" * args.bytes
        agent = Agent(name="ops", model=ScriptedModel(lambda request: Reply(reply)))
        runtime = Runtime([agent], store, sink=sink)
        session = runtime.session("ops", "thread")
        text = "u" * args.bytes

        async def run() -> None:
            for _ in range(args.turns):
                await session.turn(text)

        asyncio.run(run())
        own = 2 * args.turns * args.bytes
        with psycopg.connect(url, autocommit=True) as conn:
            before = stored(conn, session.ref)
            # the sweeper's relay: the stream holds every event, so the session's mark moves up
            queue = SessionQueue(store.pool, lease_s=30)
            for ref, committed in queue.unrelayed(limit=10):
                queue.mark_relayed([(ref, min(sink.relayed_seq(ref), committed))])
            settings = replace(
                WorkerSettings(), outbox_retention_s=0, turn_retention_s=0, archive_retention_s=0, prune_batch=100_000
            )
            pruned = prune(store.pool, sink, settings)
            after = stored(conn, session.ref)
        print(f"# storage  {machine()}")
        print(
            f"# a thread of {args.turns} turns, each a {args.bytes}-byte user message and a {args.bytes}-byte reply: "
            f"{own} bytes of message text"
        )
        print(f"{'':24s} {'before':>10s} {'after':>10s}")
        for table in TABLES:
            print(f"{table:24s} {before[table]:10d} {after[table]:10d}")
        total_before, total_after = sum(before.values()), sum(after.values())
        print(f"{'total':24s} {total_before:10d} {total_after:10d}")
        print(
            f"ratio to the messages' own bytes: {total_before / own:.2f}x before, {total_after / own:.2f}x after relay "
            f"and pruning ({pruned.events} events, {pruned.turns} turns, {pruned.steps} step records pruned)"
        )
    finally:
        store.close()
        for key in client.scan_iter(match=f"{keys.prefix}:*"):
            client.delete(key)
        client.close()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'drop database if exists "{db}" with (force)')


if __name__ == "__main__":
    main()
