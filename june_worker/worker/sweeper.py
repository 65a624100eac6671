"""The sweeper (``june.sweep``, run by Celery beat every ``JUNE_SWEEP_S``): recovery that needs nobody's message.

It finds, in Postgres:

* sessions with a queued or running turn and no live lease: a worker died (its liveness
  heartbeat lapsed, ``JUNE_ALIVE_S``, or its lease expired) or the turn's message was lost
  (Redis restarted). It re-sends ``june.turn`` for the session's first unfinished turn;
  intake is idempotent, so a duplicate is harmless;
* parks whose ``timeout_s`` passed: it answers them with a timeout and re-sends the turn;
* resets left pending by a holder that died: it performs them;
* parents parked on a child turn (``ctx.delegate``) that ended while its worker died before answering:
  it answers them with the child's result (:mod:`.children`);
* sessions whose stream may miss events (a worker died between commit and publish, Redis was
  unreachable when they were published), however long ago: it relays them from the outbox.
  Only sessions nobody holds, so it never races a holder;
* streams Redis lost with its data (a restart without persistence, a failover, a flush), also
  those of sessions whose turns all finished, which nothing would publish to again: an epoch key
  gone or written by another run of its server tells it (one read per sweep,
  :mod:`~june_worker.events.losses`), and it then refills from the outbox every stream behind it,
  held sessions' too, a page of sessions at a time, all in that sweep.

Recovery time is therefore bounded by the liveness window (3 s by default; never more than
the lease length) plus one sweep period.

The rule a reader must not break: **one bad row or one failing step never stops the sweep**.
A queued turn whose stored record no worker can use (a durable producer records from outside
the workers) is rejected, its stream ended, instead of re-sent forever or raising; a step that
fails is logged and the steps after it still run (the store being unavailable is the exception:
the task is retried, whole).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError

from june_wire.storable import storable_text

from ..engine.endings import reject_turn
from ..engine.secrets import scrubbed_logger
from ..engine.store import TurnPayload, TurnRecord
from ..errors import StoreUnavailableError
from ..events import losses
from .children import wake_parents
from .host import WorkerHost
from .queue import Stranded
from .retention import Pruned, prune

__all__ = ["sweep"]

log = scrubbed_logger("june_worker.sweeper")
T = TypeVar("T")


def sweep(host: WorkerHost, dispatch: Callable[[TurnRecord], None], *, limit: int = 500) -> dict[str, Any]:
    # A turn just recorded is given one sweep period to be picked up normally before we step in.
    grace = max(host.settings.sweep_s, 1.0)
    expired = _step("expiring parks", lambda: _expire_parks(host, dispatch, limit=limit), 0)
    # parents of child turns whose worker died before answering
    woken = _step("waking parents", lambda: wake_parents(host, dispatch, limit=limit), 0)
    resets = _step("performing resets", lambda: _perform_resets(host, dispatch, limit=limit), 0)
    stranded = _step("re-sending stranded turns", lambda: _resend_stranded(host, dispatch, grace, limit), (0, 0))
    redispatched, rejected = stranded
    # A turn whose delivery to its target stayed due (its worker died before it, or the hook failed)
    # goes out again; its intake delivers it.
    redispatched += _step("re-sending undelivered turns", lambda: _resend_undelivered(host, dispatch, grace, limit), 0)
    relayed = _step("relaying", lambda: _relay(host, limit=limit), 0)
    # after the relay: the streams it fills (and marks), the pass after a loss finds complete
    rebuilt = _step("rebuilding streams Redis lost", lambda: _rebuild(host, limit=limit), 0)
    pruned = _step("pruning", lambda: prune(host.store.pool, host.sink, host.settings), Pruned())
    _step("forgetting dead workers", lambda: host.queue.forget_dead_workers(older_than_s=24 * 3600), 0)
    if rejected:
        log.warning("sweep: %d queued turns rejected: their stored records cannot be used", rejected)
    if woken:
        log.info("sweep: %d parents answered by their ended child turns", woken)
    if rebuilt:
        log.info("sweep: %d events put back on streams Redis had lost", rebuilt)
    if redispatched or expired or relayed or resets:
        log.info(
            "sweep: %d turns re-sent, %d parks expired, %d resets performed, %d events relayed",
            redispatched,
            expired,
            resets,
            relayed,
        )
    return {
        "status": "swept",
        "redispatched": redispatched,
        "expired_parks": expired,
        "resets": resets,
        "woken_parents": woken,
        "rejected": rejected,
        "relayed": relayed,
        "rebuilt": rebuilt,
        "pruned": {"events": pruned.events, "turns": pruned.turns, "archived": pruned.archived},
    }


def _step(name: str, run: Callable[[], T], nothing: T) -> T:
    """One step of the sweep: its result, or ``nothing`` when it failed (logged), so that the steps after it run.

    The store being unavailable is not caught: every step needs it, and the task is retried (failure policy)."""
    try:
        return run()
    except StoreUnavailableError:
        raise
    except Exception:
        log.exception("sweep: %s failed; the other steps go on, the next sweep tries again", name)
        return nothing


def _expire_parks(host: WorkerHost, dispatch: Callable[[TurnRecord], None], *, limit: int) -> int:
    expired = 0
    for ref in host.queue.expired_parks(limit=limit):
        parked = host.store.pending(ref)
        if parked is None or not host.expire_park(ref, parked):
            continue  # answered meanwhile
        expired += 1
        rec = host.store.get_turn(ref, parked.turn_id)
        if rec is not None and rec.status == "queued":  # else requests that expire later keep it parked
            dispatch(rec)
    return expired


def _perform_resets(host: WorkerHost, dispatch: Callable[[TurnRecord], None], *, limit: int) -> int:
    resets = 0
    for ref in host.queue.pending_resets(limit=limit):  # their holder died, or a reset found them busy
        held, _ = host.reset_now(ref, dispatch)
        resets += held
    return resets


def _resend_stranded(
    host: WorkerHost, dispatch: Callable[[TurnRecord], None], grace_s: float, limit: int
) -> tuple[int, int]:
    """Re-send each stranded session's first turn; reject one whose record no worker can use. (sent, rejected)"""
    sent = rejected = 0
    for stranded in host.queue.stranded(grace_s=grace_s, limit=limit):
        if stranded.unusable is None and stranded.turn is not None:
            dispatch(stranded.turn)
            sent += 1
            continue
        reason = stranded.unusable or "its stored record cannot be read"
        try:  # re-sent, it would be refused by every worker, or fail every sweep: end it instead
            rejected += _reject_unusable(host, stranded, reason)
        except StoreUnavailableError:
            raise
        except Exception:  # this row only: the others are re-sent all the same
            log.exception("sweep: could not reject turn %s of %s (%s)", stranded.turn_id, stranded.ref, reason)
    return sent, rejected


