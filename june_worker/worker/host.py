"""The worker host: one per worker process. It owns the clients and runs sessions under their lease.

Celery tasks are thin shells around :class:`WorkerHost`: they validate the payload and call
one method here. Clients (the Postgres pool, Redis) and the event loop are made per
process, lazily, and remade after a fork, never at import time.

The drain loop is the heart: take the session's lease, relay any events a previous holder
committed but did not publish, then run the session's unfinished turns oldest first, each
under the fence of this lease, until the release succeeds (the queue is empty). The commit
that ends a turn tries the release in the same statement, so a session with nothing else
queued costs no statement of its own to let go.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

import redis
from psycopg_pool import ConnectionPool

from june_wire.keys import EventKeys
from june_wire.redis_url import connect, is_cluster_url

from ..engine.agent import Agent
from ..engine.blocking import inline
from ..engine.crash import CrashAt
from ..engine.events import TurnResult
from ..engine.failures import Failure, backoff_s, classify
from ..engine.hooks import TurnHooks
from ..engine.loop import TurnRunner, opening_commit, reject_turn
from ..engine.resume import reset_park_commit, timeout_commit
from ..engine.secrets import scrubbed_logger
from ..engine.sink import EventSink
from ..engine.store import (
    Commit,
    ResetResult,
    SessionRef,
    SessionSnapshot,
    SuspendedCheckpoint,
    TurnPayload,
    TurnRecord,
)
from ..errors import ConfigError, LeaseLostError, ResumeConflictError, UnusableTurnError
from ..events.redis_stream import RedisStreamSink, Trim
from ..observe.metrics import metrics
from ..observe.turns import TurnObserver
from ..stores.postgres import PostgresStore
from . import rendering
from ._running import _Cancel, _Ending, _Running
from .inflight import EventLoopThread, LoopWatch, QueuedSink, StoreLanes, TurnThread, WatchedHooks
from .queue import Intake, Lease, SessionQueue
from .settings import WorkerSettings
from .transcripts import TranscriptCache

__all__ = ["ISOLATE_AFTER", "AfterTurn", "WorkerHost", "heartbeat_pool", "load_agents"]

T = TypeVar("T")

ISOLATE_AFTER = 2
"""Starts of a turn that died (its process killed, its lease lost) after which, with many turns per process, it
runs alone in the isolation worker (:meth:`WorkerHost._isolate`)."""

AfterTurn = Callable[["WorkerHost", SessionRef, TurnRecord, TurnResult, Callable[[TurnRecord], None]], None]
"""What a worker does after running a turn, for the subagents it involves (:func:`.children.turn_ended`)."""

log = scrubbed_logger("june_worker.worker")


def _redis(settings: WorkerSettings, *, inflight: bool) -> Any:
    """The process's Redis client. With many turns in flight their threads share a bounded pool of connections,
    waiting for one to be free rather than opening more (a cluster client keeps its own pool per node)."""
    options: dict[str, Any] = {"health_check_interval": 30, "socket_timeout": 5, "socket_connect_timeout": 2}
    if inflight and not is_cluster_url(settings.redis_url):
        pool = redis.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=settings.redis_connections, timeout=10, **options
        )
        return redis.Redis(connection_pool=pool)
    return connect(settings.redis_url, **options)


def heartbeat_pool(url: str) -> ConnectionPool[Any]:
    """The heartbeat's own connection: liveness, lease renewals and cancel checks, never behind a turn's statement.

    Its writes are cheap to lose (a crash of Postgres loses at most the last beats: leases then lapse early, which
    the fence makes harmless), so they do not wait for the disk: ``synchronous_commit = off``."""

    def configure(conn: Any) -> None:
        conn.execute("set synchronous_commit = off")

    pool: ConnectionPool[Any] = ConnectionPool(
        url, min_size=1, max_size=1, kwargs={"autocommit": True}, configure=configure, open=False, name="june-heartbeat"
    )
    pool.open(wait=True, timeout=30)
    return pool


def load_agents(paths: Iterable[str]) -> dict[str, Agent]:
    """Agents from ``module:attribute`` paths: an Agent, a list of them, or a callable returning either."""
    agents: dict[str, Agent] = {}
    for path in paths:
        module_name, _, attr = path.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"agent path {path!r} must look like 'package.module:attribute'")
        try:
            obj: Any = getattr(importlib.import_module(module_name), attr)
            if callable(obj) and not isinstance(obj, Agent):
                obj = obj()
        except ConfigError as exc:  # an agent defined wrongly (a tool's name): it says what
            raise ConfigError(f"cannot load agent {path!r}: {exc}") from exc
        except Exception as exc:  # a module that is not there, or raises as it loads: say so in one line
            raise ConfigError(f"cannot load agent {path!r}: {type(exc).__name__}: {exc}") from exc
        found = obj if isinstance(obj, (list, tuple)) else [obj]
        for agent in found:
            if not isinstance(agent, Agent):
                raise ConfigError(f"{path!r} gave {type(agent).__name__}, not an Agent")
            agents[agent.name] = agent
    return agents


class WorkerHost:
    """A worker process's clients and sessions.

    ``inflight``: many turns at once in this process (Celery's threads pool: ``june worker --turns-per-process``;
    :mod:`.inflight`): one event loop on a thread of its own runs every turn, each turn's blocking calls run on
    the pool thread its message came on, and the heartbeat has a connection of its own. Otherwise one turn at a
    time (prefork, solo), each run on this process's loop from the task's thread.

    ``dispatch`` sends ``june.turn`` for a recorded turn (child turns, woken parents); ``after_turn`` is what the
    worker does when a turn of a subagent's family ended (:func:`~june_worker.worker.children.turn_ended`);
    ``isolate`` (many turns only) sends a turn whose process died under it to the isolation worker. All are given
    by the process that assembles the worker (:mod:`.process`); the host imports none of them.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        agents: dict[str, Agent] | None = None,
        *,
        inflight: bool = False,
        dispatch: Callable[[TurnRecord], None] | None = None,
        after_turn: AfterTurn | None = None,
        isolate: Callable[[TurnRecord], None] | None = None,
    ) -> None:
        self.settings = settings
        self.inflight = inflight
        self.agents = agents if agents is not None else load_agents(settings.agents)
        pool_size = settings.db_pool_size if inflight else 4
        self.store = PostgresStore(settings.database_url, max_size=pool_size)
        self.queue = SessionQueue(self.store.pool, lease_s=settings.lease_s, max_attempts=settings.max_attempts)
        # With many turns in flight, the heartbeat keeps a connection of its own: it must never wait behind the
        # turns' statements (past JUNE_ALIVE_S other workers would take every lease of this process).
        self._beats = (
            SessionQueue(heartbeat_pool(settings.database_url), lease_s=settings.lease_s) if inflight else self.queue
        )
        # Transcripts of sessions this process ran lately: a turn then reads only what it does not hold.
        self.transcripts = TranscriptCache(
            max_sessions=settings.transcript_cache,
            max_messages=settings.transcript_cache_messages,
            max_bytes=settings.transcript_cache_bytes,
        )
        self.keys = EventKeys(prefix=settings.key_prefix, firehose_partitions=settings.firehose_partitions)
        self.redis = _redis(settings, inflight=inflight)
        trim = Trim(maxlen=settings.stream_maxlen or None, max_age_s=settings.stream_max_age_s or None)
        ttl = settings.stream_ttl_s or None
        self.sink = RedisStreamSink(self.redis, keys=self.keys, store=self.store, session_trim=trim, session_ttl_s=ttl)
        # A running turn's steps publish without waiting for Redis (the next step overlaps the append); _run_turn
        # flushes the sink when the turn ends. One turn at a time: one such sink. Many turns: one per lane
        # (inflight.StoreLanes), the lane's thread being what publishes its turns' events. Everything else
        # publishes through self.sink.
        self._turn_sinks = [
            RedisStreamSink(
                self.redis, keys=self.keys, store=self.store, session_trim=trim, pipelined=True, session_ttl_s=ttl
            )
            for _ in range(settings.db_pool_size if inflight else 1)
        ]
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._loop_thread = EventLoopThread() if inflight else None
        # many turns: their ready commits and publishes run on a few threads, one per connection (inflight.StoreLanes)
        self.lanes = StoreLanes(len(self._turn_sinks)) if inflight else None
        self.loop = self._loop_thread.loop if self._loop_thread is not None else asyncio.new_event_loop()
        self.watch = (
            LoopWatch(self.loop, threshold_s=settings.loop_blocked_s, on_blocked=self._blocked_loop)
            if inflight
            else None
        )
        self.crash = CrashAt.parse(settings.crash_at, kill=True) if settings.crash_at else None
        self.observer = TurnObserver(self.agents)  # metrics, spans, transition logs (june_worker/observe)
        self._running: dict[SessionRef, _Running] = {}
        self.dispatch = dispatch
        self.after_turn = after_turn
        self.isolate = isolate if inflight else None
        """Sends a turn whose last start died with its process to the isolation worker (:meth:`_isolate`); None:
        it runs here."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listening = threading.Event()
        self._beats.beat(self.owner, settings.alive_s)  # alive before the first lease is taken
        self._threads = [
            threading.Thread(target=self._heartbeat, name="june-heartbeat", daemon=True),
            threading.Thread(target=self._listen, name="june-control", daemon=True),
        ]
        for t in self._threads:
            t.start()
        # cancel signals are heard from here on (a Redis that does not answer: the heartbeat re-reads cancels anyway)
        self._listening.wait(5)

    # --- agents ----------------------------------------------------------------------------------

    def agent(self, name: str) -> Agent | None:
        return self.agents.get(name)

    # --- child turns (ctx.delegate) ----------------------------------------------------------------

    def send_turn(self, rec: TurnRecord) -> None:
        if self.dispatch is None:
            raise RuntimeError(f"this worker host sends no turns (no dispatch): turn {rec.turn_id} is left queued")
        self.dispatch(rec)

    def launch(self, rec: TurnRecord) -> None:
        """Run a child turn a tool recorded: any worker may (a ``june.turn`` message; intake is idempotent)."""
        self.send_turn(rec)

    # --- claims: one thread of this process per session ----------------------------------------------

    def _claim(self, ref: SessionRef) -> _Running | None:
        """Claim ``ref`` for this thread (it may take the session's lease); None when another thread of this process
        works on it and goes on doing so (it will see any turn recorded before this call)."""
        while True:
            with self._lock:
                held = self._running.get(ref)
                if held is None or not held.draining:
                    mine = _Running(ref=ref, signalled=dict(held.signalled) if held is not None else {})
                    self._running[ref] = mine
                    return mine
            with held.gate:  # a release in progress ends first: it failed on what we recorded, or it let go
                with self._lock:
                    if self._running.get(ref) is held and held.draining:
                        return None

    def _let_go_lease(self, running: _Running) -> None:
        """Under ``running.gate``, after a statement gave the lease up: this thread no longer holds the session."""
        with self._lock:
            running.draining = False

    def _unclaim(self, running: _Running) -> None:
        with self._lock:
            running.draining = False
            if self._running.get(running.ref) is running:
                del self._running[running.ref]

    def held_here(self) -> int:
        """How many sessions threads of this process work on now."""
        with self._lock:
            return sum(1 for r in self._running.values() if r.draining)

    # --- the drain loop -------------------------------------------------------------------------------

    def drain(
        self, ref: SessionRef, *, lease: Lease | None = None, running: _Running | None = None
    ) -> dict[str, TurnResult]:
        """Run the session's unfinished turns if we can take its lease (or hold ``lease``); return what ran.

        Nothing runs when another thread of this process works on the session (it runs what is recorded).
        A transient fault that outlasts a step's retries ends the attempt: the lease is taken again
        after a backoff and the turn replayed (each start counts one of its ``max_attempts``; see
        :mod:`~june_worker.engine.failures`). When the store stays unavailable the fault propagates
        (the task retries later; the sweeper re-sends what stayed unfinished).
        """
        if running is None:
            running = self._claim(ref)
            if running is None:
                return {}
        ran: dict[str, TurnResult] = {}
        failed = 0  # attempts in a row that ended on a transient fault, since the last turn that ended
        try:
            while True:
                done = len(ran)
                try:
                    self._drain(running, ran, lease, retry=failed > 0)
                    return ran
                except Exception as exc:
                    if classify(exc, phase="store") is not Failure.TRANSIENT:
                        raise
                    failed = 1 if len(ran) > done else failed + 1
                    if failed > self.settings.max_attempts:
                        raise
                    # Whatever committed stays committed; replay from a fresh read under a fresh lease.
                    log.warning("draining %s hit a transient fault (%s); trying again", ref, exc)
                    time.sleep(backoff_s(failed - 1, base_s=0.1, cap_s=2.0))
                    lease = None
        finally:
            self._unclaim(running)

    def intake(self, ref: SessionRef, turn_id: str, payload: TurnPayload) -> tuple[Intake, dict[str, TurnResult]]:
        """Record a turn and take the session's lease in one statement (:meth:`SessionQueue.intake`); if the
        lease came with it, drain the session. Returns what the intake found and what ran.

        When another thread of this process works on the session, the turn is only recorded, for that thread."""
        running = self._claim(ref)
        if running is None:
            got = self._record(ref, turn_id, payload)
            return got, self.drain(ref) if got.recorded else {}
        # The turn opens in the intake's own statement when it is the one to run (an unknown agent's is rejected)
        principal = payload.event.principal if payload.event is not None else None
        opening = opening_commit(turn_id, payload, principal) if self.agent(ref.agent) is not None else None
        try:
            got = self.queue.intake(ref, turn_id, payload, self.owner, held=self.transcripts.get(ref), opening=opening)
        except BaseException:
            self._unclaim(running)
            raise
        if got.unusable is not None:  # the lease came with a first turn no worker can run: end it, go on
            rejected = self._reject_unusable(ref, got.unusable)
            return got, {**rejected, **self.drain(ref, running=running)}
        if got.lease is None:
            self._unclaim(running)
            return got, {}
        return got, self.drain(ref, lease=got.lease, running=running)

    def _record(self, ref: SessionRef, turn_id: str, payload: TurnPayload) -> Intake:
        """What :meth:`SessionQueue.intake` does without the lease: record the turn unless it is, or the session is
        parked on another turn (two round trips; only for a session another thread of this process holds)."""
        existing, parked = self.queue.intake_view(ref, turn_id)
        if existing is not None:
            return Intake(existing=existing, parked=parked, recorded=False, lease=None)
        if parked is not None and parked.turn_id != turn_id:
            return Intake(existing=None, parked=parked, recorded=False, lease=None)
        rec, created = self.store.enqueue_turn(ref, turn_id, payload)
        return Intake(existing=None if created else rec, parked=parked, recorded=created, lease=None)

    def _take(self, ref: SessionRef, ran: dict[str, TurnResult]) -> Lease | None:
        """:meth:`SessionQueue.take`, rejecting (under the lease taken) any first turn no worker can run."""
        while True:
            try:
                return self.queue.take(ref, self.owner)
            except UnusableTurnError as exc:
                ran.update(self._reject_unusable(ref, exc))

    def _isolate(self, running: _Running, rec: TurnRecord, fence: int, *, counted: bool) -> None:
        """Hand a turn whose starts died :data:`ISOLATE_AFTER` times to the isolation worker (one turn at a time).

        With many turns in a process, a turn that kills its process (a segfault, the OOM killer) kills the others
        in flight with it, and each is charged an attempt. One death is anybody's: every turn of the process goes on
        in shared processes again. A turn that died twice runs alone from then on: if it is the one killing its
        processes, it kills only itself, and only it reaches the poison cap; one that was only near it twice
        finishes there. The pick's count of this start is taken back (it runs there, not here)."""
        assert self.isolate is not None
        with running.gate:
            handed = self.queue.hand_off(running.ref, fence, rec.turn_id, uncount=counted)
            self._let_go_lease(running)
        if not handed:
            return  # the lease was taken over meanwhile: its new holder runs the turn
        log.warning("turn %s of %s was running in a process that died; it goes on alone, in the isolation worker",
                    rec.turn_id, running.ref)  # fmt: skip
        self.isolate(rec)  # a lost message leaves the turn to the sweeper (it is running, and nobody holds it)

    def _reject_unusable(self, ref: SessionRef, exc: UnusableTurnError) -> dict[str, TurnResult]:
        """End a queued turn a pick found no worker can run (a durable producer's record): rejected under the
        lease the pick took, its ``turn.failed`` published; left queued, every pick would find it again."""
        log.warning("rejecting %s: %s", ref, exc)
        result = reject_turn(self.store, self.sink, ref, exc.turn_id, str(exc), fence=exc.fence)
        return {exc.turn_id: result} if result is not None else {}

    def _drain(self, running: _Running, ran: dict[str, TurnResult], lease: Lease | None, *, retry: bool) -> None:
        ref = running.ref
        try:
            if lease is None:
                lease = self._take(ref, ran)  # the lease and the first turn, one round trip
            if lease is None:
                return  # another worker holds the session; its drain loop will run what we recorded
            fence = lease.fence
            with self._lock:
                running.fence = fence
            # Events a previous holder committed but did not publish. A new session has none, and
            # a stream whose markers already reach the committed count needs no read of the outbox.
            # Redis unreachable is no reason not to run the turn: those events wait in the outbox for the sweeper.
            if lease.event_seq > 0:
                self.sink.catch_up(self.store, ref, lease.event_seq)
            rec, reset_pending, snapshot, counted = lease.turn, lease.reset_pending, lease.snapshot, lease.counted
            opened = lease.opened
            if rec is not None and rec.status == "running" and not retry:
                self.observer.took_over(ref, rec)  # observe: a turn another process left running
                if self.isolate is not None and rec.attempts >= ISOLATE_AFTER:
                    self._isolate(running, rec, fence, counted=counted)
                    return
            while True:
                if reset_pending and (rec is None or rec.cancel_reason is None):
                    # Every turn the reset cancelled has ended: perform it, then run what queued behind it.
                    self.reset_session(ref, fence)
                    reset_pending, rec, snapshot = False, None, None
                if rec is None:
                    # Release only if the queue is empty (and no reset waits), else take the next turn: one statement.
                    try:
                        with running.gate:
                            outcome, rec, reset_pending, counted = self.queue.release_or_next(ref, fence)
                            if outcome != "next":
                                self._let_go_lease(running)
                    except UnusableTurnError as exc:  # the lease is still ours: end that turn, take the next
                        ran.update(self._reject_unusable(ref, exc))
                        continue
                    if outcome != "next":
                        return
                    continue
                ran[rec.turn_id], released = self._run_turn(
                    ref, rec, fence, snapshot=snapshot, release=True, counted=counted, running=running, opened=opened
                )
                if released:
                    return  # the turn's last commit gave the lease up: nothing else was queued
                rec, snapshot, opened = None, None, None  # the next turn reads the session as that one left it
        except LeaseLostError:
            log.warning("lease on %s was taken over; this worker stops working on it", ref)

    # --- expired parks and resets ------------------------------------------------------------------------

    def expire_park(self, ref: SessionRef, parked: SuspendedCheckpoint) -> bool:
        """Answer ``parked`` with a timeout if its expiry (stamped by the database) has passed; the database's
        clock decides, in the commit. True if it did: the turn is queued again to go on without an answer, unless
        the park has requests that expire later (it stays parked on those)."""
        commit = timeout_commit(parked)
        if commit is None:
            return False
        waited = self.park_age(ref)
        try:
            events = self.store.commit(ref, commit)
        except ResumeConflictError:
            return False  # not expired yet, or answered meanwhile
        if waited is not None:
            metrics().input_waited(ref.agent, "timed_out", waited, n=len(parked.due()))
        self.sink.publish(ref, events)
        return True

    def park_age(self, ref: SessionRef) -> float | None:
        """How long the session's park has waited (the database's clock), read before an answer or a timeout is
        applied to it (the commit that ends the park clears its stamp); None if it cannot say. For a metric only:
        a fault here never stops the answer."""
        try:
            return self.store.park_age(ref)
        except Exception:
            log.warning("could not read how long %s has been parked (june_input_wait_seconds misses it)", ref,
                        exc_info=True)  # fmt: skip
            return None

    # --- resets -----------------------------------------------------------------------------------------

    def reset_session(self, ref: SessionRef, fence: int) -> ResetResult:
        """Perform the session's reset under our lease: end its park (cancelled, reason reset), archive the
        history under its generation, start the next one (this also clears ``reset_pending``)."""
        parked = self.store.pending(ref)
        if parked is not None:
            self.sink.publish(ref, self.store.commit(ref, reset_park_commit(parked), fence=fence))
            self.observer.cancelled_by_reset(ref, parked.turn_id)  # observe: that turn ended, cancelled
        self.transcripts.drop(ref)
        result = self.store.reset(ref, fence=fence)
        log.info("reset %s: history archived as %s", ref, result.previous_session)
        return result

    def reset_now(self, ref: SessionRef, dispatch: Callable[[TurnRecord], None]) -> tuple[bool, ResetResult | None]:
        """Perform a pending reset if nobody holds the session (the ``june.reset`` task, the sweeper).

        Ends the turns the reset cancelled (each closes at once, without a model call), performs the
        reset, and hands what queued behind it to a turn worker (``dispatch``): a control process never
        runs a turn's steps. Returns whether we held the session, and the reset if we performed it (None:
        it was performed already). When another process, or another thread of this one, holds the session it
        performs the reset when its running turn ends (:meth:`drain`); nobody waits for it here.
        """
        running = self._claim(ref)
        if running is None:
            return False, None
        try:
            lease = self._take(ref, {})
            if lease is None:
                return False, None
            fence = lease.fence
            with self._lock:
                running.fence = fence
            rec, pending, result, counted = lease.turn, lease.reset_pending, None, lease.counted
            while rec is not None and rec.cancel_reason is not None:
                self._run_turn(ref, rec, fence, counted=counted, running=running)
                (rec, pending), counted = self.queue.next_turn(ref), False
            if pending:
                result = self.reset_session(ref, fence)
            with running.gate:
                released = self.queue.release(ref, fence)
                if not released:  # turns queued behind the reset: a turn worker runs them
                    self.queue.release(ref, fence, force=True)
                self._let_go_lease(running)
            if not released:
                queued, _ = self.queue.next_turn(ref)
                if queued is not None:
                    dispatch(queued)
            return True, result
        except LeaseLostError:
            return True, None
        finally:
            self._unclaim(running)

    def run_turn(self, ref: SessionRef, rec: TurnRecord, fence: int) -> TurnResult:
        """Run one turn under the lease fenced by ``fence`` (the caller holds it), then deliver it if it has a target."""
        return self._run_turn(ref, rec, fence, running=_Running(ref=ref, fence=fence))[0]

    def _run_turn(
        self,
        ref: SessionRef,
        rec: TurnRecord,
        fence: int,
        *,
        running: _Running,
        snapshot: SessionSnapshot | None = None,
        release: bool = False,
        counted: bool = False,
        opened: Commit | None = None,
    ) -> tuple[TurnResult, bool]:
        """:meth:`run_turn`, on ``snapshot`` if the session was read with the lease; with ``release``, the turn's
        last commit also gives the lease up if nothing else is queued (not for a turn with a delivery target: it
        is delivered under the lease). Returns whether it did. ``counted``: the statement that picked ``rec``
        counted this start of it (:class:`~june_worker.engine.loop.TurnRunner`'s ``counted``); ``opened``: the
        intake opened it on ``snapshot`` (:attr:`Lease.opened`)."""
        agent = self.agent(ref.agent)
        if agent is None:
            rejected = reject_turn(self.store, self.sink, ref, rec.turn_id, f"unknown agent {ref.agent!r}", fence=fence)
            assert rejected is not None  # an unfinished turn is always rejected here
            self.observer.rejected(ref, rec.turn_id)
            return rejected, False
        with self._lock:
            cancel = _Cancel(self.loop, rec.cancel_reason or running.signalled.get(rec.turn_id))
            running.turn_id = rec.turn_id
            running.cancel = cancel
        if snapshot is None:  # the session as the last turn left it: only the messages this process does not hold
            snapshot, _ = self.queue.read(ref, held=self.transcripts.get(ref))
        target = rec.payload.target
        # A turn with a target keeps the lease while it is delivered; its ending marks the delivery due.
        ending = _Ending(self, running, rec.turn_id, release=release and target is None, deliver_due=target is not None)
        live = rendering.start_live(agent, self.store, ref, rec) if target is not None else None
        turn_thread = TurnThread(self.loop, self.lanes) if self.inflight else None
        turn_sink = self._turn_sinks[turn_thread.lane if turn_thread is not None else 0]
        sink: EventSink = live.tee(turn_sink) if live is not None else turn_sink
        try:
            with self.observer.run(agent, ref, rec) as watch:  # observe: the turn's span, metrics and logs
                hooks: TurnHooks = watch
                if turn_thread is not None:
                    sink = QueuedSink(sink, turn_thread)
                    if self.watch is not None:
                        hooks = WatchedHooks(watch, self.watch, rec.turn_id, ref)
                runner = TurnRunner(
                    agent,
                    ending,
                    sink,
                    ref,
                    rec,
                    fence=fence,
                    cancel=cancel,
                    crash=self.crash,
                    snapshot=snapshot,
                    max_attempts=self.settings.max_attempts,
                    hooks=hooks,
                    children=self,
                    counted=counted,
                    opened=opened,
                    blocking=turn_thread.blocking if turn_thread is not None else inline,
                    statements=turn_thread.statement if turn_thread is not None else inline,
                )
                if turn_thread is not None:
                    result = turn_thread.run(runner.run())
                else:
                    result = self.loop.run_until_complete(runner.run())
                watch.finished(result)
            turn_sink.flush()  # the turn's events are in Redis (or relayed) before anyone hears it ended
        except BaseException:
            self.transcripts.drop(ref)
            raise
        finally:
            if live is not None:
                live.close()  # what the channel was shown live, before the delivery converges it
        if runner.generation is not None:  # what the turn read and committed: the next one reads what is after it
            self.transcripts.put(ref, runner.generation, runner.messages)
        if target is not None and result.status != "rejected":
            if ending.ended:
                self.deliver(ref, rec, agent, result)
            else:  # its ending commit was not one _Ending could mark (not a plain Commit): once, best effort
                self._deliver_once(ref, rec, agent, result)
        if self.after_turn is not None and (
            rec.payload.parent is not None or result.status in ("suspended", "cancelled", "failed", "rejected")
        ):
            self.after_turn(self, ref, rec, result, self.send_turn)  # answer a parent, wake on a child, cancel children
        return result, bool(ending.released)

    # --- delivery to a turn's target ------------------------------------------------------------------

    def deliver(self, ref: SessionRef, rec: TurnRecord, agent: Agent, result: TurnResult) -> bool:
        """Run the agent's ``deliver`` hook for a turn whose delivery is due, then clear the mark.

        At least once: a crash before the mark is cleared leaves it for the sweeper, which sends
        the turn again, and its intake delivers it. A hook that raises is tried again at the next
        sweep, up to ``JUNE_DELIVERY_ATTEMPTS`` attempts in all, then given up (logged). Returns
        whether the hook ran to its end here.
        """
        with self._lock:
            holder = self._running.get(ref)
            if holder is not None and holder.draining and holder.thread != threading.get_ident():
                return False  # another thread of this process runs the session: the delivery is its (same owner)
        attempt = self.queue.claim_delivery(ref, rec.turn_id, self.owner)
        if attempt is None:
            return False  # not due (delivered already, or given up), or the lease holder's to deliver
        if self.crash is not None:
            self.crash("before-deliver", rec.turn_id)
        if self._deliver_once(ref, rec, agent, result):
            self.queue.delivery_done(ref, rec.turn_id)
            return True
        if attempt >= self.settings.delivery_attempts:
            self.queue.delivery_done(ref, rec.turn_id)
            log.error("gave up delivering turn %s of %s after %d attempts", rec.turn_id, ref, attempt)
        return False

    def _deliver_once(self, ref: SessionRef, rec: TurnRecord, agent: Agent, result: TurnResult) -> bool:
        target = rec.payload.target
        if target is None:
            return False
        try:
            return rendering.deliver_once(agent, self.store, ref, rec, result, self.run_async)
        except Exception:
            log.exception("delivering turn %s of %s to %s failed", rec.turn_id, ref, target)
            return False

    def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a short coroutine of a task's own (a deliver or authorize hook) on this process's loop; wait for it."""
        if self._loop_thread is not None:
            return self._loop_thread.run(coro)
        return self.loop.run_until_complete(coro)

    # --- background threads -----------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Say this process is alive (often), renew the held leases and re-check their turns' cancels (less often).

        One statement each, whatever the number of turns in flight; on a connection of its own when there are many.
        """
        tick = max(self.settings.alive_s / 3, 0.05)
        lease_every = max(self.settings.lease_s / 3, tick)
        next_lease = time.monotonic() + lease_every
        while not self._stop.wait(tick):
            try:
                # with it, the relay marks of what our publishes put in the streams: the sweeper skips those sessions
                self._beats.beat(self.owner, self.settings.alive_s, relayed=self._relayed())
            except Exception:  # the marks are lost with it: the sweeper reads those streams' markers instead
                log.warning("liveness heartbeat of %s failed; will retry", self.owner, exc_info=True)
            if time.monotonic() < next_lease:
                continue
            next_lease = time.monotonic() + lease_every
            with self._lock:
                held = [r for r in self._running.values() if r.fence is not None and r.draining]
            if not held:
                continue
            try:
                kept = self._beats.renew_all([(r.ref, r.fence) for r in held if r.fence is not None])
                for r in held:
                    if r.ref not in kept and r.cancel is not None:
                        r.cancel.set("requested")  # the lease is gone; the next commit is fenced off
                asked = [(r.ref, r.turn_id) for r in held if r.ref in kept and r.turn_id and r.cancel is not None]
                reasons = self._beats.cancel_reasons(asked)
                for r in held:
                    reason = reasons.get((r.ref, r.turn_id or ""))
                    if reason is not None and r.cancel is not None:
                        r.cancel.set(reason)
            except Exception:
                log.warning("lease heartbeat of %d session(s) failed; will retry", len(held), exc_info=True)

    def _relayed(self) -> dict[SessionRef, int]:
        """What this process's sinks saw the streams hold, by session, since the last call."""
        marks = self.sink.take_relayed()
        for sink in self._turn_sinks:
            for ref, seq in sink.take_relayed().items():
                marks[ref] = max(seq, marks.get(ref, 0))
        return marks

    def _listen(self) -> None:
        """Cancel signals published on the session control channels (the fast path; Postgres is the record).

        On a Redis Cluster a PUBLISH reaches every node (the cluster bus carries it), so one pattern
        subscription on any node hears every session's channel, as on one Redis."""
        pattern = f"{self.keys.prefix}:control:*"
        while not self._stop.is_set():
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.psubscribe(pattern)
                pubsub.get_message(timeout=1.0, ignore_subscribe_messages=False)  # the subscription is in place
                self._listening.set()
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._on_control(message["channel"], message["data"])
            except Exception:
                log.warning("control channel listener lost its connection; reconnecting", exc_info=True)
                self._stop.wait(1.0)

    def _on_control(self, channel: bytes | str, data: bytes | str) -> None:
        import json

        try:
            signal = json.loads(data)
        except ValueError:
            return
        if not isinstance(signal, dict) or not isinstance(signal.get("turn_ids"), list):
            return
        reason = str(signal.get("reason", "requested"))
        agent, session = signal.get("agent"), signal.get("session")
        if not isinstance(agent, str) or not isinstance(session, str):
            return
        with self._lock:
            running = self._running.get(SessionRef(agent, session))
            if running is None:
                return
            for turn_id in signal["turn_ids"]:
                running.signalled.setdefault(str(turn_id), reason)  # a turn not started yet sees it when it starts
            cancel = running.cancel if running.turn_id in signal["turn_ids"] else None
        if cancel is not None:
            cancel.set(reason)

    def signal_cancel(self, ref: SessionRef, turn_ids: list[str], reason: str) -> None:
        """Tell whichever worker runs the session to stop at its next checkpoint boundary."""
        import json

        payload = json.dumps({"agent": ref.agent, "session": ref.session, "turn_ids": turn_ids, "reason": reason})
        try:
            self.redis.publish(self.keys.control_channel(ref), payload)
        except redis.RedisError:
            log.warning("could not publish a cancel signal for %s; the heartbeat will see it", ref)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        if self.watch is not None:
            self.watch.close()
        if self.lanes is not None:
            self.lanes.close()  # (after the turns: their last calls are done)
        for sink in self._turn_sinks:
            sink.close()
        self.store.close()
        if self._beats is not self.queue:
            self._beats.pool.close()
        self.redis.close()
        if self._loop_thread is not None:
            self._loop_thread.close()
        else:
            self.loop.close()

    def _blocked_loop(self, seconds: float, culprit: str) -> None:
        metrics().loop_blocked(seconds)
