"""What the gateway talks to: the producer (Celery tasks by name), Redis (streams) and Postgres (reads).

The gateway never runs a turn and never writes the store. It sends ``june.*`` tasks through
:class:`producers.JuneProducer` (blocking calls, run in worker threads), reads event streams
with ``redis.asyncio``, and reads sessions, turns and pending input from Postgres through
:class:`~june_worker.stores.postgres.PostgresStore` (blocking, in threads too).

One key of its own: ``<prefix>:gateway:sent:{<agent>:<session>}``, a set of the turn ids this
gateway sent in the last day. A turn sits in the broker until a worker records it in Postgres;
the set lets a client follow a turn (or its new session) the moment the POST returned,
instead of getting a 404 until a worker is free. And one table of its own,
``june_gateway_sessions`` (:mod:`.owners`): who opened each session, for :mod:`.access`.

The rule a reader must not break: **nothing here blocks the event loop**; every psycopg and
Celery call goes through :meth:`GatewayBackend.blocking` (a read of Postgres through :meth:`GatewayBackend.read`,
which outlives a Postgres restart: the pool holds connections that died idle, and no request may pay for them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import psycopg
import redis.asyncio as aioredis
from psycopg_pool import ConnectionPool, PoolTimeout

from june_wire.keys import EventKeys
from june_wire.redis_url import AsyncRedisClient, aconnect, is_cluster_url
from producers import JuneProducer, ResetOutcome, ResumeOutcome

from ..engine.children import child_session_id, child_turn_id
from ..engine.secrets import scrubbed_logger
from ..engine.store import SessionRef, SuspendedCheckpoint, TurnRecord
from ..errors import StoreUnavailableError
from ..stores.postgres import PostgresStore
from .access import SessionState
from .owners import SessionOwners
from .settings import GatewaySettings
from .sse import StreamStats

__all__ = ["GatewayBackend", "SENT_TTL_S"]

log = scrubbed_logger("june_worker.gateway")

T = TypeVar("T")
SENT_TTL_S = 86_400
_MAX_ANCESTORS = 8
"""How far up a child session's parents :meth:`GatewayBackend._parent_owner` looks for an owner."""

_CHILD_LINK = """
select turn_id, payload->'parent'->>'agent', payload->'parent'->>'session', payload->'parent'->>'turn_id',
       payload->'parent'->>'call_id'
  from june_turns
 where agent = %(agent)s and session = %(session)s and payload->>'parent' is not null
 order by position
 limit 1
"""
"""A child session's link to its parent: on its first turn (every turn of a child session has the same one)."""

_PARK_IN_THE_WAY = """
select suspended::text, park_expires_at
  from june_sessions
 where agent = %(agent)s and session = %(session)s and suspended is not null and not reset_pending
"""
"""The park a new turn is refused for: none while a reset is pending (it ends the park; the turn queues behind: S90)."""


_DROPPED_SQLSTATES = frozenset({"57P01", "57P02", "57P03"})
"""The server ended the connection: admin_shutdown (a restart, ``pg_terminate_backend``), crash_shutdown, and
cannot_connect_now (it is starting)."""


def _dropped(exc: BaseException) -> bool:
    """Whether a read failed because its pooled connection was dead (Postgres restarted, or dropped it), not because
    of the statement or because no connection could be had at all (a :class:`PoolTimeout`: Postgres is down)."""
    if isinstance(exc, StoreUnavailableError):  # the store's own wrapping of a connection fault
        exc = exc.__cause__ if exc.__cause__ is not None else exc
    if isinstance(exc, PoolTimeout) or not isinstance(exc, psycopg.Error):
        return False
    if isinstance(exc, psycopg.InterfaceError):
        return True
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError)  # raised by the client: the connection failed
    return state.startswith("08") or state in _DROPPED_SQLSTATES


