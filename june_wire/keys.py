"""Every Redis key, stream and channel name june uses, in one place, and the session address they are made of.

Layout (``<p>`` is the default prefix ``june``; ``{...}`` are literal braces, a Redis
Cluster hash tag: only the text between them picks the slot)::

    june:events:{<agent>:<session>}           stream   one session's events, structural and deltas
    june:relayed:{<agent>:<session>}          string   highest seq appended to that stream
    june:control:{<agent>:<session>}          channel  cancel / control signals to the running worker
    june:gateway:sent:{<agent>:<session>}     set      turn ids the HTTP gateway sent (kept one day)
    june:gateway:slack:{<agent>:<session>}:<turn id>  string  a Slack event sent as that turn (kept one day)
    june:events:all:<n>                       stream   firehose partition n: every session's structural events
    june:firehose:relayed:{june:events:all:<n>}  hash  session key -> highest seq appended to partition n
    june:firehose:seen:{june:events:all:<n>}     zset  session key -> when it last appended there (ms)
    june:epoch:{<n>}                          string   run_id of the server that wrote it (one per cluster primary)
    june:rebuild                              string   the rebuild pass after a data loss: its id, how far it got

On a Redis broker (``CELERY_BROKER_URL``), kombu keeps the messages a worker took and has not
acknowledged under names june gives it (:func:`broker_unacked_keys`), not kombu's database-wide
defaults (``unacked``, ``unacked_index``): a june worker puts back only june's messages after
its short visibility timeout, never those of another Celery app on the same database::

    june:broker:unacked                       hash     delivery tag -> the message
    june:broker:unacked_index                 zset     delivery tag -> when it was delivered
    june:broker:unacked_mutex                 string   one worker restores at a time

The rule a reader must not break: **a marker lives in the same hash slot as the stream it
guards**, because the script that compares and appends touches both in one call. A session's
keys share the tag ``{<agent>:<session>}``. A firehose partition keeps the bare name
``june:events:all:<n>`` of the design; a key with no braces hashes as a whole, so its marker
uses the stream's full name as its tag and lands in the same slot.

On a Redis Cluster every session's keys therefore live on one node, and each firehose partition with
its marker and sorted set on one node (16 partitions by default there, spread over the slots).

A session goes to partition ``crc32(<agent>:<session>) % partitions``: stable across
processes and versions (never Python's salted ``hash``). Changing the partition count moves
sessions to other partitions; their new partition has no marker for them yet, so the next
publish backfills their history there (see :mod:`june_worker.events.redis_stream`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

__all__ = [
    "CLUSTER_FIREHOSE_PARTITIONS",
    "DEFAULT_KEYS",
    "EventKeys",
    "SessionRef",
    "broker_unacked_keys",
    "check_prefix",
    "default_firehose_partitions",
]

CLUSTER_FIREHOSE_PARTITIONS = 16
"""On a Redis Cluster the firehose is split over this many streams by default, so that its appends spread over
the cluster's slots (and nodes) instead of all landing on the one node that owns a single stream."""


@dataclass(frozen=True, slots=True)
class SessionRef:
    """A session's address: the agent serving it and the app's session id."""

    agent: str
    session: str

    @property
    def key(self) -> str:
        return f"{self.agent}:{self.session}"

    def __str__(self) -> str:
        return self.key


def check_prefix(prefix: str) -> str:
    """``prefix`` if it may start june's key names (braces would change a key's hash slot); else ValueError."""
    if not isinstance(prefix, str) or not prefix or any(c in "{}" or c.isspace() for c in prefix):
        raise ValueError(f"invalid key prefix {prefix!r}: expected a non-empty name without braces or spaces")
    return prefix


def default_firehose_partitions(*, cluster: bool) -> int:
    """``JUNE_FIREHOSE_PARTITIONS`` when it is unset, for workers and gateway alike: 16 on a cluster, 1 on one Redis.

    Every process that writes or reads the firehose must use the same count; one default keeps them so."""
    return CLUSTER_FIREHOSE_PARTITIONS if cluster else 1


