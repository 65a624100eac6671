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
  Only sessions nobody holds, so it never races a holder.

Recovery time is therefore bounded by the liveness window (3 s by default; never more than
the lease length) plus one sweep period.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis

from ..engine.store import TurnRecord
from .children import wake_parents
from .host import WorkerHost
from .retention import prune

__all__ = ["sweep"]

log = logging.getLogger("june_worker.sweeper")


def sweep(host: WorkerHost, dispatch: Callable[[TurnRecord], None], *, limit: int = 500) -> dict[str, Any]:
    period = host.settings.sweep_s
    expired = 0
    for ref in host.queue.expired_parks(limit=limit):
        parked = host.store.pending(ref)
        if parked is None or not host.expire_park(ref, parked):
            continue  # answered meanwhile
        expired += 1
        rec = host.store.get_turn(ref, parked.turn_id)
        if rec is not None and rec.status == "queued":  # else requests that expire later keep it parked
            dispatch(rec)
    woken = wake_parents(host, dispatch, limit=limit)  # parents of child turns whose worker died before answering
    resets = 0
    for ref in host.queue.pending_resets(limit=limit):  # their holder died, or a reset found them busy
        held, _ = host.reset_now(ref, dispatch)
        resets += held
    redispatched = 0
    # A turn just recorded is given one sweep period to be picked up normally before we step in.
    for stranded in host.queue.stranded(grace_s=max(period, 1.0), limit=limit):
        dispatch(stranded.turn)
        redispatched += 1
    # A turn whose delivery to its target stayed due (its worker died before it, or the hook failed)
    # goes out again; its intake delivers it.
    for turn in host.queue.undelivered(grace_s=max(period, 1.0), limit=limit):
        dispatch(turn)
        redispatched += 1
    relayed = _relay(host, limit=limit)
    pruned = prune(host.store.pool, host.sink, host.settings)
    host.queue.forget_dead_workers(older_than_s=24 * 3600)
    if woken:
        log.info("sweep: %d parents answered by their ended child turns", woken)
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
        "relayed": relayed,
        "pruned": {"events": pruned.events, "turns": pruned.turns, "archived": pruned.archived},
    }


def _relay(host: WorkerHost, *, limit: int) -> int:
    """Bring every stream nobody is publishing to up to its outbox, however long ago its session was active.

    The candidates are the sessions whose ``relayed_seq`` mark is behind their ``event_seq`` (an
    index; a holder marks what its own publishes put in the streams with its heartbeat, so these are
    mostly sessions that really are behind); a stream found complete, or made so, moves the mark. They
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