class GatewayBackend:
    """The gateway's clients, made in :meth:`start` (the app's lifespan) and closed in :meth:`close`."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.keys = EventKeys(prefix=settings.key_prefix, firehose_partitions=settings.firehose_partitions)
        self.stats = StreamStats()
        self._control = anyio.CapacityLimiter(32)
        self._pool: ConnectionPool[Any] | None = None
        self._store: PostgresStore | None = None
        self._owners: SessionOwners | None = None
        self._producer: JuneProducer | None = None
        self._redis: AsyncRedisClient | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        options: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": s.heartbeat_s + 10,
            "socket_connect_timeout": 5,
            "health_check_interval": 30,
        }
        if is_cluster_url(s.redis_url):
            # a cluster client keeps a pool per node; a stream's reader waits on the node of its session's slot
            self._redis = aconnect(s.redis_url, max_connections=s.redis_connections, **options)
        else:
            pool = aioredis.BlockingConnectionPool.from_url(
                s.redis_url, max_connections=s.redis_connections, timeout=10, **options
            )
            self._redis = aioredis.Redis(connection_pool=pool)
        # Opened without waiting: the gateway starts (and /healthz says 503) while Postgres is down.
        self._pool = ConnectionPool(
            s.database_url, min_size=1, max_size=8, kwargs={"autocommit": True}, timeout=5, open=False,
            name="june-gateway",
        )  # fmt: skip
        self._pool.open(wait=False)
        self._store = PostgresStore(self._pool, migrate=False)
        self._owners = SessionOwners(self._pool)
        self._producer = await self.blocking(
            functools.partial(
                JuneProducer,
                s.redis_url,
                broker_url=s.broker_url,
                result_backend=s.result_backend,
                queue=s.queue,
                control_queue=s.control_queue,
                key_prefix=s.key_prefix,
                broker_queue_type=s.broker_queue_type,
                publish_timeout_s=s.publish_timeout_s,
                publish_retries=s.publish_retries,
            )
        )

    async def close(self) -> None:
        if self._producer is not None:
            await self.blocking(self._producer.close)
        if self._pool is not None:
            await self.blocking(self._pool.close)
        if self._redis is not None:
            await self._redis.aclose()

    @property
    def redis(self) -> AsyncRedisClient:
        assert self._redis is not None, "the gateway backend is not started"
        return self._redis

    @property
    def store(self) -> PostgresStore:
        assert self._store is not None, "the gateway backend is not started"
        return self._store

    @property
    def owners(self) -> SessionOwners:
        assert self._owners is not None, "the gateway backend is not started"
        return self._owners

    @property
    def producer(self) -> JuneProducer:
        assert self._producer is not None, "the gateway backend is not started"
        return self._producer

    async def blocking(self, fn: Callable[[], T], *, control: bool = False) -> T:
        """Run a blocking call in a worker thread; control calls (which wait on a worker) have their own limit."""
        return await anyio.to_thread.run_sync(fn, limiter=self._control if control else None)

    async def read(self, fn: Callable[[], T]) -> T:
        """Run a blocking, idempotent read of Postgres in a worker thread, once more if its connection was dead.

        After a Postgres restart every connection the pool held is dead, and nothing tells until one is used.
        A read that meets one (transient: :func:`_dropped`) has the pool check its idle connections, which
        replaces every dead one, and runs again on a fresh connection; a second failure is the caller's (a 503).
        Without the check, each of the next requests would take one more dead connection and fail in turn.
        """
        try:
            return await self.blocking(fn)
        except (psycopg.Error, StoreUnavailableError) as exc:
            if not _dropped(exc):
                raise
            log.info("a pooled Postgres connection was dead (%s): replacing the pool's dead ones", type(exc).__name__)
        pool = self._pool
        assert pool is not None, "the gateway backend is not started"
        await self.blocking(pool.check)
        return await self.blocking(fn)

    # --- reads -------------------------------------------------------------------------------

    def sent_key(self, ref: SessionRef) -> str:
        return self.keys.gateway_sent(ref)

    async def session_state(self, ref: SessionRef) -> SessionState:
        """Who opened the session here, and whether it exists: in Postgres, or sent a turn no worker took yet.
        For a child session, also who owns its parent (:meth:`_parent_owner`).

        Every lookup runs whatever the first one found, so a refusal costs what a missing session does.
        """

        def query() -> tuple[str | None, bool, str | None]:
            owner = self.owners.owner(ref)
            try:
                return owner, self.store.session_exists(ref), self._parent_owner(ref)
            except psycopg.errors.UndefinedTable:
                return owner, False, None  # no worker has created the schema yet: no session exists

        owner, stored, parent_owner = await self.read(query)
        sent = bool(await self.redis.exists(self.sent_key(ref)))
        return SessionState(owner=owner, exists=owner is not None or stored or sent, parent_owner=parent_owner)

    def _parent_owner(self, ref: SessionRef) -> str | None:
        """The owner of a child session's nearest ancestor that has one (blocking), None for any other session.

        A child session is one whose first turn links to a parent (``TurnPayload.parent``, which only the engine's
        ``ctx.delegate`` writes) under the ids the engine derives from that link: its turn id and its session id
        (:func:`~june_worker.engine.children.child_turn_id`, :func:`~june_worker.engine.children.child_session_id`).
        """
        at = ref
        for _ in range(_MAX_ANCESTORS):
            if ":sub:" not in at.session:
                return None
            with self.store.pool.connection() as conn:
                row = conn.execute(_CHILD_LINK, {"agent": at.agent, "session": at.session}).fetchone()
            if row is None:
                return None
            turn_id, agent, session, parent_turn, call_id = row
            parent = SessionRef(agent, session)
            derived = child_turn_id(parent, parent_turn, call_id)
            if turn_id != derived or at.session != child_session_id(session, derived, call_id):
                return None  # a look-alike: not a session the engine derived from its parent
            owner = self.owners.owner(parent)
            if owner is not None:
                return owner
            at = parent
        return None

    async def claim(self, ref: SessionRef, principal: str) -> str:
        """Record ``principal`` as the opener of a new session; the owner that stands (another, if it raced us)."""
        return await self.read(lambda: self.owners.claim(ref, principal))  # idempotent: runs again alike

    async def turn(self, ref: SessionRef, turn_id: str) -> TurnRecord | None:
        try:
            return await self.read(lambda: self.store.get_turn(ref, turn_id))
        except psycopg.errors.UndefinedTable:
            return None

    async def turn_sent(self, ref: SessionRef, turn_id: str) -> bool:
        return bool(await self.redis.sismember(self.sent_key(ref), turn_id))

    async def pending(self, ref: SessionRef) -> SuspendedCheckpoint | None:
        try:
            return await self.read(lambda: self.store.pending(ref))
        except psycopg.errors.UndefinedTable:
            return None

    async def park_in_the_way(self, ref: SessionRef) -> SuspendedCheckpoint | None:
        """The park a worker's intake would refuse a new turn for, as :meth:`pending` but None while a reset is
        pending: that reset ends the park and the turn runs after it, on the new generation (S90)."""

        def query() -> SuspendedCheckpoint | None:
            with self.store.pool.connection() as conn:
                row = conn.execute(_PARK_IN_THE_WAY, {"agent": ref.agent, "session": ref.session}).fetchone()
            return SuspendedCheckpoint.model_validate_json(row[0]).with_expiry(row[1]) if row else None

        try:
            return await self.read(query)
        except psycopg.errors.UndefinedTable:
            return None

    async def tail(self, ref: SessionRef) -> str:
        """The id of the session stream's newest entry (``0-0`` when empty): follow from it to see what comes next."""
        last: Any = await self.redis.xrevrange(self.keys.session_stream(ref), count=1)
        return str(last[0][0]) if last else "0-0"

    async def health(self) -> dict[str, str]:
        checks: dict[str, str] = {}
        try:
            await self.redis.ping()
            checks["redis"] = "ok"
        except Exception as exc:  # any failure is "down"; the reason is in the log, not the response
            log.warning("health check: Redis is unavailable (%s)", type(exc).__name__)
            checks["redis"] = "unavailable"

        def pg() -> None:
            with self.store.pool.connection(timeout=2) as conn:
                conn.execute("select 1")

        try:
            await self.read(pg)  # a connection that died idle is not Postgres being down
            checks["postgres"] = "ok"
        except Exception as exc:
            log.warning("health check: Postgres is unavailable (%s)", type(exc).__name__)
            checks["postgres"] = "unavailable"
        return checks

    # --- sends -------------------------------------------------------------------------------

    async def start_turn(
        self,
        ref: SessionRef,
        turn_id: str,
        text: str,
        *,
        event: dict[str, Any],
        replace: bool,
        target: dict[str, Any] | None = None,
    ) -> None:
        """Record the id in the sent set, then send ``june.turn`` (in that order: a follower never 404s)."""
        key = self.sent_key(ref)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.sadd(key, turn_id)
            pipe.expire(key, SENT_TTL_S)
            await pipe.execute()
        producer = self.producer
        await self.blocking(
            lambda: producer.start_turn(
                ref.agent, ref.session, text, event=event, turn_id=turn_id, replace=replace, target=target
            )
        )

    async def resume(
        self, ref: SessionRef, turn_id: str, input_id: str, value: Any, *, by: str, principal: dict[str, Any]
    ) -> ResumeOutcome:
        producer, timeout_s = self.producer, self.settings.control_timeout_s
        return await self.blocking(
            lambda: producer.resume(
                ref.agent, ref.session, turn_id, input_id, value, by=by, principal=principal, timeout_s=timeout_s
            ),
            control=True,
        )

    async def send_resume(
        self, ref: SessionRef, turn_id: str, input_id: str, value: Any, *, by: str,
        principal: dict[str, Any] | None, reply_to: dict[str, Any],
    ) -> None:  # fmt: skip
        """Send ``june.resume`` without waiting for its outcome; a refusal is told through ``reply_to``."""
        producer = self.producer
        await self.blocking(
            lambda: producer.send_resume(
                ref.agent, ref.session, turn_id, input_id, value, by=by, principal=principal, reply_to=reply_to
            )
        )

    async def cancel(self, ref: SessionRef, turn_id: str | None) -> dict[str, Any]:
        producer, timeout_s = self.producer, self.settings.control_timeout_s
        return await self.blocking(
            lambda: producer.cancel(ref.agent, ref.session, turn_id, timeout_s=timeout_s), control=True
        )

    async def reset(self, ref: SessionRef) -> ResetOutcome:
        # Answered at once, "pending" for a busy session; unanswered in time, the reset is withdrawn (it expires).
        producer, timeout_s = self.producer, self.settings.control_timeout_s
        return await self.blocking(lambda: producer.reset(ref.agent, ref.session, timeout_s=timeout_s), control=True)
