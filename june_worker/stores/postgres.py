"""PostgresStore: the source of truth for workers. psycopg 3 over a ``psycopg_pool`` pool.

Per step the cost is **one round trip**: a plain :class:`Commit` is ONE data-modifying
statement (a CTE, built in :mod:`._pg_commit`) sent in autocommit and prepared once per
connection. It updates the session row only if the fencing token (and ``expect_suspended``)
match, bumping ``event_seq``; the message, step and event inserts and the turn update select
``from`` that update, so they write nothing unless it returned the row. Only when nothing was
written does the store ask why, in a second query (:class:`LeaseLostError`,
:class:`ResumeConflictError`, or a session's first write: create its row and go again). A
taken message index is a unique violation: the statement fails whole, :class:`StoreError`.

A commit given as a builder (a sync tool runs inside it) gets a handle whose first use sends
``BEGIN``; the same statement then runs in that transaction and ``COMMIT`` follows, or
``ROLLBACK`` on any error (the tool's writes go with it; the exception propagates unchanged).
A tool that never touches the handle costs what a plain commit costs.

Per-step work never reads the transcript: only :meth:`PostgresStore.load` does, in one
statement (one snapshot, one round trip).

JSON columns are ``json``, not ``jsonb``: rows are written once and read whole, ``json`` keeps
the exact text and is cheaper both ways, and it accepts every JSON string SQLite accepts
(``jsonb`` refuses ``\\u0000``, which a tool result may well contain). Times are unix seconds
(``double precision``) from the server's clock, as in SQLite, so lease and sweeper queries
compare them with plain numbers. Identifier columns collate ``"C"``: byte comparisons in every
key index, whatever the database's locale.

Connections that die while idle (``pg_terminate_backend``, a server restart) are caught at
checkout without a round trip and replaced; an idempotent read that meets a dead connection
runs once more on a fresh one.

The one rule a reader must not break: **a commit either applies whole, in one statement or
one transaction, or writes nothing**; never retry a commit whose outcome is unknown (a
connection lost mid-commit raises ``psycopg.OperationalError``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import select
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, TypeAlias, TypeVar, cast

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import TupleRow
from psycopg.types.numeric import Int8
from psycopg_pool import ConnectionPool
from pydantic import TypeAdapter, ValidationError

from june_wire.storable import unstorable_reason

from ..engine.endings import rejection_event
from ..engine.events import Rejected, TurnEvent, TurnResultAdapter
from ..engine.store import (
    ENDED_TURN_STATUSES,
    UNFINISHED_TURN_STATUSES,
    Commit,
    CommitBuilder,
    ResetResult,
    SessionRef,
    SessionSnapshot,
    SessionStatus,
    StepRecord,
    SuspendedCheckpoint,
    TurnPayload,
    TurnRecord,
    parked_on,
)
from ..engine.types import Message
from ..errors import (
    CancelRequestedError,
    LeaseLostError,
    MessageIndexTakenError,
    ResumeConflictError,
    StoreError,
    StoreUnavailableError,
    TurnEndedError,
)
from ._pg_commit import commit_statement
from ._pg_partition import partition_count, partition_tables
from ._sql import qmark_to_format

__all__ = [
    "MESSAGES_JSON",
    "STEPS_JSON",
    "TURN_COLUMNS",
    "TURN_WIDTH",
    "PostgresStore",
    "pooled",
    "session_snapshot",
    "stored_turn",
    "turn_columns",
    "turn_from_row",
]

Conn: TypeAlias = psycopg.Connection[TupleRow]
T = TypeVar("T")

_MIGRATION_LOCK = 0x6A756E65  # "june": the advisory lock that serializes migration runners
_COMMIT_ATTEMPTS = 3
_MessagesAdapter: TypeAdapter[list[Message]] = TypeAdapter(list[Message])
_EventsAdapter: TypeAdapter[list[TurnEvent]] = TypeAdapter(list[TurnEvent])

_MIGRATIONS: list[str] = [
    # 1: the whole schema (the names and meaning of SQLiteStore's, Postgres types)
    """
    create table june_sessions (
        agent text collate "C" not null,
        session text collate "C" not null,
        generation integer not null default 0,
        status text not null default 'new' check (status in ('new', 'running', 'suspended', 'done')),
        suspended json,
        event_seq bigint not null default 0,
        relayed_seq bigint not null default 0,
        next_position bigint not null default 1,
        fence bigint not null default 0,
        lease_owner text,
        lease_expires double precision,
        reset_pending boolean not null default false,
        updated_at double precision not null default extract(epoch from now()),
        primary key (agent, session)
    ) with (fillfactor = 80);
    create table june_turns (
        agent text collate "C" not null,
        session text collate "C" not null,
        turn_id text collate "C" not null,
        position bigint not null,
        status text not null check (
            status in ('queued', 'running', 'suspended', 'completed', 'failed', 'cancelled', 'rejected')
        ),
        payload json not null,
        cancel_reason text,
        attempts integer not null default 0,
        result json,
        generation integer not null default 0,
        created_at double precision not null default extract(epoch from now()),
        finished_at double precision,
        dispatched_at double precision,
        primary key (agent, session, turn_id)
    ) with (fillfactor = 90);
    create index june_turns_unfinished on june_turns (agent, session, position)
        where status in ('queued', 'running');
    create table june_messages (
        agent text collate "C" not null,
        session text collate "C" not null,
        idx integer not null,
        turn_id text collate "C" not null,
        role text collate "C" not null,
        body json not null,
        primary key (agent, session, idx)
    );
    create table june_steps (
        agent text collate "C" not null,
        session text collate "C" not null,
        step_id text collate "C" not null,
        turn_id text collate "C",
        data json not null,
        primary key (agent, session, step_id)
    );
    create table june_events (
        agent text collate "C" not null,
        session text collate "C" not null,
        seq bigint not null,
        turn_id text collate "C" not null,
        type text collate "C" not null,
        body json not null,
        created_at double precision not null default extract(epoch from now()),
        primary key (agent, session, seq)
    );
    create table june_archived_messages (
        agent text collate "C" not null,
        session text collate "C" not null,
        generation integer not null,
        idx integer not null,
        turn_id text collate "C" not null,
        role text collate "C" not null,
        body json not null,
        primary key (agent, session, generation, idx)
    );
    create table june_archived_steps (
        agent text collate "C" not null,
        session text collate "C" not null,
        generation integer not null,
        step_id text collate "C" not null,
        turn_id text collate "C",
        data json not null,
        primary key (agent, session, generation, step_id)
    );
    """,
    # 2: worker liveness, so a dead worker's lease is taken over before it expires
    """
    create table june_workers (
        owner text collate "C" primary key,
        alive_until double precision not null,
        started_at double precision not null default extract(epoch from now())
    );
    """,
    # 3: a worker delivers a turn with a target at least once: its ending commit sets deliver_due,
    # the delivery clears it, the sweeper re-sends what stayed due (a crash in between)
    """
    alter table june_turns
        add column deliver_due boolean not null default false,
        add column delivery_attempts integer not null default 0;
    create index june_turns_deliver_due on june_turns (finished_at) where deliver_due;
    """,
    # 4: the failure policy: why a turn's last attempt ended; a park's expiry stamped by the database's
    # clock; the sessions whose stream may be behind their outbox, found by an index however old they are
    """
    alter table june_turns add column last_error text;
    alter table june_sessions add column park_expires_at double precision;
    update june_sessions set park_expires_at = (suspended -> 'request' ->> 'expires_at')::double precision
     where suspended is not null;
    create index june_sessions_park_expiry on june_sessions (park_expires_at) where park_expires_at is not null;
    create index june_sessions_unrelayed on june_sessions (agent, session) where event_seq > relayed_seq;
    """,
    # 5: recording a queued turn, as ONE function that the store (enqueue_turn) and producers that
    # record a turn before sending its message (durable=True, producers/_durable.py) both call.
    # A row back: (true, the turn) recorded now, (false, the turn) recorded before; no row: not
    # recorded, because p_unless_parked and the session is parked on a turn's input (the worker
    # rejects such a turn when its message comes), or a concurrent call recorded the same turn
    # id first (ask again: its row is visible now).
    """
    create function june_enqueue_turn(
        p_agent text, p_session text, p_turn_id text, p_payload json, p_unless_parked boolean default false
    ) returns table (recorded boolean, turn june_turns)
    language sql volatile as $$
    with existing as (
        select t from june_turns t where t.agent = p_agent and t.session = p_session and t.turn_id = p_turn_id
    ), sess as (
        insert into june_sessions as s (agent, session, next_position)
        select p_agent, p_session, 2 where not exists (select 1 from existing)
        on conflict (agent, session) do update set next_position = s.next_position + 1
           where not (p_unless_parked and s.suspended is not null)
        returning s.next_position - 1 as position, s.generation
    ), ins as (
        insert into june_turns as t (agent, session, turn_id, position, status, payload, generation)
        select p_agent, p_session, p_turn_id, sess.position, 'queued', p_payload, sess.generation from sess
        on conflict do nothing
        returning t
    )
    select true, ins.t from ins union all select false, existing.t from existing
    $$;
    """,
    # 6: retention: relayed outbox events by age, ended turns by when they ended, archived generations
    # by when they were archived (june_worker/worker/retention.py prunes along these indexes)
    """
    create index june_events_created on june_events (created_at);
    create index june_turns_ended on june_turns (finished_at)
        where status in ('completed', 'failed', 'cancelled', 'rejected');
    alter table june_archived_messages add column archived_at double precision not null default extract(epoch from now());
    alter table june_archived_steps add column archived_at double precision not null default extract(epoch from now());
    create index june_archived_messages_at on june_archived_messages (archived_at);
    create index june_archived_steps_at on june_archived_steps (archived_at);
    """,
    # 7: channels: what rendering a turn to its target has done so far (a message's ts per slot, what a run
    # shows), so an at-least-once delivery updates the same messages; removed with the turn's row
    """
    create table june_channel_renders (
        agent text collate "C" not null,
        session text collate "C" not null,
        turn_id text collate "C" not null,
        slot text collate "C" not null,
        data json not null,
        primary key (agent, session, turn_id, slot),
        foreign key (agent, session, turn_id) references june_turns (agent, session, turn_id) on delete cascade
    );
    """,
    # 8: a turn's cost flat in the session's history. A worker that holds the first p_have messages of
    # generation p_generation (the last of them written by turn p_last_turn) reads only the messages after
    # them; june_transcript says whether what it holds is still the session's (`valid`: same generation, and
    # that message is there), else sends the whole transcript. Messages are only ever appended within a
    # generation (a reset starts the next one), so a valid prefix is the stored one. Steps: the reserved
    # session:* ones and those of unfinished turns (nothing reads an ended turn's), along the new index.
    # june_intake is the worker's intake statement (it was a statement in worker/queue.py) with that read in
    # place of the whole transcript; plpgsql so that its plan is made once per connection (a `language sql`
    # function is planned at every call: 1.3 ms against 0.36).
    """
    create index june_steps_turn on june_steps (turn_id, agent, session);
    create index june_messages_summaries on june_messages (agent, session, idx) where role = 'summary';

    create function june_transcript(
        p_agent text, p_session text, p_generation integer, p_have integer, p_last_turn text
    ) returns table (valid boolean, compacted_at integer, messages text, steps text)
    language sql stable as $$
    select v.valid,
           (select max(m.idx) from june_messages m
             where m.agent = p_agent and m.session = p_session and m.role = 'summary'),
           (select coalesce(json_agg(m.body order by m.idx), '[]'::json)::text from june_messages m
             where m.agent = p_agent and m.session = p_session and m.idx >= case when v.valid then p_have else 0 end),
           (select coalesce(json_agg(json_build_array(st.step_id, st.turn_id, st.data)), '[]'::json)::text
              from (select st.step_id, st.turn_id, st.data from june_steps st
                     where st.agent = p_agent and st.session = p_session
                       and st.step_id >= 'session:' and st.step_id < 'session;'
                    union all
                    select st.step_id, st.turn_id, st.data from june_turns t
                      join june_steps st on st.turn_id = t.turn_id and st.agent = t.agent and st.session = t.session
                     where t.agent = p_agent and t.session = p_session and t.status in ('queued', 'running')) st)
      from (select coalesce(
                (select s.generation from june_sessions s where s.agent = p_agent and s.session = p_session)
                    = p_generation
                and (p_have = 0 or exists (
                     select 1 from june_messages m
                      where m.agent = p_agent and m.session = p_session and m.idx = p_have - 1
                        and m.turn_id = p_last_turn)),
                false) as valid) v
    $$;

    -- Record the turn unless it exists or another turn is parked, and take the lease in the same update of
    -- the session row that bumps next_position (so a holder's release fails: NOTHING_NEW in the worker's
    -- queue), when there is a turn to run and the lease is free or ours. With the lease comes the session
    -- (june_transcript, and its first unfinished turn) as this statement's snapshot saw it, and the lease
    -- is taken only if the row it updates is the very version that snapshot saw (xmin): every commit
    -- updates that row, so nothing was committed that the snapshot misses. If another writer got in
    -- between, the lease is left alone and `retry` says to call again; a turn recorded is not recorded twice.
    create function june_intake(
        p_agent text, p_session text, p_turn_id text, p_payload json, p_owner text, p_lease_s double precision,
        p_generation integer, p_have integer, p_last_turn text
    ) returns table (
        recorded boolean, took boolean, retry boolean, fence bigint, generation integer, status text,
        suspended text, event_seq bigint, reset_pending boolean, valid boolean, compacted_at integer,
        messages text, steps text, existing june_turns, first_turn june_turns
    ) language plpgsql volatile as $$
    #variable_conflict use_column
    begin
    return query
    with snap as (
        select s.xmin as version, s.fence, s.generation, s.status, s.suspended::text as suspended, s.reset_pending,
               -- the lease is ours, free, expired, or held by a worker process that is no longer alive
               (s.lease_owner = p_owner or s.lease_owner is null
                or s.lease_expires < extract(epoch from clock_timestamp())
                or not exists (select 1 from june_workers w where w.owner = s.lease_owner
                                 and w.alive_until >= extract(epoch from clock_timestamp()))) as free
          from june_sessions s where s.agent = p_agent and s.session = p_session
    ), existing as (
        -- (a whole-row reference by its alias: every such alias here is unlike any column name, so that
        -- the name cannot resolve to a column of an outer query instead)
        select et as turn from june_turns et where et.agent = p_agent and et.session = p_session and et.turn_id = p_turn_id
    ), plan as (
        select not exists (select 1 from existing)
               and not exists (select 1 from snap where snap.suspended is not null and not snap.reset_pending)
               as record,
               exists (select 1 from existing e where (e.turn).status in ('queued', 'running')) as rerun
    ), sess as (
        insert into june_sessions as s (agent, session, next_position, lease_owner, lease_expires, fence)
        select p_agent, p_session, 2, p_owner, extract(epoch from clock_timestamp()) + p_lease_s, 1
          from plan where plan.record or plan.rerun
        on conflict (agent, session) do update
           set next_position = s.next_position + (select plan.record::int from plan),
               -- take: the row is the version snap read, and the lease was free in it
               fence = case when s.xmin = (select snap.version from snap) and (select snap.free from snap)
                            then s.fence + 1 else s.fence end,
               lease_owner = case when s.xmin = (select snap.version from snap) and (select snap.free from snap)
                                  then excluded.lease_owner else s.lease_owner end,
               lease_expires = case when s.xmin = (select snap.version from snap) and (select snap.free from snap)
                                    then excluded.lease_expires else s.lease_expires end
        returning s.next_position - 1 as position, s.generation, s.fence, s.lease_owner, s.lease_expires,
                  s.event_seq, s.reset_pending
    ), ins as (
        insert into june_turns as it (agent, session, turn_id, position, status, payload, generation)
        select p_agent, p_session, p_turn_id, sess.position, 'queued', p_payload, sess.generation
          from sess, plan where plan.record
        on conflict do nothing
        returning it as turn
    )
    select exists (select 1 from ins), k.took,
           -- not taken although free or ours: the row changed under this statement; call again
           not k.took and sess.fence is not null
           and (sess.lease_owner = p_owner or sess.lease_owner is null
                or sess.lease_expires < extract(epoch from clock_timestamp())
                or not exists (select 1 from june_workers w where w.owner = sess.lease_owner
                                 and w.alive_until >= extract(epoch from clock_timestamp()))),
           sess.fence, snap.generation, snap.status, snap.suspended, sess.event_seq, sess.reset_pending,
           tr.valid, tr.compacted_at, tr.messages, tr.steps, e.turn, f.turn
      from (select 1) one
      left join snap on true
      left join sess on true
      cross join lateral (
            select coalesce(sess.lease_owner = p_owner and sess.fence = coalesce(snap.fence, 0) + 1, false) as took) k
      left join existing e on true
      left join lateral (
            select x.* from june_transcript(p_agent, p_session, p_generation, p_have, p_last_turn) x
             where k.took) tr on true
      left join lateral (
            select u.turn from (
                (select ut as turn, ut.position from june_turns ut
                  where ut.agent = p_agent and ut.session = p_session and ut.status in ('queued', 'running')
                  order by ut.position limit 1)
                union all
                (select i.turn, (i.turn).position from ins i)) u
             where k.took order by u.position limit 1) f on true;
    end
    $$;
    """,
    # 9: the operator console's lists, each read a page at a time along its own index (june_worker/gateway/console.py):
    # sessions by last activity, parked sessions by how long they waited, failed turns by when they failed
    """
    create index june_sessions_activity on june_sessions (updated_at, agent, session);
    create index june_sessions_parked on june_sessions (updated_at, agent, session) where suspended is not null;
    create index june_turns_failed on june_turns (finished_at, agent, session, turn_id) where status = 'failed';
    """,
    # 10: retention keeps a session's outbox events from its oldest turn still unfinished (queued, running, parked) or
    # due for delivery on, found along the first index (few rows: only such turns); the sweeper finds the sessions
    # with a reset pending along the second instead of reading every session (june_worker/worker/retention.py,
    # SessionQueue.pending_resets)
    """
    create index june_turns_kept on june_turns (agent, session, created_at)
        where status in ('queued', 'running', 'suspended') or deliver_due;
    create index june_sessions_reset_pending on june_sessions (agent, session) where reset_pending;
    """,
    # 11: june_enqueue_turn (5) as june_intake (8) judges a park: one a pending reset is about to end does not
    # count, so a durable producer's turn for such a session is recorded and queues behind the reset, as the
    # worker's intake records it (it used to record nothing, and the turn was not durable)
    """
    create or replace function june_enqueue_turn(
        p_agent text, p_session text, p_turn_id text, p_payload json, p_unless_parked boolean default false
    ) returns table (recorded boolean, turn june_turns)
    language sql volatile as $$
    with existing as (
        select t from june_turns t where t.agent = p_agent and t.session = p_session and t.turn_id = p_turn_id
    ), sess as (
        insert into june_sessions as s (agent, session, next_position)
        select p_agent, p_session, 2 where not exists (select 1 from existing)
        on conflict (agent, session) do update set next_position = s.next_position + 1
           where not (p_unless_parked and s.suspended is not null and not s.reset_pending)
        returning s.next_position - 1 as position, s.generation
    ), ins as (
        insert into june_turns as t (agent, session, turn_id, position, status, payload, generation)
        select p_agent, p_session, p_turn_id, sess.position, 'queued', p_payload, sess.generation from sess
        on conflict do nothing
        returning t
    )
    select true, ins.t from ins union all select false, existing.t from existing
    $$;
    """,
    # 12: when a session parked, by the database's clock: set with a new park, kept while answers close some of its
    # requests (a park on several), cleared with it. The console's inbox and the parked-age gauge read it: every
    # commit moves updated_at, so the age they read from it went back to 0 at each partial answer.
    """
    alter table june_sessions add column parked_at double precision;
    update june_sessions set parked_at = updated_at where suspended is not null;
    drop index june_sessions_parked;
    create index june_sessions_parked on june_sessions (parked_at, agent, session) where suspended is not null;
    """,
    # 13: attempts counted where a worker picks a turn: june_intake counts the start of the turn it takes the
    # lease for (recorded now, or before), up to p_max_attempts, and says so (`counted`), so that a process that
    # dies before the turn's first commit, every time, still uses up its attempts (the failure policy's poison);
    # otherwise as in 8. The worker's other picks (SessionQueue.take, release_or_next) count in their statements.
    """
    drop function june_intake(text, text, text, json, text, double precision, integer, integer, text);

    create function june_intake(
        p_agent text, p_session text, p_turn_id text, p_payload json, p_owner text, p_lease_s double precision,
        p_generation integer, p_have integer, p_last_turn text, p_max_attempts integer
    ) returns table (
        recorded boolean, took boolean, retry boolean, fence bigint, generation integer, status text,
        suspended text, event_seq bigint, reset_pending boolean, valid boolean, compacted_at integer,
        messages text, steps text, existing june_turns, first_turn june_turns, counted boolean
    ) language plpgsql volatile as $$
    #variable_conflict use_column
    begin
    return query
    with snap as (
        select s.xmin as version, s.fence, s.generation, s.status, s.suspended::text as suspended, s.reset_pending,
               -- the lease is ours, free, expired, or held by a worker process that is no longer alive
               (s.lease_owner = p_owner or s.lease_owner is null
                or s.lease_expires < extract(epoch from clock_timestamp())
                or not exists (select 1 from june_workers w where w.owner = s.lease_owner
                                 and w.alive_until >= extract(epoch from clock_timestamp()))) as free
          from june_sessions s where s.agent = p_agent and s.session = p_session
    ), existing as (
        -- (a whole-row reference by its alias: every such alias here is unlike any column name, so that
        -- the name cannot resolve to a column of an outer query instead)
        select et as turn from june_turns et where et.agent = p_agent and et.session = p_session and et.turn_id = p_turn_id
    ), plan as (
        select not exists (select 1 from existing)
               and not exists (select 1 from snap where snap.suspended is not null and not snap.reset_pending)
               as record,
               exists (select 1 from existing e where (e.turn).status in ('queued', 'running')) as rerun
    ), sess as (
        insert into june_sessions as s (agent, session, next_position, lease_owner, lease_expires, fence)
        select p_agent, p_session, 2, p_owner, extract(epoch from clock_timestamp()) + p_lease_s, 1
          from plan where plan.record or plan.rerun
        on conflict (agent, session) do update
           set next_position = s.next_position + (select plan.record::int from plan),
               -- take: the row is the version snap read, and the lease was free in it
               fence = case when s.xmin = (select snap.version from snap) and (select snap.free from snap)
                            then s.fence + 1 else s.fence end,
               lease_owner = case when s.xmin = (select snap.version from snap) and (select snap.free from snap)
                                  then excluded.lease_owner else s.lease_owner end,
               lease_expires = case when s.xmin = (select snap.version from snap) and (select snap.free from snap)
                                    then excluded.lease_expires else s.lease_expires end
        returning s.next_position - 1 as position, s.generation, s.fence, s.lease_owner, s.lease_expires,
                  s.event_seq, s.reset_pending
    ), taken as (
        select coalesce(sess.lease_owner = p_owner and sess.fence = coalesce(snap.fence, 0) + 1, false) as yes,
               coalesce(sess.reset_pending, false) as resetting
          from (select 1) one left join snap on true left join sess on true
    ), first_old as (
        -- the turn the lease is taken for, if one was recorded before: its start is counted here, now
        select ut as turn from june_turns ut, taken
         where taken.yes and ut.agent = p_agent and ut.session = p_session and ut.status in ('queued', 'running')
         order by ut.position limit 1
    ), counted_old as (
        -- (a turn queued behind a pending reset runs once the reset is done, and is counted then)
        update june_turns cu set attempts = cu.attempts + 1
          from first_old fo, taken
         where cu.agent = p_agent and cu.session = p_session and cu.turn_id = (fo.turn).turn_id
           and cu.attempts < p_max_attempts and (not taken.resetting or (fo.turn).cancel_reason is not null)
        returning 1
    ), ins as (
        -- the turn recorded now, and the lease taken for it: its first start is counted as it is recorded
        insert into june_turns as it (agent, session, turn_id, position, status, payload, generation, attempts)
        select p_agent, p_session, p_turn_id, sess.position, 'queued', p_payload, sess.generation,
               case when taken.yes and not taken.resetting and p_max_attempts > 0
                         and not exists (select 1 from first_old) then 1 else 0 end
          from sess, plan, taken where plan.record
        on conflict do nothing
        returning it as turn
    )
    select exists (select 1 from ins), k.took,
           -- not taken although free or ours: the row changed under this statement; call again
           not k.took and sess.fence is not null
           and (sess.lease_owner = p_owner or sess.lease_owner is null
                or sess.lease_expires < extract(epoch from clock_timestamp())
                or not exists (select 1 from june_workers w where w.owner = sess.lease_owner
                                 and w.alive_until >= extract(epoch from clock_timestamp()))),
           sess.fence, snap.generation, snap.status, snap.suspended, sess.event_seq, sess.reset_pending,
           tr.valid, tr.compacted_at, tr.messages, tr.steps, e.turn, f.turn,
           exists (select 1 from counted_old) or exists (select 1 from ins i where (i.turn).attempts = 1)
      from (select 1) one
      left join snap on true
      left join sess on true
      cross join lateral (
            select coalesce(sess.lease_owner = p_owner and sess.fence = coalesce(snap.fence, 0) + 1, false) as took) k
      left join existing e on true
      left join lateral (
            select x.* from june_transcript(p_agent, p_session, p_generation, p_have, p_last_turn) x
             where k.took) tr on true
      -- the first unfinished turn as it was before this statement (its attempts not counting this start)
      left join lateral (
            select coalesce((select fo.turn from first_old fo),
                            (select json_populate_record(i.turn, '{"attempts": 0}') from ins i)) as turn
             where k.took) f on true;
    end
    $$;
    """,
    # 14: a transcript row's body without what its columns hold (role, turn_id) and without fields at their
    # defaults (stores/_sql.message_body): about a fifth of a short message's row. june_message puts a message's
    # JSON back together (as _sql.message_text does); june_transcript reads through it. Rows written before
    # hold role and turn_id in the body as well: the JSON then repeats those keys, with the same values.
    # (stable, not immutable: to_json is stable, and so the function is inlined into the aggregate.)
    """
    create function june_message(p_role text, p_turn_id text, p_body json) returns text
    language sql stable parallel safe as $$
    select '{"role":' || to_json(p_role)::text || ',"turn_id":' || to_json(p_turn_id)::text
           || case when p_body::text = '{}' then '}' else ',' || substr(p_body::text, 2) end
    $$;

    create or replace function june_transcript(
        p_agent text, p_session text, p_generation integer, p_have integer, p_last_turn text
    ) returns table (valid boolean, compacted_at integer, messages text, steps text)
    language sql stable as $$
    select v.valid,
           (select max(m.idx) from june_messages m
             where m.agent = p_agent and m.session = p_session and m.role = 'summary'),
           (select '[' || coalesce(string_agg(june_message(m.role, m.turn_id, m.body), ',' order by m.idx), '') || ']'
              from june_messages m
             where m.agent = p_agent and m.session = p_session and m.idx >= case when v.valid then p_have else 0 end),
           (select coalesce(json_agg(json_build_array(st.step_id, st.turn_id, st.data)), '[]'::json)::text
              from (select st.step_id, st.turn_id, st.data from june_steps st
                     where st.agent = p_agent and st.session = p_session
                       and st.step_id >= 'session:' and st.step_id < 'session;'
                    union all
                    select st.step_id, st.turn_id, st.data from june_turns t
                      join june_steps st on st.turn_id = t.turn_id and st.agent = t.agent and st.session = t.session
                     where t.agent = p_agent and t.session = p_session and t.status in ('queued', 'running')) st)
      from (select coalesce(
                (select s.generation from june_sessions s where s.agent = p_agent and s.session = p_session)
                    = p_generation
                and (p_have = 0 or exists (
                     select 1 from june_messages m
                      where m.agent = p_agent and m.session = p_session and m.idx = p_have - 1
                        and m.turn_id = p_last_turn)),
                false) as valid) v
    $$;
    """,
    # 15: the operator console (june_worker/gateway/console.py) lists rejected turns (refused at intake: an unknown
    # agent, a bad payload, a parked session) among the failed ones, latest first along one index; and shows a
    # `new` session whose turns of its generation were all rejected as `rejected`. Its row stays `new` (no turn
    # opened it, and its next turn runs in it as in any new session): june_turns_all_rejected is the console's rule.
    """
    drop index june_turns_failed;
    create index june_turns_failed on june_turns (finished_at, agent, session, turn_id)
        where status in ('failed', 'rejected');

    create function june_turns_all_rejected(p_agent text, p_session text, p_generation integer) returns boolean
    language sql stable parallel safe as $$
    select exists (select 1 from june_turns t
                    where t.agent = p_agent and t.session = p_session and t.generation = p_generation
                      and t.status = 'rejected')
       and not exists (select 1 from june_turns t
                        where t.agent = p_agent and t.session = p_session and t.generation = p_generation
                          and t.status <> 'rejected')
    $$;
    """,
]

_WHY_NOT = """
select s.fence, s.suspended::text,
       coalesce(s.park_expires_at <= extract(epoch from now()), false), t.status, t.cancel_reason
  from june_sessions s
  left join june_turns t on t.agent = s.agent and t.session = s.session and t.turn_id = %(t_id)s::text
 where s.agent = %(agent)s and s.session = %(session)s
