"""Noticing that Redis lost its data, so that the sweeper rebuilds every stream the outbox can still fill.

A stream is refilled from the outbox when a publish finds it behind (its marker gone or short), and the
sweeper relays the sessions whose relay mark in Postgres (``relayed_seq``) is behind their outbox. Neither
reaches a session whose turns all finished before Redis lost its data: nothing publishes to it again, and
its mark, which only moves forward, says its stream is complete. Its followers would wait for good.

So each Redis holds an **epoch key** (:meth:`.keys.EventKeys.epoch`; on a Redis Cluster one per primary,
named so that it hashes to a slot that node serves) whose value is the ``run_id`` of the server that wrote
it, and which never expires. Every sweep reads them with the servers' ``run_id`` (``INFO server``): one
round trip, on a cluster one per node and a pipeline; a turn pays nothing. A key gone, or written by another
run of its server, means that Redis (that node) may have lost data: it restarted (without persistence, from
an older snapshot, or from an append-only file short of its last second), was flushed, or a replica took
over. The sweeper then records a **rebuild pass** (:meth:`.keys.EventKeys.rebuild_pass`), writes the epoch
keys again, and pages through every session with events in the outbox, in key order, relaying each whose
stream (or firehose partition) is behind it; after each page it records how far it got, so that a sweep
cut short goes on from there at the next one, and the pass is deleted once every session was seen. A
restart that lost nothing costs one such pass, which finds the streams complete.

The rule a reader must not break: **the pass is recorded before the epoch keys are written again.** A sweep
that dies in between leaves a key still stale (the next sweep begins again) or a pass recorded (the next
sweep goes on with it), never a loss nobody will repair. A pass is only moved on or ended by a sweep that
runs that same pass (its id): two sweeps that overlap never end a pass a later loss began.

Limits: a key evicted alone (an ``allkeys-*`` or ``volatile-*`` eviction policy: the session keys have a time
to live) is not noticed; keep Redis on ``noeviction``. Streams whose keys expired (``JUNE_STREAM_TTL_S``) are
no loss: they stay gone until their session publishes again, unless a pass after a loss finds them first.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from redis.cluster import RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from june_wire.keys import EventKeys, SessionRef
from june_wire.redis_url import RedisClient

__all__ = ["RebuildPass", "epoch_keys", "finish_pass", "move_pass", "pending_pass"]

# KEYS[1] the pass key. ARGV[1] the id of the pass the caller runs; ARGV[2] its new value, '' to delete it.
# Only the pass the caller runs is moved on or deleted: one a later loss began is left as it is.
_IF_SAME_PASS_LUA = """
local current = redis.call('GET', KEYS[1])
if not current then return 0 end
local ok, decoded = pcall(cjson.decode, current)
if not ok or type(decoded) ~= 'table' or decoded['pass'] ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2]) end
return 1
"""


@dataclass(frozen=True, slots=True)
class RebuildPass:
    """A pass over the outbox's sessions after a data loss: its id, and the last session it checked."""

    pass_id: str
    after: SessionRef | None
    """None: from the first session on."""
    began: bool = False
    """True when the call that returned it found the loss (and recorded the pass)."""

    def encode(self, after: SessionRef | None) -> str:
        where = None if after is None else [after.agent, after.session]
        return json.dumps({"pass": self.pass_id, "after": where}, separators=(",", ":"))


