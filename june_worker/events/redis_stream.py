"""RedisStreamSink: the EventSink that appends a session's events to its Redis Stream.

Structural events (they carry their per-session ``seq``) go to the session's stream and to
its firehose partition, each **exactly once and in seq order**, however often they are
published: a Lua script (``append.lua``, run by EVALSHA) compares each event's ``seq`` with
the stream's marker and appends only ``seq > marker``, then moves the marker, atomically.
Deltas are appended to the session stream as they come: never deduplicated, never sent to
the firehose.

The rule a reader must not break: **the session stream is always a gap-free prefix of the
store's event log.** An event whose ``seq`` is past ``marker + 1`` (an earlier publish was
lost: Redis was down, the worker died between commit and publish, Redis lost its keys) is
not appended ahead of the missing ones. With a ``store`` the sink fills the gap from it at
once (:meth:`RedisStreamSink.relay`) and the later events follow in order; without one the
events wait in the store until someone calls :meth:`~RedisStreamSink.relay` (a new worker,
the sweeper). The store is the source of truth; Redis only ever holds a prefix of it.

With ``pipelined=True`` (the sink a worker's running turns publish to) a publish sends its
commands on the sink's own connection and returns without waiting for the reply: Redis appends
the events as soon as it reads them, while the worker goes on to its next step. The replies are
read at the next publish, or at :meth:`~RedisStreamSink.flush` (the worker flushes when a turn
ends, so its events are in Redis before the task reports it done); a gap or an error they
report is acted on then. Everything goes over that one connection, in order: deltas never
overtake the structural events committed before them.

On a Redis Cluster (``redis+cluster://``, see :mod:`june_wire.redis_url`) the same holds per node: a
session's stream and marker share a hash slot, so its appends and deltas go over the sink's one
connection to that node, in order (:mod:`._wire`); its firehose partition may be on another node.
A reply of ``MOVED`` (the slot moved) is a gap: the sink learns the slot map again and fills the
stream from the store. Outside the pipelined path the two script calls of a publish go one after
the other through the cluster client (a cluster pipeline refuses scripts); it follows ``MOVED``
and ``ASK`` itself.

The sink never raises into the turn: a Redis error is logged (no URL, no password) and the
call returns. After an error the sink stays quiet for ``retry_after_s`` (publishes return
at once), so an unreachable Redis does not slow every step of every turn; the first
publish after that finds the gap and fills it from the store.

Limits, all of them the price of keeping the markers in Redis beside the streams:

* Redis loses a session's keys (restart without persistence, FLUSHALL, eviction): the next
  publish finds no marker, sees a gap, and rebuilds the stream from the store, whole
  history, trimmed as usual. A session that publishes no more (its turns all finished) has it
  rebuilt by the sweeper, which notices a Redis that lost its data by its epoch keys
  (:mod:`.losses`; a key evicted alone is not noticed). A reader resuming from an id of the old stream with ``last_seq``
  gets what it lacks of that history (repeats dropped by ``seq``); without it, it is told a gap
  unless the new copy starts at seq 1, then gets that history again (new ids are newer), so a
  reader across calls must dedupe by ``seq``.
* Only the marker lost (evicted alone, deleted by hand): the script recovers it from the
  ``seq`` of the newest structural entry among the stream's last 1000; no duplicates, unless
  deltas fill all of those 1000 entries.
* Only the firehose's hash lost: each session's history is appended to the firehose again as
  it next publishes. Firehose consumers dedupe by (agent, session, seq).
* The firehose hash keeps one small field per session that published lately: the sweeper drops the
  fields of sessions quiet for longer than the session keys' time to live
  (:meth:`RedisStreamSink.forget_quiet_sessions`); a session that publishes again after that has what
  the store still holds appended to the firehose again (consumers dedupe by session and seq).
* With ``session_ttl_s`` a session's stream and marker expire once it has been quiet that long; the
  next publish rebuilds the stream from what the store still holds (see the outbox retention).
* Trimming drops entries, never markers: a reader that was away longer than the stream keeps
  cannot get what was trimmed from the stream. It is told (:mod:`.reader` raises
  ``StreamGapError``), and reloads those events from the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AskError, MovedError, NoScriptError, ResponseError
from redis.retry import Retry

from june_wire.events import encode_data
from june_wire.keys import DEFAULT_KEYS, EventKeys, SessionRef
from june_wire.redis_url import RedisClient, connect, describe, is_cluster, redact

from ..engine.events import TurnEvent, is_structural
from ..engine.secrets import scrubbed_logger
from ._wire import Wire

__all__ = ["EventLog", "RedisStreamSink", "Trim", "encode_event", "redact"]

log = scrubbed_logger("june_worker.events.redis")

_APPEND_LUA = resources.files(__package__).joinpath("append.lua").read_text(encoding="utf-8")
# Drop the marker fields (KEYS[2]) of sessions whose last append (KEYS[1], ms) is before ARGV[1]; at most ARGV[2].
# Atomic, so an append landing meanwhile is either kept whole or seen after (its field gone, its history re-sent).
_FORGET_LUA = """
local quiet = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for _, field in ipairs(quiet) do
  redis.call('HDEL', KEYS[2], field)
  redis.call('ZREM', KEYS[1], field)