"""

_ENSURE_SESSION = "insert into june_sessions (agent, session) values (%(agent)s, %(session)s) on conflict do nothing"

MESSAGES_JSON = """(select '[' || coalesce(string_agg(june_message(m.role, m.turn_id, m.body), ',' order by m.idx), '')
       || ']' from june_messages m where m.agent = %(agent)s and m.session = %(session)s)"""
"""The session's transcript as one JSON text (a scalar subquery), as :func:`session_snapshot` reads it."""

STEPS_JSON = """(select coalesce(json_agg(json_build_array(st.step_id, st.turn_id, st.data)), '[]'::json)::text
       from june_steps st where st.agent = %(agent)s and st.session = %(session)s)"""
"""The session's steps as one JSON text (a scalar subquery), as :func:`session_snapshot` reads it."""

_LOAD = f"""
select s.generation, s.status, s.suspended::text, s.event_seq, s.reset_pending, {MESSAGES_JSON}, {STEPS_JSON},
       s.park_expires_at,
       (select max(m.idx) from june_messages m
         where m.agent = %(agent)s and m.session = %(session)s and m.role = 'summary')
from (select 1) as one
left join june_sessions s on s.agent = %(agent)s and s.session = %(session)s
"""


def turn_columns(alias: str = "") -> str:
    """A turn row's columns in the order :func:`turn_from_row` reads them, each prefixed with ``alias``
    (``"t."``), JSON as text."""
    names = (
        "turn_id position status payload::text cancel_reason attempts result::text generation created_at finished_at"
        " last_error"
    )
    return ", ".join(alias + name for name in names.split())