@dataclass(frozen=True, slots=True)
class EventKeys:
    """Names of the event keys; ``prefix`` isolates deployments (and tests) sharing one Redis."""

    prefix: str = "june"
    firehose_partitions: int = 1

    def __post_init__(self) -> None:
        check_prefix(self.prefix)
        if self.firehose_partitions < 1:
            raise ValueError(f"firehose_partitions must be at least 1, not {self.firehose_partitions}")

    # --- one session ---------------------------------------------------------------------------

    @staticmethod
    def session_tag(ref: SessionRef) -> str:
        """The hash tag shared by all of a session's keys."""
        return "{" + ref.key + "}"

    def session_stream(self, ref: SessionRef) -> str:
        return f"{self.prefix}:events:{self.session_tag(ref)}"

    def session_marker(self, ref: SessionRef) -> str:
        """Highest structural ``seq`` appended to :meth:`session_stream` (a string key)."""
        return f"{self.prefix}:relayed:{self.session_tag(ref)}"

    def gateway_sent(self, ref: SessionRef) -> str:
        """Set of turn ids the HTTP gateway sent for this session (a turn is followable before a worker records it)."""
        return f"{self.prefix}:gateway:sent:{self.session_tag(ref)}"

    def gateway_slack_seen(self, ref: SessionRef, turn_id: str) -> str:
        """Set when the gateway sent the turn a Slack event made: a retried delivery of the event is not sent again."""
        return f"{self.prefix}:gateway:slack:{self.session_tag(ref)}:{turn_id}"

    def control_channel(self, ref: SessionRef) -> str:
        """Pub/sub channel that tells the worker running the session to cancel (or other control)."""
        return f"{self.prefix}:control:{self.session_tag(ref)}"

    # --- the firehose --------------------------------------------------------------------------

    def partition(self, ref: SessionRef) -> int:
        """The firehose partition of a session: a stable hash of its key."""
        return zlib.crc32(ref.key.encode()) % self.firehose_partitions

    def firehose_stream(self, partition: int) -> str:
        self._check_partition(partition)
        return f"{self.prefix}:events:all:{partition}"

    def firehose_marker(self, partition: int) -> str:
        """Hash ``<agent>:<session>`` -> highest ``seq`` of that session appended to the partition."""
        return f"{self.prefix}:firehose:relayed:{{{self.firehose_stream(partition)}}}"

    def firehose_seen(self, partition: int) -> str:
        """Sorted set ``<agent>:<session>`` -> when that session last appended to the partition (ms): the
        firehose marker's fields of sessions gone quiet are dropped by it (see :meth:`firehose_marker`)."""
        return f"{self.prefix}:firehose:seen:{{{self.firehose_stream(partition)}}}"

    def firehose_streams(self) -> list[str]:
        return [self.firehose_stream(p) for p in range(self.firehose_partitions)]

    # --- noticing a data loss (see june_worker.events.losses) ----------------------------------

    def epoch(self, n: int) -> str:
        """An epoch key: the ``run_id`` of the Redis (cluster node) that wrote it, gone or another run's once that
        Redis may have lost data (:mod:`june_worker.events.losses`). ``n`` only picks the hash slot: on a cluster
        each primary keeps the one of the first ``n`` whose slot it serves."""
        if n < 0:
            raise ValueError(f"an epoch key's number is not negative, not {n}")
        return f"{self.prefix}:epoch:{{{n}}}"

    def rebuild_pass(self) -> str:
        """The pass that rebuilds the streams after a data loss: its id and the last session it checked (JSON)."""
        return f"{self.prefix}:rebuild"

    def _check_partition(self, partition: int) -> None:
        if not 0 <= partition < self.firehose_partitions:
            raise ValueError(f"firehose partition {partition} out of range 0..{self.firehose_partitions - 1}")


DEFAULT_KEYS = EventKeys()


def broker_unacked_keys(prefix: str) -> dict[str, str]:
    """kombu's Redis transport options naming where a worker's unacknowledged messages are kept, under ``prefix``."""
    return {
        "unacked_key": f"{prefix}:broker:unacked",
        "unacked_index_key": f"{prefix}:broker:unacked_index",
        "unacked_mutex_key": f"{prefix}:broker:unacked_mutex",
    }
