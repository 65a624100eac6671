"""Reading a session's events from a producer: the stream's name, its newest id, and sync and async follows.

The follow itself (position, filters, gaps) is :mod:`june_wire.follow`, the one the workers' reader
drives too; here it yields the entries as decoded (:class:`~producers.FollowedEvent`), and a gap is a
:class:`~producers.errors.StreamGapError` that says to reload from the gateway's log route.

The rule a reader must not break: **resume from the last ``stream_id`` you handled**, never from a
``seq`` (see :mod:`june_wire.events`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Generator

from june_wire.events import FollowedEvent
from june_wire.follow import FollowState, follow_async, follow_sync, pin_last_id, safe_block_ms, same_event
from june_wire.keys import EventKeys, SessionRef
from june_wire.redis_url import RedisClient, aconnect

from . import _checks as check
from .errors import StreamGapError

__all__ = ["EventReader"]


class EventReader:
    """A producer's reads of session streams: one sync client, and one async client per :meth:`afollow`."""

    def __init__(
        self, redis: RedisClient, redis_url: str, keys: EventKeys, *, socket_timeout_s: float, connect_timeout_s: float
    ) -> None:
        self.redis = redis
        self.redis_url = redis_url
        self.keys = keys
        self.socket_timeout_s = socket_timeout_s
        self.connect_timeout_s = connect_timeout_s

    def stream_key(self, agent: str, session: str) -> str:
        return self.keys.session_stream(SessionRef(check.agent(agent), check.session(session)))

    def last_stream_id(self, agent: str, session: str) -> str:
        return pin_last_id(self.redis.xrevrange(self.stream_key(agent, session), count=1))

    def state(
        self,
        agent: str,
        session: str,
        turn_id: str | None,
        last_id: str,
        timeout_s: float | None,
        block_ms: int,
        include_deltas: bool,
        last_seq: int | None,
    ) -> FollowState[FollowedEvent]:
        """One follow's state, every argument checked (see :meth:`producers.JuneProducer.follow`)."""
        last_id = check.stream_id(last_id)
        return FollowState(
            self.stream_key(agent, session),
            adopt=same_event,
            turn_id=check.turn_id(turn_id) if turn_id is not None else None,
            last_id=last_id,
            block_ms=safe_block_ms(self.socket_timeout_s, block_ms),
            timeout_s=timeout_s,
            include_deltas=include_deltas,
            last_seq=last_seq,
            reload=f"the store (the gateway's GET /v1/agents/{agent}/sessions/{session}/log)",
            gap_error=StreamGapError,
        )

    def follow(self, state: FollowState[FollowedEvent], count: int) -> Generator[FollowedEvent, None, None]:
        """Drive ``state`` on this reader's client; ``"$"`` is pinned now, before iterating."""
        if state.last_id == "$":
            state.last_id = pin_last_id(self.redis.xrevrange(state.stream, count=1))
        return follow_sync(self.redis, state, count)

    async def afollow(self, state: FollowState[FollowedEvent], count: int) -> AsyncGenerator[FollowedEvent, None]:
        """Drive ``state`` on a ``redis.asyncio`` connection of its own, closed when the iteration ends."""
        client = aconnect(
            self.redis_url,
            decode_responses=True,
            socket_timeout=self.socket_timeout_s,
            socket_connect_timeout=self.connect_timeout_s,
        )
        try:
            async with contextlib.aclosing(follow_async(client, state, count)) as events:
                async for event in events:
                    yield event
        finally:
            await client.aclose()