TURN_COLUMNS = turn_columns()
"""A turn row's columns in the order :func:`turn_from_row` reads them."""
TURN_WIDTH = len(TURN_COLUMNS.split(","))
"""How many columns :data:`TURN_COLUMNS` selects."""

_ENQUEUE = f"""
select e.recorded, {turn_columns("(e.turn).")}
  from june_enqueue_turn(%(agent)s, %(session)s, %(turn_id)s, %(payload)s::json) e
"""
"""Record a queued turn (migration 5's function, as migration 11 left it; durable producers call it too)."""

_SESSION_EXISTS = "select exists (select 1 from june_sessions where agent = %(agent)s and session = %(session)s)"
_GET_TURN = (
    f"select {TURN_COLUMNS} from june_turns where agent = %(agent)s and session = %(session)s and turn_id = %(turn_id)s"
)

_CHILD_TURNS = (
    f"select agent, session, {TURN_COLUMNS} from june_turns"
    " where agent = any(%(agents)s) and session >= %(low)s and session < %(high)s"
    " and payload->'parent'->>'turn_id' = %(parent_turn)s and payload->'parent'->>'agent' = %(parent_agent)s"
    " and payload->'parent'->>'session' = %(parent_session)s"
    " order by session, position"
)
"""The child turns of one turn: a range of the child sessions' ids (``<session>:sub:...``; ';' follows ':'), along
the primary key, each turn's parent link checked."""

