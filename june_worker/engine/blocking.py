"""Where a turn's blocking calls run: the seam between the engine's coroutines and its synchronous store.

The engine is asyncio; its store, a sync tool and a child's launch are blocking calls. A host
that runs one turn per event loop (the in-process runtime, a prefork worker process) runs them
right where the coroutine is (:func:`inline`): nothing else waits on that loop. A host that runs
many turns on one loop hands them to a thread of the turn's own, so that no turn's statement, and
no sync tool holding its step's transaction, holds up the others (``june_worker.worker.inflight``);
there a ready commit (one statement, no tool code in it) goes to one of a few threads shared by all
turns instead (the runner's ``statements``), since waking a thread per turn for each costs more.

The one rule a reader must not break: **a blocking call runs to its end once started**, whatever
happens to the coroutine that asked for it; the engine mirrors a commit in memory only after it
returned, so a cancelled waiter must still see it through (:func:`finish`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

__all__ = ["Blocking", "finish", "inline"]

T = TypeVar("T")


class Blocking(Protocol):
    """Runs ``fn`` (a blocking call of one turn) and returns what it returned, or raises what it raised.

    Calls of one turn run one at a time, in the order they were asked for."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...


async def inline(fn: Callable[[], T], /) -> T:
    """Run ``fn`` on the caller's thread, now: for a loop that runs one turn."""
    return fn()


async def finish(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if the awaiting task is cancelled meanwhile; the cancel is delivered after.

    For a commit and its mirror in memory: a batch of tool calls cancelled while one of them commits must not
    leave the commit landed and the runner unaware of it.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True  # the work goes on: wait for it, then let the cancel through
    if cancelled:
        raise asyncio.CancelledError
    return result