def _decode(raw: Any) -> RebuildPass | None:
    """A recorded pass, or None for a value that is not one (then a new pass begins)."""
    try:
        value = json.loads(raw)
        pass_id, where = value["pass"], value["after"]
        after = None if where is None else SessionRef(str(where[0]), str(where[1]))
    except (TypeError, ValueError, KeyError, IndexError):
        return None
    return RebuildPass(str(pass_id), after) if isinstance(pass_id, str) else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _owners(client: RedisCluster, keys: EventKeys) -> dict[str, Any]:
    """Epoch key -> the primary that serves its slot: one key per primary that serves slots, each the first
    :meth:`~.keys.EventKeys.epoch` whose slot that node serves (by the client's slot map)."""
    owners = {slot: nodes[0] for slot, nodes in client.nodes_manager.slots_cache.items() if nodes}
    wanted = {node.name for node in owners.values()}
    found: dict[str, tuple[str, Any]] = {}
    n = 0
    while len(found) < len(wanted) and n < 8 * REDIS_CLUSTER_HASH_SLOTS:  # one slot's node is found by ~16384
        key = keys.epoch(n)
        owner = owners.get(key_slot(key.encode()))
        if owner is not None and owner.name not in found:
            found[owner.name] = (key, owner)
        n += 1
    return dict(sorted(found.values(), key=lambda kv: kv[0]))


def epoch_keys(client: RedisClient, keys: EventKeys) -> list[str]:
    """The epoch keys to look at: one on one Redis, one per primary (that serves slots) on a cluster."""
    return list(_owners(client, keys)) if isinstance(client, RedisCluster) else [keys.epoch(0)]


def _read(client: RedisClient, keys: EventKeys) -> tuple[dict[str, str], dict[str, str | None], Any]:
    """(epoch key -> the ``run_id`` of the server holding it now, epoch key -> its value, the recorded pass)."""
    if isinstance(client, RedisCluster):
        servers = {
            key: _text(client.info("server", target_nodes=node)["run_id"])
            for key, node in _owners(client, keys).items()
        }
        untyped: Any = client  # RedisCluster.pipeline has no annotations
        pipe: Any = untyped.pipeline(transaction=False)
        for key in servers:
            pipe.get(key)
        pipe.get(keys.rebuild_pass())
        *values, recorded = pipe.execute()
    else:
        key = keys.epoch(0)
        pipe = client.pipeline(transaction=False)
        pipe.info("server")
        pipe.get(key)
        pipe.get(keys.rebuild_pass())
        info, value, recorded = pipe.execute()
        servers, values = {key: _text(info["run_id"])}, [value]
    return servers, {k: None if v is None else _text(v) for k, v in zip(servers, values, strict=True)}, recorded


def pending_pass(client: RedisClient, keys: EventKeys) -> RebuildPass | None:
    """The rebuild pass to run now, or None: Redis kept its data and no pass is left unfinished.

    In the normal case one round trip (on a cluster, one per node and a pipeline). When an epoch key is gone,
    or was written by another run of its server (it restarted, or a replica took over), a new pass is recorded
    first, then the epoch keys are written again (see the module docstring); it is returned with ``began``
    set. Redis errors propagate.
    """
    servers, values, recorded = _read(client, keys)
    if all(values[key] == run_id for key, run_id in servers.items()):
        return None if recorded is None else _decode(recorded) or _begin(client, keys, servers)
    return _begin(client, keys, servers)


def _begin(client: RedisClient, keys: EventKeys, servers: dict[str, str]) -> RebuildPass:
    rebuild = RebuildPass(uuid.uuid4().hex, None, began=True)
    client.set(keys.rebuild_pass(), rebuild.encode(None))  # first: a sweep that dies now leaves the pass to do
    pipe: Any = client.pipeline(transaction=False)
    for key, run_id in servers.items():
        pipe.set(key, run_id)
    pipe.execute()
    return rebuild


def move_pass(client: RedisClient, keys: EventKeys, rebuild: RebuildPass, after: SessionRef) -> bool:
    """Record that ``rebuild`` checked every session up to ``after``; False if another pass replaced it."""
    return bool(client.eval(_IF_SAME_PASS_LUA, 1, keys.rebuild_pass(), rebuild.pass_id, rebuild.encode(after)))


def finish_pass(client: RedisClient, keys: EventKeys, rebuild: RebuildPass) -> bool:
    """Delete ``rebuild``: every session was checked. False if another pass replaced it (that one goes on)."""
    return bool(client.eval(_IF_SAME_PASS_LUA, 1, keys.rebuild_pass(), rebuild.pass_id, ""))