_UNFINISHED = (
    f"select {TURN_COLUMNS} from june_turns where agent = %(agent)s and session = %(session)s "
    "and status in ('queued', 'running') order by position"
)

_CANCEL = """
with marked as (
    update june_turns set cancel_reason = coalesce(cancel_reason, %(reason)s::text)
    where agent = %(agent)s and session = %(session)s and status in ('queued', 'running')
      and (%(ids)s::text[] is null or turn_id = any(%(ids)s::text[]))
    returning turn_id, position
)
select turn_id from marked order by position
"""

_EVENTS = """
select coalesce(json_agg(body order by seq), '[]'::json)::text from june_events
where agent = %(agent)s and session = %(session)s and seq > %(after)s::bigint
  and (%(turn_id)s::text is null or turn_id = %(turn_id)s::text)
"""

_LOCK_SESSION = """
insert into june_sessions as s (agent, session) values (%(agent)s, %(session)s)
on conflict (agent, session) do update set generation = s.generation
returning s.fence, s.event_seq, s.generation
"""

# A rejection in the transaction that locked the session row: the turn inserted as rejected when it is new
# (never queued, so no drain can run it), else set rejected (the caller checked it has not ended), its payload
# replaced when the stored one cannot be used (`replace`); its turn.failed event in the outbox; the session's
# counters moved.
_REJECT = f"""
with sess as (
    update june_sessions set event_seq = %(seq)s,
           next_position = next_position + case when %(new)s then 1 else 0 end
     where agent = %(agent)s and session = %(session)s
    returning next_position - 1 as position, generation
), ev as (
    insert into june_events (agent, session, seq, turn_id, type, body)
    values (%(agent)s, %(session)s, %(seq)s, %(turn_id)s, 'turn.failed', %(body)s::json)
), ins as (
    insert into june_turns (agent, session, turn_id, position, status, payload, result, generation, finished_at)
    select %(agent)s, %(session)s, %(turn_id)s, sess.position, 'rejected', %(payload)s::json, %(result)s::json,
           sess.generation, extract(epoch from now())
      from sess where %(new)s
    returning {TURN_COLUMNS}
), upd as (
    update june_turns set status = 'rejected', result = %(result)s::json, finished_at = extract(epoch from now()),
           payload = case when %(replace)s then %(payload)s::json else payload end
     where agent = %(agent)s and session = %(session)s and turn_id = %(turn_id)s and not %(new)s
    returning {TURN_COLUMNS}
)
select * from ins union all select * from upd
"""