end
return #quiet
"""


class EventLog(Protocol):
    """What :meth:`RedisStreamSink.relay` needs of a store: its committed structural events."""

    def events(self, ref: SessionRef, *, turn_id: str | None = None, after_seq: int = 0) -> list[TurnEvent]: ...


@dataclass(frozen=True, slots=True)
class Trim:
    """How a stream is trimmed when it is appended to: by length, by age, or both.

    Approximate trimming (``exact=False``, Redis ``~``) removes whole internal nodes only,
    so a stream may hold somewhat more than ``maxlen`` entries; it is much cheaper.
    Deltas count towards ``maxlen`` too: size it for a session's tokens, or trim by age.
    """

    maxlen: int | None = None
    max_age_s: float | None = None
    exact: bool = False

    def __post_init__(self) -> None:
        if self.maxlen is not None and self.maxlen < 0:
            raise ValueError(f"maxlen must be >= 0, not {self.maxlen}")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, not {self.max_age_s}")

    def script_args(self) -> tuple[str, str, str]:
        """(MAXLEN, operator, MINID) as the append script takes them; '' means none."""
        return (
            "" if self.maxlen is None else str(self.maxlen),
            "=" if self.exact else "~",
            self.minid() or "",
        )

    def minid(self) -> str | None:
        """The oldest stream id to keep: now minus ``max_age_s`` (ids are milliseconds of the clock)."""
        if self.max_age_s is None:
            return None
        return f"{int((time.time() - self.max_age_s) * 1000)}-0"


def encode_event(ref: SessionRef, event: TurnEvent) -> str:
    """The ``data`` field of a stream entry: the event as snake_case JSON, plus ``agent`` and ``session``."""
    return encode_data(ref.agent, ref.session, event.model_dump_json(by_alias=True))


@dataclass(frozen=True, slots=True)
class _Part:
    """Whose a pipelined append reply is: which session, and which of its two appends (0 stream, 1 firehose)."""

    ref: SessionRef
    index: int


class RedisStreamSink:
    """Publishes a session's events to ``june:events:{<agent>:<session>}`` and the firehose.

    ``store``: where to fill a gap from (see the module docstring); pass the same store the
    engine commits to. ``session_trim`` / ``firehose_trim``: applied on every append.
    ``session_ttl_s``: a session's stream and marker expire once the session published nothing for
    that long (each structural append renews it); a later publish rebuilds the stream from the store.
    ``firehose=False`` leaves the firehose out (each publish is then one script call).
    ``pipelined``: publishes do not wait for Redis's reply (see the module docstring); needs
    ``store``, to fill from it whatever a late-read reply says is missing.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        keys: EventKeys = DEFAULT_KEYS,
        store: EventLog | None = None,
        session_trim: Trim = Trim(maxlen=10_000),
        firehose: bool = True,
        firehose_trim: Trim = Trim(maxlen=100_000),
        retry_after_s: float = 1.0,
        relay_batch: int = 500,
        pipelined: bool = False,
        session_ttl_s: float | None = None,
    ) -> None:
        if relay_batch < 1:
            raise ValueError(f"relay_batch must be at least 1, not {relay_batch}")
        if pipelined and store is None:
            raise ValueError("a pipelined sink needs a store to fill gaps from")
        self.client = client
        self.keys = keys
        self.store = store
        self.session_trim = session_trim
        self.session_ttl_ms = str(int(session_ttl_s * 1000)) if session_ttl_s else ""
        self.firehose = firehose
        self.firehose_trim = firehose_trim
        self.retry_after_s = retry_after_s
        self.relay_batch = relay_batch
        self._where = describe(client)
        self._sha: str | None = None
        self._quiet_until = 0.0
        self.pipelined = pipelined
        self._cluster = is_cluster(client)
        self._wire = Wire(client)  # the pipelined sink's own connections (one per cluster node), made on first use
        self._lock = threading.Lock()
        # Per session, the markers the latest append replies reported: [session stream, firehose] (None: no reply yet).
        self._reached: dict[SessionRef, list[int | None]] = {}
        self._reached_lock = threading.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        **options: Any,
    ) -> RedisStreamSink:
        """A sink with its own client. Short timeouts and a single immediate retry on a dropped
        connection: a Redis outage costs a turn at most one timeout per ``retry_after_s``."""
        client = connect(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )
        return cls(client, **options)

    # --- EventSink -------------------------------------------------------------------------------

    def publish(self, ref: SessionRef, events: Sequence[TurnEvent]) -> None:
        """Append committed structural events once each, in seq order; never raises."""
        structural: list[TurnEvent] = []
        for event in events:
            if not is_structural(event):
                self.publish_delta(ref, event)
            elif event.seq is None:
                log.error("%s event of %s has no seq (not committed?); not published", event.type, ref)
            else:
                structural.append(event)
        if not structural or self._quiet():
            return
        structural.sort(key=lambda e: e.seq or 0)
        if self.pipelined:
            try:
                sha = self._script()
            except Exception as exc:
                self._failed(exc, f"publish of {len(structural)} event(s) of {ref}")
                return
            calls = self._calls(ref, structural, lenient=False)
            commands = [(keys[0], ("EVALSHA", sha, len(keys), *keys, *args)) for keys, args in calls]
            sent = self._send(commands, [_Part(ref, i) for i in range(len(calls))])
            self.flush(keep=sent)  # what earlier publishes owe: read after sending, their replies have arrived
            return
        try:
            gap = self._append(ref, structural, lenient=False)
            if gap:
                if self.store is not None:
                    self.relay(self.store, ref)
                else:
                    log.warning(
                        "events of %s are ahead of its stream (missing before seq %d); they wait for relay()", ref, gap
                    )
        except Exception as exc:
            self._failed(exc, f"publish of {len(structural)} event(s) of {ref}")

    def publish_delta(self, ref: SessionRef, event: TurnEvent) -> None:
        """Append one live delta to the session stream; never deduplicated, never raises."""
        if is_structural(event):
            self.publish(ref, [event])
            return
        if self._quiet():
            return
        fields = {"type": event.type, "data": encode_event(ref, event)}
        stream = self.keys.session_stream(ref)
        commands = _xadd(stream, fields, self.session_trim)
        if self.pipelined:
            self.flush(keep=self._send([(stream, c) for c in commands], [None] * len(commands)))
            return
        try:
            pipe: Any = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            pipe.execute()
        except Exception as exc:
            self._failed(exc, f"delta of {ref}")

    # --- relay -----------------------------------------------------------------------------------

    def relay(self, store: EventLog, ref: SessionRef) -> int:
        """Append whatever the store holds past this session's markers; return how many reached its stream.

        Safe to run at any time, from any process, alongside live publishes: every append is
        idempotent. Unlike :meth:`publish` it raises on a Redis error, so that its caller (a
        new worker, the sweeper) can retry. It trusts the store: a seq missing from the store
        is skipped, not waited for.
        """
        after = self.relayed_seq(ref)  # reads the replies still owed first
        events = store.events(ref, after_seq=after)
        appended = 0
        for i in range(0, len(events), self.relay_batch):
            appended += self._append(ref, events[i : i + self.relay_batch], lenient=True, count=True)
        if appended:
            log.info("relayed %d event(s) of %s after seq %d", appended, ref, after)
        return appended

    def catch_up(self, store: EventLog, ref: SessionRef, committed: int) -> None:
        """:meth:`relay` if the stream is behind ``committed`` (the session's event count); never raises for Redis.

        For a holder that just took a session: a Redis error is logged, the sink goes quiet like
        after a failed publish, and the events wait in the store for the next publish or the sweeper.
        The store's own errors propagate (they are the caller's failure policy's).
        """
        if self._quiet():
            return
        try:
            if self.relayed_seq(ref) < committed:
                self.relay(store, ref)
        except redis.RedisError as exc:
            self._failed(exc, f"relay of {ref}")

    def relayed_seq(self, ref: SessionRef) -> int:
        """The highest seq appended everywhere this sink writes (session stream and firehose)."""
        return self.relayed_seqs([ref])[0]

    def relayed_seqs(self, refs: Sequence[SessionRef]) -> list[int]:
        """:meth:`relayed_seq` of each session, in one round trip."""
        self.flush()
        pipe = self.client.pipeline(transaction=False)
        for ref in refs:
            pipe.get(self.keys.session_marker(ref))
            if self.firehose:
                pipe.hget(self.keys.firehose_marker(self.keys.partition(ref)), ref.key)
        values = [int(v or 0) for v in pipe.execute()]
        width = 2 if self.firehose else 1
        return [min(values[i : i + width]) for i in range(0, len(values), width)]

    def take_relayed(self) -> dict[SessionRef, int]:
        """The seq up to which each session's stream and firehose partition hold its events, as this sink's appends
        last saw them (the append script's replies, no round trip of its own); each session once, until its next
        append. A holder writes them to the store's relay mark, so that the sweeper need not look at its sessions."""
        out: dict[SessionRef, int] = {}
        with self._reached_lock:
            for ref, markers in list(self._reached.items()):
                if None not in markers:  # else the reply of its other part is still owed: at the next call
                    out[ref] = min(m for m in markers if m is not None)
                    del self._reached[ref]
        return out

    def _note(self, ref: SessionRef, part: int, marker: int) -> None:
        """An append reply: the marker of ``ref``'s session stream (part 0) or firehose partition (1) is ``marker``."""
        with self._reached_lock:
            markers = self._reached.setdefault(ref, [None, None] if self.firehose else [None])
            markers[part] = marker

    def forget_quiet_sessions(self, *, quiet_s: float, limit: int = 1000) -> int:
        """Drop the firehose marker fields of sessions that appended nothing for ``quiet_s``, so the marker
        hash stays bounded; return how many. A session that publishes again afterwards finds no marker and
        has what its store still holds appended to the firehose again (consumers dedupe by session and seq)."""
        if not self.firehose:
            return 0
        cutoff_ms = int((time.time() - quiet_s) * 1000)
        dropped = 0
        for p in range(self.keys.firehose_partitions):
            keys = [self.keys.firehose_seen(p), self.keys.firehose_marker(p)]
            dropped += int(self.client.eval(_FORGET_LUA, 2, *keys, cutoff_ms, limit))
        return dropped

    # --- internals -------------------------------------------------------------------------------

    def _append(self, ref: SessionRef, events: Sequence[TurnEvent], *, lenient: bool, count: bool = False) -> int:
        """Run the append script on the session stream (and the firehose partition) in one round trip.

        Returns the number appended to the session stream when ``count``, else the first seq
        refused for a gap (0: none).
        """
        results = self._run(self._calls(ref, events, lenient=lenient))
        for part, result in enumerate(results):
            self._note(ref, part, int(result[1]))
        if count:
            return int(results[0][0])
        gaps = [int(r[2]) for r in results if int(r[2])]
        return min(gaps) if gaps else 0

    def _calls(
        self, ref: SessionRef, events: Sequence[TurnEvent], *, lenient: bool
    ) -> list[tuple[list[str], list[str | int]]]:
        """The append script's (keys, args) for the session stream and the firehose partition."""
        triples: list[str | int] = []
        for e in events:
            triples += [e.seq or 0, e.type, encode_event(ref, e)]
        mode = "1" if lenient else "0"
        calls: list[tuple[list[str], list[str | int]]] = [
            (
                [self.keys.session_stream(ref), self.keys.session_marker(ref)],
                ["", mode, *self.session_trim.script_args(), self.session_ttl_ms, *triples],
            )
        ]
        if self.firehose:
            p = self.keys.partition(ref)
            calls.append(
                (
                    [self.keys.firehose_stream(p), self.keys.firehose_marker(p), self.keys.firehose_seen(p)],
                    [ref.key, mode, *self.firehose_trim.script_args(), "", *triples],
                )
            )
        return calls

    def _run(self, calls: list[tuple[list[str], list[str | int]]]) -> list[list[Any]]:
        """EVALSHA every call, in one pipeline on one Redis (on a cluster one after the other: a cluster
        pipeline refuses scripts, and each call's keys may live on another node); load the script and run
        them all again on NOSCRIPT (harmless: the script is idempotent)."""
        for attempt in (1, 2):
            sha = self._script()
            if self._cluster:
                results = [self._evalsha(sha, keys, args) for keys, args in calls]
            else:
                pipe = self.client.pipeline(transaction=False)
                for keys, args in calls:
                    pipe.evalsha(sha, len(keys), *keys, *args)
                results = pipe.execute(raise_on_error=False)
            errors = [r for r in results if isinstance(r, Exception)]
            if not errors:
                return [list(r) for r in results]
            if attempt == 1 and all(isinstance(r, NoScriptError) for r in errors):
                self._sha = None  # flushed, or a failover to a replica that never saw it
                continue
            raise errors[0]
        raise AssertionError("unreachable")

    def _evalsha(self, sha: str, keys: list[str], args: list[str | int]) -> Any:
        """One EVALSHA through the cluster client (it follows MOVED and ASK); a reply error is returned, not raised."""
        try:
            return self.client.evalsha(sha, len(keys), *keys, *args)
        except ResponseError as exc:
            return exc

    def _script(self) -> str:
        if self._sha is None:
            self._sha = str(self.client.script_load(_APPEND_LUA))
        return self._sha

    # --- pipelined publishing ------------------------------------------------------------------

    def flush(self, *, keep: int = 0) -> None:
        """Read the replies still owed to pipelined publishes, all but the last ``keep``, and act on
        them: fill a gap from the store, log an error. A no-op for a sink that is not pipelined.
        Never raises."""
        if not self.pipelined:
            return
        with self._lock:
            try:
                gaps = self._read_unread(keep)
            except Exception as exc:  # a reply of a shape no publish sends: the store keeps the events
                self._lost(exc, "acting on pipelined replies")
                gaps = []
        for ref in gaps:
            assert self.store is not None
            try:
                self.relay(self.store, ref)
            except Exception as exc:
                self._failed(exc, f"relay of {ref}")

    def _send(self, commands: list[tuple[str, tuple[Any, ...]]], parts: list[_Part | None]) -> int:
        """Send each ``(key, command)`` on the sink's connection to that key's node, owing one reply each (whose it
        is: ``parts``, None for a delta); return how many are owed for them (0: not sent, the sink is quiet or a
        connection failed)."""
        if self._quiet():
            return 0
        with self._lock:
            try:
                return self._wire.send(commands, parts)
            except Exception as exc:
                self._lost(exc, "pipelined publish")
                return 0

    def _read_unread(self, keep: int = 0) -> list[SessionRef]:
        """Read the owed replies in order, all but the last ``keep``; return the sessions whose appends
        found a gap, or did not happen (a cluster node answered MOVED: the slot moved; the relay, which
        follows it, fills the stream from the store)."""
        try:
            replies = self._wire.read(keep)
        except Exception as exc:
            self._lost(exc, "reading pipelined replies")
            return []  # the next publish finds the gap, if one was left
        gaps: list[SessionRef] = []
        for part, reply in replies:
            gap = False
            if isinstance(reply, NoScriptError):
                self._sha = None  # Redis lost its scripts: it lost the streams too, the relay rebuilds them
                gap = True
            elif isinstance(reply, AskError):  # MOVED (a subclass) or ASK: the command ran nowhere
                if isinstance(reply, MovedError):
                    try:
                        self._wire.moved(reply)  # the slot's new node, for the next send
                    except Exception as exc:  # the next send may be told MOVED again; the relay below follows it
                        self._failed(exc, f"learning where slot {reply.slot_id} moved")
                gap = True
            elif isinstance(reply, ResponseError):
                self._failed(reply, f"append to the stream of {part.ref}" if part is not None else "delta")
                continue
            elif part is not None:  # an append's reply: {appended, marker after, first seq refused for a gap}
                self._note(part.ref, part.index, int(reply[1]))
                gap = bool(int(reply[2]))
            if part is not None and gap and part.ref not in gaps:
                gaps.append(part.ref)
        return gaps

    def _lost(self, exc: Exception, what: str) -> None:
        """A connection failed mid-reply: drop the connections and what they owed (the store keeps the events)."""
        self._wire.drop()
        self._failed(exc, what)

    def close(self) -> None:
        """Read what is owed and let the sink's own connections go (the client is the caller's)."""
        self.flush()
        with self._lock:
            self._wire.drop()

    def _quiet(self) -> bool:
        return time.monotonic() < self._quiet_until

    def _failed(self, exc: Exception, what: str) -> None:
        self._quiet_until = time.monotonic() + self.retry_after_s
        log.warning(
            "redis at %s failed during %s: %s: %s; structural events stay in the store for relay, deltas are dropped; "
            "quiet for %.1fs",
            self._where,
            what,
            type(exc).__name__,
            redact(str(exc)),
            self.retry_after_s,
        )


def _xadd(stream: str, fields: dict[str, Any], trim: Trim) -> list[tuple[Any, ...]]:
    """The commands that append one entry and apply ``trim``: XADD with MAXLEN or MINID, or both with XTRIM."""
    op = "=" if trim.exact else "~"
    flat = [x for kv in fields.items() for x in kv]
    minid = trim.minid()
    if trim.maxlen is not None:
        commands: list[tuple[Any, ...]] = [("XADD", stream, "MAXLEN", op, trim.maxlen, "*", *flat)]
        if minid is not None:
            commands.append(("XTRIM", stream, "MINID", op, minid))
        return commands
    if minid is not None:
        return [("XADD", stream, "MINID", op, minid, "*", *flat)]
    return [("XADD", stream, "*", *flat)]
