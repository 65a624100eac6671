"""The Postgres schema of :class:`~june_worker.stores.postgres.PostgresStore`: its migrations, in order.

Owns the list of migration scripts and the advisory lock that serialises their runners (applied by
:meth:`PostgresStore.migrate`). The list is history: a database records the versions it ran, so a
script is never edited once released; a change is a new script at the end, even when it redefines a
function an earlier script made (the repeated lines between, say, migrations 8 and 13 are the two
versions of ``june_intake``, each as the databases of its time ran it).
"""

from __future__ import annotations

__all__ = ["MIGRATIONS", "MIGRATION_LOCK"]

MIGRATION_LOCK = 0x6A756E65  # "june": the advisory lock that serializes migration runners

MIGRATIONS: list[str] = [
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
    # 16: a step's update of its session row stays a HOT update (no new index entries, a smaller WAL record):
    # it moved two indexed values, updated_at (june_sessions_activity) and event_seq (in the predicate of
    # june_sessions_unrelayed). The relay's partial index is on a flag instead, relay_due, that a commit with
    # events sets and a relay mark clears once the stream holds every event; a turn's steps find it set and
    # leave it so. updated_at moves with what the console lists by: a turn opening, parking, answering,
    # ending, a reset; not with each step between.
    """
    alter table june_sessions add column relay_due boolean not null default false;
    update june_sessions set relay_due = true where event_seq > relayed_seq;
    create index june_sessions_relay_due on june_sessions (agent, session) where relay_due;
    drop index june_sessions_unrelayed;
    """,
    # 17: intake and the turn's opening in one statement (one round trip and one commit fewer per turn): as 13,
    # and when the turn recorded now is the one to run (the session has no unfinished turn, no park, no pending
    # reset) and the lease is taken for it, it opens in the same statement, as the runner's opening commit would:
    # its opening message at the transcript's end (p_role, p_body: a transcript row's columns), the session's
    # initiator step when it has none (p_initiator: the turn's resolved principal, or null), its turn.started
    # (p_event: the body without its leading '{' and its seq, as the commit statement sends events), the session
    # and the turn running; one new version of each row, as before. opened_seq and opened_idx are the event's seq
    # and the message's index; null when the turn did not open here (p_role null: never; the runner opens it).
    # event_seq is the count before the opening (the events a new holder may have to catch up on).
    """
    drop function june_intake(text, text, text, json, text, double precision, integer, integer, text, integer);

    create function june_intake(
        p_agent text, p_session text, p_turn_id text, p_payload json, p_owner text, p_lease_s double precision,
        p_generation integer, p_have integer, p_last_turn text, p_max_attempts integer,
        p_role text, p_body json, p_event text, p_initiator json
    ) returns table (
        recorded boolean, took boolean, retry boolean, fence bigint, generation integer, status text,
        suspended text, event_seq bigint, reset_pending boolean, valid boolean, compacted_at integer,
        messages text, steps text, existing june_turns, first_turn june_turns, counted boolean, opened_seq bigint,
        opened_idx integer
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
               exists (select 1 from existing e where (e.turn).status in ('queued', 'running')) as rerun,
               -- the turn recorded now opens here too (if the lease is taken for it): it is the one to run
               p_role is not null and p_max_attempts > 0
               and not exists (select 1 from snap where snap.suspended is not null or snap.reset_pending)
               and not exists (select 1 from june_turns u where u.agent = p_agent and u.session = p_session
                                 and u.status in ('queued', 'running')) as may_open
    ), sess as (
        insert into june_sessions as s (agent, session, next_position, lease_owner, lease_expires, fence, status,
                                        event_seq, relay_due)
        select p_agent, p_session, 2, p_owner, extract(epoch from clock_timestamp()) + p_lease_s, 1,
               case when plan.record and plan.may_open then 'running' else 'new' end,
               (plan.record and plan.may_open)::int, plan.record and plan.may_open
          from plan where plan.record or plan.rerun
        on conflict (agent, session) do update
           set next_position = s.next_position + (select plan.record::int from plan),
               -- open: the lease is taken (as below) for the turn recorded now, which may open
               status = case when s.xmin = (select snap.version from snap) and (select snap.free from snap)
                                  and (select plan.record and plan.may_open from plan)
                             then 'running' else s.status end,
               event_seq = s.event_seq
                           + case when s.xmin = (select snap.version from snap) and (select snap.free from snap)
                                       and (select plan.record and plan.may_open from plan) then 1 else 0 end,
               relay_due = s.relay_due
                           or coalesce(s.xmin = (select snap.version from snap) and (select snap.free from snap)
                                       and (select plan.record and plan.may_open from plan), false),
               updated_at = case when s.xmin = (select snap.version from snap) and (select snap.free from snap)
                                      and (select plan.record and plan.may_open from plan)
                                 then extract(epoch from now()) else s.updated_at end,
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
    ), opened as (
        -- the turn recorded now, the lease taken for it and nothing before it: its opening is written here
        select sess.event_seq as seq,
               coalesce((select max(m.idx) + 1 from june_messages m where m.agent = p_agent and m.session = p_session),
                        0) as idx
          from sess, plan, taken where taken.yes and plan.record and plan.may_open
    ), opening as (
        insert into june_messages (agent, session, idx, turn_id, role, body)
        select p_agent, p_session, o.idx, p_turn_id, p_role, p_body from opened o
    ), seat as (
        -- the session's initiator, when it has none yet: the turn's resolved principal
        insert into june_steps (agent, session, step_id, turn_id, data)
        select p_agent, p_session, 'session:initiator', p_turn_id, p_initiator from opened where p_initiator is not null
        on conflict do nothing
    ), started as (
        insert into june_events (agent, session, seq, turn_id, type, body)
        select p_agent, p_session, o.seq, p_turn_id, 'turn.started', ('{"seq":' || o.seq || ',' || p_event)::json
          from opened o
    ), ins as (
        -- the turn recorded now, and the lease taken for it: its first start is counted as it is recorded
        insert into june_turns as it (agent, session, turn_id, position, status, payload, generation, attempts)
        select p_agent, p_session, p_turn_id, sess.position,
               case when exists (select 1 from opened) then 'running' else 'queued' end, p_payload, sess.generation,
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
           sess.fence, snap.generation, snap.status, snap.suspended,
           sess.event_seq - coalesce((select 1 from opened), 0), sess.reset_pending,
           tr.valid, tr.compacted_at, tr.messages, tr.steps, e.turn, f.turn,
           exists (select 1 from counted_old) or exists (select 1 from ins i where (i.turn).attempts = 1),
           (select o.seq from opened o), (select o.idx from opened o)
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
                            (select json_populate_record(i.turn, '{"attempts": 0, "status": "queued"}')
                               from ins i)) as turn
             where k.took) f on true;
    end
    $$;
    """,
]