_RESET = """
with am as (
    insert into june_archived_messages (agent, session, generation, idx, turn_id, role, body)
    select agent, session, %(generation)s::integer, idx, turn_id, role, body
    from june_messages where agent = %(agent)s and session = %(session)s
), ast as (
    insert into june_archived_steps (agent, session, generation, step_id, turn_id, data)
    select agent, session, %(generation)s::integer, step_id, turn_id, data
    from june_steps where agent = %(agent)s and session = %(session)s
), dm as (
    delete from june_messages where agent = %(agent)s and session = %(session)s
), ds as (
    delete from june_steps where agent = %(agent)s and session = %(session)s
)
update june_sessions set generation = generation + 1, status = 'new', suspended = null, parked_at = null,
       reset_pending = false
where agent = %(agent)s and session = %(session)s
"""

_ACQUIRE_FENCE = """
insert into june_sessions as s (agent, session, fence) values (%(agent)s, %(session)s, 1)
on conflict (agent, session) do update set fence = s.fence + 1
returning s.fence
"""


@functools.lru_cache(maxsize=512)
def _format(sql: str) -> str:
    return qmark_to_format(sql)


# A tool's statement: under a savepoint of its own (a failure rolls back the statement alone), planned with the
# planner's defaults (the store's own statements run without sequential scans: see _configure).
_TOOL_STATEMENT = "savepoint june_stmt; set local enable_seqscan = on; {}; set local enable_seqscan = off; release savepoint june_stmt"


class _Handle:
    """A sync tool's view of the step's transaction. ``BEGIN`` goes out with the first use.

    Each statement runs under its own savepoint, in the same round trip (client-side binding,
    one simple query): a statement that fails rolls back alone, so a tool that catches the error
    leaves the step's transaction usable. It is planned with the planner's defaults (sequential
    scans allowed, unlike the store's own statements); on :meth:`unwrap`'s raw connection they are
    not. A statement that finds the connection lost is the
    store's failure, not the tool's: :attr:`lost` keeps it, and the step is not committed whatever
    the tool does with the error.
    """

    def __init__(self, conn: Conn) -> None:
        self._conn = conn
        self.begun = False
        self.lost: BaseException | None = None
        self._cursor: psycopg.ClientCursor[TupleRow] | None = None

    def begin(self) -> Conn:
        if not self.begun:
            self._conn.execute("begin; savepoint june_step", prepare=False)
            self.begun = True
        return self._conn

    def _run(self, sql: str, params: tuple[Any, ...]) -> psycopg.ClientCursor[TupleRow]:
        conn = self.begin()
        if self._cursor is None:
            self._cursor = psycopg.ClientCursor(conn)
        cur = self._cursor
        try:
            cur.execute(_TOOL_STATEMENT.format(_format(sql)), params, prepare=False)
        except psycopg.Error as exc:
            if conn.broken or _is_unavailable(exc):
                self.lost = exc
                raise StoreUnavailableError(f"the step's transaction was lost: {type(exc).__name__}: {exc}") from exc
            with contextlib.suppress(psycopg.Error):
                conn.execute("rollback to savepoint june_stmt", prepare=False)
            raise
        cur.nextset()  # past the savepoint's and the setting's results, to the statement's own
        cur.nextset()
        return cur

    def execute(self, sql: str, *params: Any) -> int:
        return self._run(sql, params).rowcount

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        cur = self._run(sql, params)
        return cur.fetchall() if cur.description else []

    def unwrap(self) -> Conn:
        """The psycopg connection, inside the step's transaction: use it, never commit or roll it back.

        Statements run here have no savepoint of their own: a tool that catches a failed one must
        use one itself (``with conn.transaction():`` makes one), or the step fails. They are planned
        as the store's own are, without sequential scans (``set local enable_seqscan = on`` first for
        a statement that needs one).
        """
        return self.begin()