def _reject_unusable(host: WorkerHost, stranded: Stranded, reason: str) -> int:
    """End a queued turn whose stored record no worker can use: rejected, its ``turn.failed`` published."""
    why = f"turn {stranded.turn_id} cannot be run: {reason}"
    text = stranded.turn.payload.text[:1000] if stranded.turn is not None else ""
    result = reject_turn(
        host.store, host.sink, stranded.ref, stranded.turn_id, why, payload=TurnPayload(text=storable_text(text))
    )
    log.warning("sweep: rejected turn %s of %s: %s", stranded.turn_id, stranded.ref, reason)
    return int(result is not None and result.status == "rejected")


def _resend_undelivered(host: WorkerHost, dispatch: Callable[[TurnRecord], None], grace_s: float, limit: int) -> int:
    sent = 0
    for turn in host.queue.undelivered(grace_s=grace_s, limit=limit):
        dispatch(turn)
        sent += 1
    return sent


_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError, RedisClusterException)
"""Redis errors that end a rebuild pass for this sweep (the next one goes on from its last page)."""


def _rebuild(host: WorkerHost, *, limit: int) -> int:
    """After Redis lost its data, refill every session's stream from what the outbox still holds; the events
    appended.

    Nothing to do (one read of the epoch keys) unless a key is gone or stale, or a pass is unfinished. A pass reads
    the outbox's sessions a page of ``limit`` at a time, in key order, held ones too (an append is idempotent,
    and a holder that published everything before the loss may never publish again), reads their markers in
    one round trip and relays those behind; after each page it records how far it got. A session whose relay
    fails for its own reason is left to its next publish; Redis going away ends the pass until the next sweep.
    """
    try:
        rebuild = losses.pending_pass(host.redis, host.keys)
    except _REDIS_DOWN:
        log.warning("cannot read the epoch keys; the next sweep looks again", exc_info=True)
        return 0
    if rebuild is None:
        return 0
    if rebuild.began:
        log.warning(
            "Redis may have lost data (an epoch key is gone, or its server restarted): refilling every stream the "
            "outbox can fill"
        )
    appended, after = 0, rebuild.after
    try:
        while True:
            page = host.queue.outbox_sessions(limit=limit, after=after)
            reached = host.sink.relayed_seqs([ref for ref, _ in page]) if page else []
            for (ref, committed), seen in zip(page, reached, strict=True):
                if seen >= committed:
                    continue
                try:
                    appended += host.sink.relay(host.store, ref)
                except (StoreUnavailableError, *_REDIS_DOWN):
                    raise
                except Exception:
                    log.exception("rebuilding the stream of %s failed; its next publish refills it", ref)
            if len(page) < limit:
                if losses.finish_pass(host.redis, host.keys, rebuild):
                    log.info("rebuilt the streams Redis lost: %d events put back", appended)
                return appended
            after = page[-1][0]
            if not losses.move_pass(host.redis, host.keys, rebuild, after):
                return appended  # Redis lost its data again meanwhile: a new pass began, and goes on
    except _REDIS_DOWN:
        log.warning("Redis failed during the rebuild of its streams; the next sweep goes on", exc_info=True)
        return appended


