"""A runner that lost the race for a turn: the outcome it reports is the winner's.

Two in-process runtimes on one database take no lease, so both may run one turn; the store's unique
transcript index lets one commit of each step land and refuses the other
(:class:`~june_worker.errors.MessageIndexTakenError`, the failure policy's ``lost_race``). The loser
writes nothing more: it waits here for the turn to end (or park) and reports that, read from the store.

The rule a reader must not break: **a runner that lost a race never writes an ending over the turn**; if
the turn stops moving (no event for ``stall_s``: its runner died), the loser runs it on from what the
store holds, as any replay does, and never from what it had in memory.
"""

from __future__ import annotations

import asyncio
import functools

from .blocking import Blocking, inline
from .events import TurnResult
from .store import UNFINISHED_TURN_STATUSES, SessionRef, SessionStore

__all__ = ["winners_outcome"]

_FIRST_POLL_S = 0.02
_MAX_POLL_S = 1.0


async def winners_outcome(
    store: SessionStore, ref: SessionRef, turn_id: str, *, stall_s: float, blocking: Blocking = inline
) -> TurnResult | None:
    """The turn's stored result once it has one (it ended, or parked); None when no event of the turn was
    committed for ``stall_s`` while it stayed unfinished (or when it is gone: the caller reads the store again).
    ``blocking`` runs the store's reads (:mod:`.blocking`)."""
    loop = asyncio.get_running_loop()
    seen = await blocking(lambda: store.events(ref, turn_id=turn_id))
    seq = (seen[-1].seq or 0) if seen else 0
    moved_at = loop.time()
    wait = _FIRST_POLL_S
    while True:
        rec = await blocking(lambda: store.get_turn(ref, turn_id))
        if rec is None:
            return None
        if rec.status not in UNFINISHED_TURN_STATUSES and rec.result is not None:
            return rec.result
        news = await blocking(functools.partial(store.events, ref, turn_id=turn_id, after_seq=seq))
        if news:
            seq, moved_at = news[-1].seq or seq, loop.time()
        elif loop.time() - moved_at >= stall_s:
            return None
        await asyncio.sleep(wait)
        wait = min(wait * 2, _MAX_POLL_S)