_UNAVAILABLE_SQLSTATES = frozenset(
    {
        "57P01",  # admin_shutdown: pg_terminate_backend, a fast shutdown
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now: the server is starting or in recovery
        "53300",  # too_many_connections
        "40001",  # serialization_failure: the transaction runs again
        "40P01",  # deadlock_detected: the transaction runs again
    }
)


def _is_unavailable(exc: BaseException) -> bool:
    """A fault of the connection or the server, not of the statement: the connection lost (psycopg's own
    ``OperationalError`` without a SQLSTATE, ``InterfaceError``, class 08), the server shutting down or not
    taking connections, a serialization failure or deadlock to run again (:data:`_UNAVAILABLE_SQLSTATES`); also a
    statement that met a concurrent schema change mid-way (``cache lookup failed``: it resolved a type or function
    the change then dropped, as ``june migrate --partitions`` does), which runs again on the new schema.

    Anything else the server answers is the statement's own, even in the ``OperationalError`` family: a
    ``statement_timeout`` (57014), a ``NOWAIT`` lock not available (55P03), a program limit (54xxx) would
    fail the same way again, so a tool's statement that meets one is the tool's error, not a lost step."""
    if isinstance(exc, pg_errors.InternalError_) and "cache lookup failed" in str(exc):
        return True
    if isinstance(exc, psycopg.InterfaceError):
        return True
    if not isinstance(exc, psycopg.Error):
        return False
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError)  # raised by the client: the connection failed
    return state.startswith("08") or state in _UNAVAILABLE_SQLSTATES


@contextlib.contextmanager
def pooled(pool: ConnectionPool[Conn]) -> Iterator[Conn]:
    """A connection of ``pool`` in autocommit; a fault of the connection or the server (lost, shut down, no
    connection to be had, a deadlock) becomes :class:`StoreUnavailableError`, the failure policy's transient
    class. Statement errors propagate as psycopg raised them."""
    # getconn/putconn, not pool.connection(): every statement here runs in autocommit or
    # in a transaction its caller ends itself, and the plain pair costs half as much.
    try:
        conn = pool.getconn()
    except psycopg.Error as exc:  # PoolTimeout: no connection could be made or freed in time
        raise StoreUnavailableError(f"no database connection: {type(exc).__name__}: {exc}") from exc
    try:
        if not conn.autocommit:  # a pool handed in by the caller
            conn.autocommit = True
        yield conn
    except psycopg.Error as exc:
        if not (conn.broken or _is_unavailable(exc)):
            raise
        raise StoreUnavailableError(f"the database is unavailable: {type(exc).__name__}: {exc}") from exc
    finally:
        pool.putconn(conn)


def _readable(conn: Conn) -> bool:
    """True when an idle connection has something to read: the server closed it (or sent a notice)."""
    try:
        fd = conn.pgconn.socket
        if hasattr(select, "poll"):  # no FD_SETSIZE limit, unlike select()
            poller = select.poll()
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(poller.poll(0))
        ready, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError, psycopg.OperationalError):
        return True
    return bool(ready)


def _configure(conn: Conn) -> None:
    """Every statement of the store is prepared on first use; plan each once, generically, along its indexes.

    A custom plan of the commit CTE costs more than executing it. A generic plan is kept for the
    connection's life, planned again only when an ANALYZE of a table it reads invalidates it (at most
    once a minute per database from autovacuum); made while a table held a few rows, it would scan the
    whole table (cheapest then) and go on doing so as the table grows, every turn costing more than the
    last until the next ANALYZE. Every statement of the store finds its rows by an index (the session's
    key, or the sweeper's partial indexes), so sequential scans are off for them. Tool statements run
    through the handle are never prepared and run with the planner's defaults (see :class:`_Handle`).
    """
    conn.execute("set plan_cache_mode = force_generic_plan")
    conn.execute("set enable_seqscan = off")


def _check(conn: Conn) -> None:
    """The pool's check on every checkout: one ``select()`` syscall; a round trip only if the socket stirred.

    A backend killed while the connection sat idle (``pg_terminate_backend``, a restart) has
    already written its goodbye, so this catches it before a commit is sent on it.
    """
    if conn.closed or _readable(conn):
        ConnectionPool.check_connection(conn)


