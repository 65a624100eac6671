"""Gauges read when scraped: what Postgres and the broker hold right now, not what one process did.

:class:`StateCollector` is a prometheus_client collector: each scrape runs four small
statements on its own Postgres connection (along partial indexes: parked sessions, unfinished
turns, sessions whose outbox is ahead of its relay mark, live workers) and asks the broker how
many messages wait in each queue. The worker's metrics server and the gateway's ``/metrics``
both serve it.

A scrape never hangs: the connection has a connect timeout and a statement timeout, the broker
a connect timeout; what fails is left out of that scrape and ``june_state_up`` says 0.

The rule a reader must not break: **agent labels come from the configured agents** (any other
name in the tables is summed under ``_other``): a producer can send any agent name.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg

from ..engine.secrets import scrubbed_logger

__all__ = ["StateCollector", "broker_depths"]

log = scrubbed_logger("june_worker.observe")

OTHER = "_other"

# Sessions parked on an input, per agent, and how long the oldest has waited since it parked (june_sessions_parked,
# migration 12).
_PARKED = """
select agent, count(*), extract(epoch from now()) - min(parked_at)
  from june_sessions where suspended is not null group by agent
"""

# Turns recorded and not ended (the june_turns_unfinished partial index).
_UNFINISHED = """
select agent, status, count(*) from june_turns where status in ('queued', 'running') group by agent, status
"""

# The relay's lag: sessions nobody holds (the lease rule of worker/queue.py) whose committed events are past the
# mark the sweeper moves once their stream holds them (along the june_sessions_relay_due partial index), and the age of
# the oldest such event. A session a worker holds is relayed by that worker, and is left out.
_UNRELAYED = """
select count(*), coalesce(max(extract(epoch from now()) - e.created_at), 0)
  from june_sessions s
  left join june_events e on e.agent = s.agent and e.session = s.session and e.seq = s.relayed_seq + 1
 where s.relay_due and s.event_seq > s.relayed_seq
   and (s.lease_owner is null
        or s.lease_expires < extract(epoch from clock_timestamp())
        or not exists (select 1 from june_workers w
                        where w.owner = s.lease_owner and w.alive_until >= extract(epoch from clock_timestamp())))
"""

_WORKERS = "select count(*) from june_workers where alive_until >= extract(epoch from clock_timestamp())"


def broker_depths(broker_url: str, queues: Iterable[str], *, timeout_s: float = 3.0) -> dict[str, int]:
    """Messages waiting in each queue (delivered, unacknowledged ones not counted); a queue the broker does
    not have (Redis drops an empty one) counts 0. Raises when the broker cannot be reached."""
    from kombu.connection import Connection
    from kombu.exceptions import ChannelError

    out: dict[str, int] = {}
    options = {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    with Connection(broker_url, connect_timeout=timeout_s, transport_options=options) as conn:  # type: ignore[no-untyped-call]
        conn.ensure_connection(max_retries=1)
        for queue in queues:
            channel = conn.channel()
            try:
                out[queue] = int(channel.queue_declare(queue=queue, passive=True).message_count)
            except ChannelError:
                out[queue] = 0
            finally:
                try:
                    channel.close()
                except Exception:  # a channel RabbitMQ closed on a missing queue: nothing left to close
                    log.debug("closing a broker channel failed", exc_info=True)
    return out


class StateCollector:
    """Parked sessions, unfinished turns, relay lag, live workers and queue depths, read at each scrape."""

    def __init__(
        self,
        database_url: str,
        *,
        agents: Iterable[str],
        depths: Callable[[], dict[str, int]] | None = None,
        timeout_s: float = 3.0,
    ) -> None:
        self.database_url = database_url
        self.agents = frozenset(agents)
        self.depths = depths
        self.timeout_s = timeout_s
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def describe(self) -> list[Any]:
        return []  # no families up front: the registry does not call collect() when it is registered

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        with self._lock:
            t0 = time.perf_counter()
            up = GaugeMetricFamily("june_state_up", "1 if the last scrape read Postgres, else 0.")
            try:
                yield from self._database()
                up.add_metric([], 1)
            except Exception as exc:
                log.warning("metrics: cannot read the state from Postgres (%s)", type(exc).__name__)
                self._close()
                up.add_metric([], 0)
            yield up
            if self.depths is not None:
                depth = GaugeMetricFamily(
                    "june_queue_depth_messages", "Messages waiting in a broker queue (not yet delivered).",
                    labels=["queue"],
                )  # fmt: skip
                try:
                    for queue, n in self.depths().items():
                        depth.add_metric([queue], n)
                    yield depth
                except Exception as exc:
                    log.warning("metrics: cannot read the queue depths from the broker (%s)", type(exc).__name__)
            took = GaugeMetricFamily("june_state_scrape_duration_seconds", "How long reading the state took.")
            took.add_metric([], time.perf_counter() - t0)
            yield took

    def _label(self, agent: str) -> str:
        return agent if agent in self.agents else OTHER

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.database_url,
                autocommit=True,
                connect_timeout=max(int(self.timeout_s), 1),
                options=f"-c statement_timeout={int(self.timeout_s * 1000)}",
                application_name="june-metrics",
            )
        return self._conn

    def close(self) -> None:
        """Close the collector's connection (a later scrape opens another)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    def _database(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        conn = self._connection()
        parked_n: dict[str, float] = defaultdict(float)
        parked_age: dict[str, float] = defaultdict(float)
        for agent, n, age in conn.execute(_PARKED).fetchall():
            label = self._label(agent)
            parked_n[label] += n
            parked_age[label] = max(parked_age[label], float(age or 0))
        unfinished: dict[tuple[str, str], float] = defaultdict(float)
        for agent, status, n in conn.execute(_UNFINISHED).fetchall():
            unfinished[(self._label(agent), status)] += n
        row = conn.execute(_UNRELAYED).fetchone()
        unrelayed, lag = (row[0], float(row[1])) if row else (0, 0.0)
        workers_row = conn.execute(_WORKERS).fetchone()
        workers = workers_row[0] if workers_row else 0

        parked = GaugeMetricFamily("june_sessions_parked", "Sessions parked on an input request.", labels=["agent"])
        oldest = GaugeMetricFamily(
            "june_sessions_parked_oldest_seconds", "How long the longest-parked session has waited for its answer.",
            labels=["agent"],
        )  # fmt: skip
        for label in sorted(self.agents | set(parked_n)):
            parked.add_metric([label], parked_n.get(label, 0))
            oldest.add_metric([label], parked_age.get(label, 0))
        yield parked
        yield oldest
        turns = GaugeMetricFamily(
            "june_turns_unfinished", "Turns recorded and not ended: queued or running.", labels=["agent", "status"]
        )
        for label in sorted(self.agents | {a for a, _ in unfinished}):
            for status in ("queued", "running"):
                turns.add_metric([label, status], unfinished.get((label, status), 0))
        yield turns
        yield GaugeMetricFamily(
            "june_outbox_relay_lag_seconds",
            "Age of the oldest committed event not yet marked relayed, among sessions no worker holds.", value=lag,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "june_outbox_unrelayed_sessions", "Sessions no worker holds whose outbox is ahead of their relay mark.",
            value=unrelayed,
        )  # fmt: skip
        yield GaugeMetricFamily("june_workers_alive", "Worker processes with a live heartbeat.", value=workers)
