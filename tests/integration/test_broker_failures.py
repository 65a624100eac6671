"""No accepted turn is lost when the broker fails, on Redis and on RabbitMQ.

Every test here runs its own broker (a Redis, or a RabbitMQ node, of its own), never the
shared one, and restarts or wipes it while turns are in flight. Events, results and the hold
tool's keys stay on the shared Redis, so only the broker fails.

* a broker restarted mid-run with its persistence on (Redis with AOF as docker-compose.yml runs
  it; RabbitMQ's durable quorum queues, persistent messages, confirmed publishes): every turn
  whose send returned completes, once;
* a broker that loses everything (a Redis without persistence, a RabbitMQ whose data is gone):
  a turn sent with ``durable=True`` was recorded in Postgres first and completes; the same
  turn sent without it is gone, which is what ``durable`` is for.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest

from june_worker.stores.postgres import PostgresStore
from tests import _services
from tests._rabbitmq import RabbitMQServer
from tests._services import RedisServer

from .conftest import Stack, wait_for

pytestmark = pytest.mark.integration

ALL_DONE_S = 60.0


class Broker(Protocol):
    url: str

    def restart(self) -> None: ...


@pytest.fixture(scope="module")
def rabbitmq() -> Iterator[RabbitMQServer]:
    """One RabbitMQ node for this module's tests (a boot costs ~5 s); each test leaves it running."""
    try:
        with _services.private_rabbitmq() as server:
            yield server
    except _services.ServiceUnavailable as exc:
        pytest.exit(str(exc), returncode=pytest.ExitCode.USAGE_ERROR)


@contextlib.contextmanager
def _stack(fresh_db: str, redis_url: str, broker_url: str, tmp: Path) -> Iterator[Stack]:
    s = Stack(fresh_db, redis_url, tmp, broker_url)
    s.sql("create table if not exists it_orders (turn_id text not null, call_id text not null, item text, qty integer)")
    try:
        yield s
    finally:
        s.close()


def _completed(stack: Stack, session: str, turn_id: str) -> bool:
    return (stack.turn_row("ops", session, turn_id) or {}).get("status") == "completed"


@pytest.mark.parametrize("kind", ["redis", "amqp"])
def test_a_broker_restarted_mid_run_with_persistence_loses_no_accepted_turn(
    kind: str, fresh_db: str, redis_url: str, rabbitmq: RabbitMQServer, tmp_path: Path
) -> None:
    with contextlib.ExitStack() as cleanup:
        broker: Broker = rabbitmq if kind == "amqp" else cleanup.enter_context(_services.private_redis(persistent=True))
        stack = cleanup.enter_context(_stack(fresh_db, redis_url, broker.url, tmp_path))
        # Given a worker whose two processes are held by slow turns, and ten more turns in the broker's queue
        stack.worker("busy", concurrency=2)
        stack.beat()
        keys = [uuid.uuid4().hex for _ in range(2)]
        held = {f"restart-held-{k[:6]}": stack.turn("ops", f"restart-held-{k[:6]}", f"slow {k}") for k in keys}
        wait_for(lambda: all(stack.redis.llen(f"it:hold:{k}:log") == 1 for k in keys), what="both processes to be held")
        queued = {f"restart-{n}-{uuid.uuid4().hex[:6]}": n for n in range(1, 11)}
        accepted = {session: stack.turn("ops", session, f"order {n} part") for session, n in queued.items()}
        # When the broker restarts (a clean stop: what it acknowledged is on disk), then the holds end
        broker.restart()
        for k in keys:
            stack.redis.set(f"it:hold:{k}:release", 1)
        # Then every turn whose send returned completes, exactly once
        turns = {**held, **accepted}
        wait_for(
            lambda: all(_completed(stack, s, t) for s, t in turns.items()),
            timeout_s=ALL_DONE_S,
            every_s=0.2,
            what=f"all {len(turns)} turns after the {kind} broker restarted",
        )
        for session, n in queued.items():
            assert stack.sql("select qty from it_orders where turn_id = %s", accepted[session]) == [(n,)]
        for session, turn_id in turns.items():
            started = [e for e in stack.structural("ops", session) if e["type"] == "turn.started"]
            assert [e["turn_id"] for e in started] == [turn_id]


def _lose_everything(kind: str, broker: RedisServer | RabbitMQServer) -> None:
    if isinstance(broker, RabbitMQServer):
        broker.wipe()  # its data dir is gone: no queue, no message
    else:
        broker.restart()  # no persistence: it comes back empty


@pytest.mark.parametrize("kind", ["redis", "amqp"])
def test_a_durable_turn_survives_a_broker_that_loses_everything(
    kind: str, fresh_db: str, redis_url: str, rabbitmq: RabbitMQServer, tmp_path: Path
) -> None:
    with contextlib.ExitStack() as cleanup:
        broker = rabbitmq if kind == "amqp" else cleanup.enter_context(_services.private_redis(persistent=False))
        stack = cleanup.enter_context(_stack(fresh_db, redis_url, broker.url, tmp_path))
        PostgresStore(stack.db_url).close()  # the schema, as `june migrate` makes it before any worker runs
        producer = stack.producer(database_url=stack.db_url)
        cleanup.callback(producer.close)
        # Given two turns sent while no worker runs: one recorded first (durable), one not
        durable_session, plain_session = f"durable-{uuid.uuid4().hex[:6]}", f"plain-{uuid.uuid4().hex[:6]}"
        durable = producer.start_turn("ops", durable_session, "order 4 gear", durable=True)
        plain = producer.start_turn("ops", plain_session, "order 5 gear")
        assert stack.turn_row("ops", durable_session, durable) == {"status": "queued", "attempts": 0, "result": None}
        # When the broker loses everything, then workers and the sweeper come up
        _lose_everything(kind, broker)
        stack.worker("after")
        stack.beat()
        # Then the durable turn completes (the sweeper sent it again), once
        wait_for(lambda: _completed(stack, durable_session, durable), timeout_s=ALL_DONE_S, what="the durable turn")
        assert stack.sql("select qty from it_orders where turn_id = %s", durable) == [(4,)]
        assert [e["type"] for e in stack.structural("ops", durable_session)].count("turn.started") == 1
        # and the plain one went with the broker: nothing ever recorded it
        assert stack.turn_row("ops", plain_session, plain) is None