class PostgresStore:
    """Sessions in Postgres. ``url_or_pool``: a libpq URL/DSN, or a ``ConnectionPool`` you own.

    The store's pool is opened at once and the schema migrated (``migrate=False`` to skip).
    Connections are used in autocommit mode. The store's statements are server-side prepared
    on first use with a generic plan; pass ``prepare=False`` behind a pooler that cannot keep
    prepared statements (PgBouncer before 1.21 in transaction mode).
    """

    supports_rollback = True

    def __init__(
        self,
        url_or_pool: str | ConnectionPool[Conn],
        *,
        min_size: int = 1,
        max_size: int = 4,
        timeout_s: float = 30.0,
        migrate: bool = True,
        prepare: bool = True,
    ) -> None:
        if isinstance(url_or_pool, ConnectionPool):
            self._pool: ConnectionPool[Conn] = url_or_pool
            self._owns_pool = False
        else:
            self._pool = ConnectionPool(
                url_or_pool,
                min_size=min_size,
                max_size=max(min_size, max_size),
                kwargs={"autocommit": True, "prepare_threshold": 0 if prepare else None},
                configure=_configure if prepare else None,
                check=_check,
                timeout=timeout_s,
                open=False,
                name="june-store",
            )
            self._pool.open(wait=True, timeout=timeout_s)
            self._owns_pool = True
        self._cursors: weakref.WeakKeyDictionary[Conn, psycopg.Cursor[TupleRow]] = weakref.WeakKeyDictionary()
        if migrate:
            self.migrate()

    @property
    def pool(self) -> ConnectionPool[Conn]:
        """The store's connection pool, for hosts that keep their own tables beside the store's (leases)."""
        return self._pool

    # --- plumbing ------------------------------------------------------------------------------------

    def _connection(self) -> contextlib.AbstractContextManager[Conn]:
        return pooled(self._pool)

    def _read(self, fn: Callable[[Conn], T]) -> T:
        """Run an idempotent read; once more on a fresh connection if the first one turned out dead."""
        used: Conn | None = None
        try:
            with self._connection() as conn:
                used = conn
                return fn(conn)
        except StoreUnavailableError:
            if used is None or not used.broken:
                raise
        with self._connection() as conn:
            return fn(conn)

    # --- schema ------------------------------------------------------------------------------------

    def migrate(self) -> None:
        """Apply missing migrations, each in its own transaction under an advisory lock: safe from many workers."""
        with self._connection() as conn:
            for version, script in enumerate(_MIGRATIONS, start=1):
                with conn.transaction():
                    conn.execute("select pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                    conn.execute(
                        "create table if not exists june_schema ("
                        "version integer primary key, applied_at timestamptz not null default now())"
                    )
                    done = conn.execute("select 1 from june_schema where version = %s", (version,)).fetchone()
                    if done:
                        continue
                    conn.execute(script, prepare=False)
                    conn.execute("insert into june_schema (version) values (%s)", (version,))

    def partition(self, partitions: int) -> bool:
        """Hash-partition the per-session tables by ``(agent, session)`` into ``partitions`` partitions (after
        :meth:`migrate`); False when they are partitioned so already. One transaction; the tables are locked while
        their rows are copied (workers wait, then go on). See :mod:`._pg_partition`."""
        self.migrate()
        with self._connection() as conn:
            conn.execute("select pg_advisory_lock(%s)", (_MIGRATION_LOCK,))
            try:
                return partition_tables(conn, partitions)
            finally:
                conn.execute("select pg_advisory_unlock(%s)", (_MIGRATION_LOCK,))

    def partitions(self) -> dict[str, int]:
        """How many hash partitions each per-session table has (0: not partitioned)."""
        with self._connection() as conn:
            return partition_count(conn)

    # --- reads -------------------------------------------------------------------------------------

    def load(self, ref: SessionRef) -> SessionSnapshot:
        key = {"agent": ref.agent, "session": ref.session}
        row = self._read(lambda c: c.execute(_LOAD, key).fetchone())
        assert row is not None
        return session_snapshot(ref, *row)

    def pending(self, ref: SessionRef) -> SuspendedCheckpoint | None:
        key = {"agent": ref.agent, "session": ref.session}
        row = self._read(
            lambda c: c.execute(
                "select suspended::text, park_expires_at from june_sessions"
                " where agent = %(agent)s and session = %(session)s",
                key,
            ).fetchone()
        )
        if not row or not row[0]:
            return None
        return SuspendedCheckpoint.model_validate_json(row[0]).with_expiry(row[1])

    def session_exists(self, ref: SessionRef) -> bool:
        """Whether anything was ever recorded for the session (a turn, a lease, a reset)."""
        key = {"agent": ref.agent, "session": ref.session}
        row = self._read(lambda c: c.execute(_SESSION_EXISTS, key).fetchone())
        return bool(row and row[0])

    def get_turn(self, ref: SessionRef, turn_id: str) -> TurnRecord | None:
        key = {"agent": ref.agent, "session": ref.session, "turn_id": turn_id}
        row = self._read(lambda c: c.execute(_GET_TURN, key).fetchone())
        return turn_from_row(ref, row) if row else None

    def child_turns(self, parent: SessionRef, parent_turn_id: str, agents: Collection[str]) -> list[TurnRecord]:
        key = {
            "agents": sorted(agents),
            "low": f"{parent.session}:sub:",
            "high": f"{parent.session}:sub;",
            "parent_turn": parent_turn_id,
            "parent_agent": parent.agent,
            "parent_session": parent.session,
        }
        rows = self._read(lambda c: c.execute(_CHILD_TURNS, key).fetchall())
        return [turn_from_row(SessionRef(r[0], r[1]), r[2:]) for r in rows]

    def unfinished_turns(self, ref: SessionRef) -> list[TurnRecord]:
        key = {"agent": ref.agent, "session": ref.session}
        rows = self._read(lambda c: c.execute(_UNFINISHED, key).fetchall())
        return [turn_from_row(ref, r) for r in rows]

    def events(self, ref: SessionRef, *, turn_id: str | None = None, after_seq: int = 0) -> list[TurnEvent]:
        key = {"agent": ref.agent, "session": ref.session, "after": Int8(after_seq), "turn_id": turn_id}
        row = self._read(lambda c: c.execute(_EVENTS, key).fetchone())
        assert row is not None
        return _EventsAdapter.validate_json(row[0])

    # --- writes ------------------------------------------------------------------------------------

    def commit(self, ref: SessionRef, commit: Commit | CommitBuilder, *, fence: int | None = None) -> list[TurnEvent]:
        with self._connection() as conn:
            if isinstance(commit, Commit):
                return self._apply(conn, ref, commit, fence)[0]
            handle = _Handle(conn)
            try:
                try:
                    built = commit(handle)
                finally:
                    if handle.lost is not None or conn.broken:  # whatever the tool made of it, the transaction is gone
                        raise StoreUnavailableError(
                            f"session {ref}: the step's transaction was lost under the tool: "
                            f"{handle.lost or 'the connection broke'}"
                        ) from handle.lost
                if handle.begun and conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
                    raise StoreError(
                        f"session {ref}: a statement the tool ran on the raw connection (unwrap()) failed and was "
                        "caught without a savepoint of its own, so the step's transaction is aborted; nothing of the "
                        "step was written. Use ctx.store.execute / query, or wrap such statements in "
                        "conn.transaction()"
                    )
                events = self._apply(conn, ref, built, fence)[0]
            except BaseException:
                if handle.begun:
                    with contextlib.suppress(psycopg.Error):  # a dead connection has no transaction left
                        conn.execute("rollback", prepare=False)
                raise
            if handle.begun:
                conn.execute("commit", prepare=False)
            return events

    def commit_releasing(self, ref: SessionRef, commit: Commit, *, fence: int) -> tuple[list[TurnEvent], bool]:
        """:meth:`commit` the checkpoint that ends a turn and, in the same statement, give the lease up.

        For a host that leases sessions (``fence``, ``lease_owner`` on the session row): the lease
        is given up unless another turn of the session is queued or running, or one was recorded
        after this statement's snapshot (``next_position`` moved). Returns the events and whether
        the lease is free now; if not, the caller runs the session's next turn. ``commit`` must set
        its turn's status (``turn_id`` and ``turn_status``).
        """
        return self.commit_ending(ref, commit, fence=fence, release=True)

    def commit_ending(
        self, ref: SessionRef, commit: Commit, *, fence: int, release: bool = False, deliver_due: bool = False
    ) -> tuple[list[TurnEvent], bool]:
        """:meth:`commit` the checkpoint that ends a turn, with what a worker does in the same statement:
        ``release`` as :meth:`commit_releasing`; ``deliver_due`` marks the turn due for delivery to its
        target (the worker clears the mark once delivered). Returns the events and whether the lease is free."""
        with self._connection() as conn:
            return self._apply(conn, ref, commit, fence, release=release, deliver_due=deliver_due)

    def _apply(
        self,
        conn: Conn,
        ref: SessionRef,
        commit: Commit,
        fence: int | None,
        *,
        release: bool = False,
        deliver_due: bool = False,
    ) -> tuple[list[TurnEvent], bool]:
        sql, params = commit_statement(ref, commit, fence, release=release, deliver_due=deliver_due)
        cur = self._cursors.get(conn)
        if cur is None or cur.closed:
            cur = self._cursors[conn] = conn.cursor()  # one per connection: a step's commit skips making one
        for _ in range(_COMMIT_ATTEMPTS):
            try:
                row = cur.execute(sql, params).fetchone()
            except pg_errors.UniqueViolation as exc:
                if _names_messages_key(exc.diag.constraint_name, exc.diag.table_name):
                    raise MessageIndexTakenError(
                        f"session {ref}: a message index of this commit is taken ({exc.diag.message_detail})"
                    ) from exc
                raise StoreError(f"session {ref}: the commit broke a unique constraint: {exc}") from exc
            if row is not None:
                base = row[0] - len(commit.events)
                events = [e.model_copy(update={"seq": base + i}) for i, e in enumerate(commit.events, start=1)]
                return events, release and bool(row[1])
            # Nothing was written. Ask why: off the happy path, so a second round trip is fine.
            found = conn.execute(_WHY_NOT, {"t_id": None, **params}).fetchone()
            current_fence, parked_text, expired, turn_status, cancel_reason = (
                found if found is not None else (0, None, False, None, None)
            )
            if fence is not None and fence != current_fence:
                raise LeaseLostError(f"session {ref} is leased under fence {current_fence}, not {fence}")
            if commit.expect_suspended is not None:
                turn_id, input_id = commit.expect_suspended
                parked = SuspendedCheckpoint.model_validate_json(parked_text) if parked_text else None
                if not parked_on(parked, turn_id, input_id, commit.expect_version):
                    raise ResumeConflictError(f"session {ref} is not parked on turn {turn_id} input {input_id!r}")
                if commit.expect_expired and not expired:
                    raise ResumeConflictError(f"session {ref}: input {input_id!r} has not expired")
            if commit.turn_status is not None and turn_status in ENDED_TURN_STATUSES:
                raise TurnEndedError(
                    f"session {ref}: turn {commit.turn_id} has ended ({turn_status}); its status stays"
                )
            if commit.expect_not_cancelled and cancel_reason is not None:
                raise CancelRequestedError(cancel_reason)
            if found is None:  # the session's first write: create its row, then write
                conn.execute(_ENSURE_SESSION, params)
            # else the row changed between the statement and this look at it: run it again.
        raise StoreError(
            f"session {ref}: the commit kept racing concurrent changes of the session row; nothing written"
        )

    def enqueue_turn(self, ref: SessionRef, turn_id: str, payload: TurnPayload) -> tuple[TurnRecord, bool]:
        params = {
            "agent": ref.agent,
            "session": ref.session,
            "turn_id": turn_id,
            "payload": payload.model_dump_json(),
        }
        with self._connection() as conn:
            for _ in range(_COMMIT_ATTEMPTS):
                row = conn.execute(_ENQUEUE, params).fetchone()
                if row is not None:  # none: a concurrent enqueue of the same turn won; its row is visible now
                    return turn_from_row(ref, row[1:]), bool(row[0])
        raise StoreError(f"session {ref}: could not enqueue turn {turn_id}")

    def request_cancel(self, ref: SessionRef, reason: str, *, turn_ids: Sequence[str] | None = None) -> list[str]:
        params = {
            "agent": ref.agent,
            "session": ref.session,
            "reason": reason,
            "ids": list(turn_ids) if turn_ids is not None else None,
        }
        with self._connection() as conn:
            return [r[0] for r in conn.execute(_CANCEL, params).fetchall()]

    def reject_turn(
        self,
        ref: SessionRef,
        turn_id: str,
        payload: TurnPayload,
        reason: str,
        *,
        fence: int | None = None,
        new_only: bool = False,
    ) -> tuple[TurnRecord, list[TurnEvent]]:
        key: dict[str, Any] = {"agent": ref.agent, "session": ref.session, "turn_id": turn_id}
        event = rejection_event(turn_id, reason)
        with self._connection() as conn, conn.transaction():
            row = conn.execute(_LOCK_SESSION, key).fetchone()  # creates and locks the session row
            assert row is not None
            _check_fence(ref, int(row[0]), fence)
            event_seq = int(row[1])
            found = conn.execute(_GET_TURN + " for update", key).fetchone()
            existing, unusable = stored_turn(ref, found) if found else (None, None)
            # A record no worker can use, still queued (made outside the workers: a durable producer's; no runner
            # ever opened it, though picks may have counted starts of it), is rejected whatever new_only says,
            # since nothing else would ever end it; its payload is replaced by this one.
            replace = found is not None and unusable is not None and found[2] == "queued"
            if not replace:
                if found is not None and existing is None:
                    raise StoreError(f"turn {turn_id} of {ref}: {unusable}; it is {found[2]}, so it is left alone")
                if existing is not None and (new_only or existing.status not in UNFINISHED_TURN_STATUSES):
                    return existing, []
            seq = event_seq + 1
            params = {
                **key,
                "payload": payload.model_dump_json(),
                "result": Rejected(turn_id=turn_id, reason=reason).model_dump_json(),
                "seq": Int8(seq),
                "body": event.model_copy(update={"seq": seq}).model_dump_json(by_alias=True),
                "new": found is None,
                "replace": replace,
            }
            stored = conn.execute(_REJECT, params).fetchone()
            assert stored is not None
        return turn_from_row(ref, stored), [event.model_copy(update={"seq": seq})]

    def reset(self, ref: SessionRef, *, fence: int | None = None) -> ResetResult:
        key: dict[str, Any] = {"agent": ref.agent, "session": ref.session}
        with self._connection() as conn, conn.transaction():
            row = conn.execute(_LOCK_SESSION, key).fetchone()  # creates and locks the session row
            assert row is not None
            _check_fence(ref, int(row[0]), fence)
            generation = int(row[2])
            conn.execute(_RESET, {**key, "generation": generation})
        return ResetResult(previous_session=f"{ref.session}#g{generation}", generation=generation)

    def acquire_fence(self, ref: SessionRef) -> int:
        """Take the session's fencing token: every later commit with an older token fails."""
        with self._connection() as conn:
            row = conn.execute(_ACQUIRE_FENCE, {"agent": ref.agent, "session": ref.session}).fetchone()
        assert row is not None
        return int(row[0])

    def close(self) -> None:
        if self._owns_pool:
            self._pool.close()


