"""Retention: what the sweeper deletes so that storage stays bounded, in small batches, along indexes.

Each sweep deletes at most ``JUNE_PRUNE_BATCH`` rows of each kind (so a sweep stays short and a
backlog drains over several sweeps) and logs the figures:

* **outbox events** relayed to their session's stream (``seq <= relayed_seq``) and older than
  ``JUNE_OUTBOX_RETENTION_S``, except those written since the session's oldest turn that is still
  unfinished (queued, running, or parked on an input however long ago) or whose delivery to a target
  is still due: rendering reads a turn's own events (live history, the final delivery after a resume),
  and keeping all of them from that turn on leaves the outbox a gap-free run of the session's latest
  events, so ``/log`` can say from which seq it holds them. A follower catches up on the Redis stream;
  the outbox is the relay's source and what the gateway's ``/log`` and ``observe(replay=True)`` read,
  so they hold only this much history;
* **ended turns** (completed, failed, cancelled, rejected) ``JUNE_TURN_RETENTION_S`` after they
  ended, with their step records (replay never reads an ended turn's steps; the transcript keeps its
  messages). A message of such a turn delivered again after that would run it again, so keep this
  longer than any broker's redelivery delay;
* **archived generations** (``reset``) ``JUNE_ARCHIVE_RETENTION_S`` after the reset.

Per-session Redis keys expire on their own (``JUNE_STREAM_TTL_S``, renewed by each append); the
firehose marker's fields of sessions quiet for as long are dropped here too.

The rule a reader must not break: **nothing a turn still needs is pruned**: unfinished, suspended
and delivery-due turns and their events (with every later event of their session), events not yet
relayed, and the session's reserved steps stay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from psycopg_pool import ConnectionPool

from ..events.redis_stream import RedisStreamSink
from ..stores._pg_conn import pooled
from .settings import WorkerSettings

__all__ = ["Pruned", "prune"]

log = logging.getLogger("june_worker.retention")

_NOW = "extract(epoch from now())"

_EVENTS = f"""
with doomed as (
    select e.agent, e.session, e.seq from june_events e
     where e.created_at < {_NOW} - %(keep)s
       and e.seq <= (select s.relayed_seq from june_sessions s where s.agent = e.agent and s.session = e.session)
       -- kept: from the session's oldest turn still unfinished or due for delivery on (index june_turns_kept)
       and not exists (select 1 from june_turns t
                        where t.agent = e.agent and t.session = e.session and t.created_at <= e.created_at
                          and (t.status in ('queued', 'running', 'suspended') or t.deliver_due))
     order by e.created_at
     limit %(batch)s
)
delete from june_events e using doomed d where e.agent = d.agent and e.session = d.session and e.seq = d.seq
"""

_TURNS = f"""
with doomed as (
    select agent, session, turn_id from june_turns
     where status in ('completed', 'failed', 'cancelled', 'rejected') and finished_at < {_NOW} - %(keep)s
       and not deliver_due
     order by finished_at
     limit %(batch)s
), steps as (
    delete from june_steps st using doomed d
     where st.agent = d.agent and st.session = d.session and st.turn_id = d.turn_id and st.step_id not like 'session:%%'
    returning 1
), turns as (
    delete from june_turns t using doomed d
     where t.agent = d.agent and t.session = d.session and t.turn_id = d.turn_id
    returning 1
)
select (select count(*) from turns), (select count(*) from steps)
"""

_ARCHIVED = {
    table: f"""
with doomed as (
    select ctid from {table} where archived_at < {_NOW} - %(keep)s order by archived_at limit %(batch)s
)
delete from {table} a using doomed d where a.ctid = d.ctid
"""
    for table in ("june_archived_messages", "june_archived_steps")
}


@dataclass(frozen=True)
class Pruned:
    events: int = 0
    turns: int = 0
    steps: int = 0
    archived: int = 0
    firehose_fields: int = 0

    def __bool__(self) -> bool:
        return any((self.events, self.turns, self.steps, self.archived, self.firehose_fields))


def prune(pool: ConnectionPool[Any], sink: RedisStreamSink | None, settings: WorkerSettings) -> Pruned:
    """One batch of each kind of pruning (see the module docstring); log and return what went."""
    batch = settings.prune_batch
    with pooled(pool) as conn:
        events = conn.execute(_EVENTS, {"keep": settings.outbox_retention_s, "batch": batch}).rowcount
        row = conn.execute(_TURNS, {"keep": settings.turn_retention_s, "batch": batch}).fetchone()
        turns, steps = (int(row[0]), int(row[1])) if row else (0, 0)
        archived = sum(
            conn.execute(sql, {"keep": settings.archive_retention_s, "batch": batch}).rowcount
            for sql in _ARCHIVED.values()
        )
    fields = 0
    if sink is not None and settings.stream_ttl_s > 0:
        try:
            fields = sink.forget_quiet_sessions(quiet_s=settings.stream_ttl_s, limit=batch)
        except Exception:
            log.warning("could not trim the firehose markers; the next sweep tries again", exc_info=True)
    pruned = Pruned(events=max(events, 0), turns=turns, steps=steps, archived=max(archived, 0), firehose_fields=fields)
    if pruned:
        log.info(
            "retention: %d outbox events, %d ended turns with %d step records, %d archived rows, "
            "%d firehose marker fields deleted",
            pruned.events,
            pruned.turns,
            pruned.steps,
            pruned.archived,
            pruned.firehose_fields,
        )
    return pruned