def _relay(host: WorkerHost, *, limit: int) -> int:
    """Bring every stream nobody is publishing to up to its outbox, however long ago its session was active.

    The candidates are the sessions whose ``relayed_seq`` mark may be behind their ``event_seq``
    (``relay_due``, a partial index; a holder marks what its own publishes put in the streams with
    its heartbeat, so these are mostly sessions that really are behind); a stream found complete, or
    made so, moves the mark and clears the flag. They
    are read a page of ``limit`` at a time, in key order, until a page comes back short: every such
    session is reached in one sweep, however many there are. While Redis is unreachable the marks stay
    behind, and a later sweep finishes the work.
    """
    relayed = 0
    after = None
    while True:
        candidates = host.queue.unrelayed(limit=limit, after=after)
        if not candidates:
            return relayed
        try:
            reached = host.sink.relayed_seqs([ref for ref, _ in candidates])
        except Exception:
            log.warning("cannot read the stream markers; the next sweep relays", exc_info=True)
            return relayed
        marks, failed = [], False
        for (ref, committed), seen in zip(candidates, reached, strict=True):
            if seen < committed:
                try:
                    relayed += host.sink.relay(host.store, ref)
                    seen = host.sink.relayed_seq(ref)
                except Exception as exc:
                    log.warning("relay of %s failed; the next sweep tries again", ref, exc_info=True)
                    failed = failed or isinstance(exc, redis.ConnectionError | redis.TimeoutError)
                    continue
            marks.append((ref, min(seen, committed)))
        host.queue.mark_relayed(marks)
        if failed or len(candidates) < limit:  # (Redis unreachable: the next sweep goes on, not this one)
            return relayed
        after = candidates[-1][0]