def _names_messages_key(constraint: str | None, table: str | None) -> bool:
    """A unique violation of the transcript's key: ``june_messages_pkey``, or its partition's (``june_messages_p3_pkey``
    on ``june_messages_p3``) when the table is hash-partitioned."""
    if constraint == "june_messages_pkey":
        return True
    return bool(table and constraint and table.startswith("june_messages_p") and constraint == f"{table}_pkey")


def _check_fence(ref: SessionRef, current: int, fence: int | None) -> None:
    if fence is not None and fence != current:
        raise LeaseLostError(f"session {ref} is leased under fence {current}, not {fence}")


def session_snapshot(
    ref: SessionRef,
    generation: int | None,
    status: str | None,
    suspended: str | None,
    event_seq: int | None,
    reset_pending: bool | None,
    messages: str,
    steps: str,
    park_expires_at: float | None = None,
    compacted_at: int | None = None,
    *,
    held: Sequence[Message] = (),
) -> SessionSnapshot:
    """A session from its row's columns (None: no row yet), the messages as JSON text (:data:`MESSAGES_JSON`, or
    only those after ``held``, the messages a worker holds already) and the steps (:data:`STEPS_JSON`)."""
    transcript = _MessagesAdapter.validate_json(messages)
    if held:
        transcript = [*held, *transcript]
    # Built without validating again what was just parsed: at 10,000 messages that would cost 2.7 ms.
    return SessionSnapshot.model_construct(
        ref_agent=ref.agent,
        ref_session=ref.session,
        generation=generation or 0,
        status=cast(SessionStatus, status or "new"),  # the table's check constraint keeps it one of them
        suspended=SuspendedCheckpoint.model_validate_json(suspended).with_expiry(park_expires_at)
        if suspended
        else None,
        reset_pending=bool(reset_pending),
        messages=transcript,
        steps={
            step_id: StepRecord(step_id=step_id, turn_id=turn_id, data=data)
            for step_id, turn_id, data in json.loads(steps)
        },
        event_seq=event_seq or 0,
        compacted_at=compacted_at,
    )


def stored_turn(ref: SessionRef, row: Sequence[Any]) -> tuple[TurnRecord | None, str | None]:
    """A turn row read as :func:`turn_from_row` reads it (None when it cannot be), and why no worker can run its
    record (None: one can).

    Workers record only what they validated, but a durable producer records through ``june_enqueue_turn`` from
    outside, and Postgres' ``json`` takes what no worker can use: a lone surrogate escape (the record cannot be
    read) or a NUL (it can, but no store holds it, and the message it makes is refused).
    """
    try:
        rec = turn_from_row(ref, row)
    except ValidationError as exc:
        problem = exc.errors()[0]
        return None, f"its stored record cannot be read ({problem['msg']})"
    reason = unstorable_reason(rec.payload.model_dump(mode="json"), "payload")
    return rec, None if reason is None else f"its stored {reason}"


def turn_from_row(ref: SessionRef, row: Sequence[Any]) -> TurnRecord:
    """A turn from its columns in :data:`TURN_COLUMNS` order, JSON as text or as psycopg decoded it."""
    turn_id, position, status, payload, cancel_reason, attempts, result, generation, created_at, finished_at = row[:10]
    return TurnRecord(
        turn_id=turn_id,
        agent=ref.agent,
        session=ref.session,
        position=position,
        status=status,
        payload=TurnPayload.model_validate_json(payload)
        if isinstance(payload, str | bytes)
        else TurnPayload.model_validate(payload),
        cancel_reason=cancel_reason,
        attempts=attempts,
        result=None
        if result is None
        else TurnResultAdapter.validate_json(result)
        if isinstance(result, str | bytes)
        else TurnResultAdapter.validate_python(result),
        generation=generation,
        created_at=float(created_at),
        finished_at=float(finished_at) if finished_at is not None else None,
        last_error=row[10],
    )
