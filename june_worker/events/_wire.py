"""The connections a pipelined sink writes on without waiting for replies: one Redis, or each node of a cluster.

A pipelined publish sends its commands and returns; their replies are read later, in the order
they were sent (:meth:`Wire.read`). On one Redis everything goes over one connection. On a Redis
Cluster each command goes to the node that owns its key's hash slot, over one connection per
node: a session's appends and deltas (one key, one slot) still share one connection, in order;
its firehose partition may live on another node and is written there.

The rule a reader must not break: **replies are read in the order the commands were sent on each
connection**, and a connection that failed mid-reply is dropped whole with what it owed (the store
keeps the events; the caller relays them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import MovedError

from june_wire.redis_url import health_check_interval_s, is_cluster

__all__ = ["Wire"]

Command = tuple[Any, ...]

_hiredis_pack: Callable[[Command], bytes] | None
try:  # a dependency of redis[hiredis], which the worker installs
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # pragma: no cover - redis-py's own packing serves instead
    _hiredis_pack = None


class Wire:
    """Send now, read the replies later; ``tag`` travels with each reply so the caller knows whose it is."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._cluster = is_cluster(client)
        self._idle_check_s = health_check_interval_s(client)  # a cluster's node pools do not carry it
        self._conns: dict[str, Any] = {}  # node name ("" on one Redis) -> its connection
        self._owed: list[tuple[Any, Any]] = []  # (connection, tag) per reply owed, in send order

    def __len__(self) -> int:
        return len(self._owed)

    def send(self, commands: Sequence[tuple[str, Command]], tags: Sequence[Any]) -> int:
        """Send each ``(key, command)`` to the connection its key lives on, its reply to be read with the tag at the
        same index of ``tags``; return how many replies are owed for them. Raises on a connection error (nothing of
        this call is then owed; earlier replies may be lost too: call :meth:`drop`)."""
        batches: dict[str, list[tuple[Command, Any]]] = {}
        for (key, command), tag in zip(commands, tags, strict=True):
            batches.setdefault(self._node(key), []).append((command, tag))
        for node, batch in batches.items():
            conn = self._connection(node)
            if not any(c is conn for c, _ in self._owed):  # (else a PING's PONG would be read in an owed reply's place)
                _check_idle(conn)
            conn.send_packed_command(_pack(conn, [command for command, _ in batch]), check_health=False)
            self._owed.extend((conn, tag) for _, tag in batch)
        return len(commands)

    def read(self, keep: int = 0) -> list[tuple[Any, Any]]:
        """The owed replies, all but the last ``keep``, as ``(tag, reply)`` in send order; a reply that is an error
        comes back as the exception. A connection error propagates (call :meth:`drop`)."""
        cut = len(self._owed) - keep
        owed, self._owed = self._owed[:cut], self._owed[cut:]
        out: list[tuple[Any, Any]] = []
        for i, (conn, tag) in enumerate(owed):
            try:
                reply = conn.read_response()
            except redis.ResponseError as exc:
                reply = exc
            except BaseException:
                self._owed = owed[i + 1 :] + self._owed  # whoever handles this drops them all
                raise
            out.append((tag, reply))
        return out

    def drop(self) -> None:
        """Forget every reply owed and close every connection (the next send opens new ones)."""
        self._owed = []
        for conn in self._conns.values():
            conn.disconnect()
        self._conns.clear()

    def moved(self, exc: MovedError) -> None:
        """A node answered MOVED: the slot lives on the node it names from now on (no-op on one Redis). An ASK (a
        slot half-way through a move) changes nothing: the next command of that slot asks again."""
        if not self._cluster:
            return
        nodes = self._client.nodes_manager
        if hasattr(nodes, "move_slot"):
            nodes.move_slot(exc)
        else:  # redis-py before 7.2 records it, and applies it at the next lookup through the nodes manager
            nodes.update_moved_exception(exc)
            nodes.get_node_from_slot(exc.slot_id)  # now: get_node_from_key, which the next send asks, reads the cache

    def connection_of(self, key: str) -> Any:
        """The connection this wire writes ``key`` on, if it made one (for tests and diagnostics)."""
        return self._conns.get(self._node(key))

    def _node(self, key: str) -> str:
        return str(self._client.get_node_from_key(key).name) if self._cluster else ""

    def _connection(self, node: str) -> Any:
        conn = self._conns.get(node)
        if conn is None:
            if self._cluster:
                # A node the client has no connection to yet (a slot moved to a node that joined after the client
                # learned the slot map) gets its connection pool here.
                known = self._client.get_node(node_name=node)
                pool = (known.redis_connection or self._client.get_redis_connection(known)).connection_pool
            else:
                pool = self._client.connection_pool
            conn = self._conns[node] = pool.make_connection()
            conn.health_check_interval = self._idle_check_s
        return conn


def _pack(conn: Any, commands: list[Command]) -> list[bytes]:
    """The commands in Redis's protocol, as the chunks ``send_packed_command`` takes (one here).

    The sink's commands hold only str and int, which hiredis packs as redis-py would (UTF-8), at a tenth of the cost
    of redis-py's per-argument encoder (~50 us for a publish's two appends); anything else goes through redis-py,
    which packs it or says why not."""
    if _hiredis_pack is not None:
        try:
            return [b"".join([_hiredis_pack(command) for command in commands])]
        except TypeError:
            pass
    packed: list[bytes] = conn.pack_commands(commands)
    return packed


def _check_idle(conn: Any) -> None:
    """The client's health check: a PING once the connection has been idle for ``health_check_interval``. A
    connection Redis dropped meanwhile (a restart, a proxy's idle timeout) is let go, so the send that follows
    opens a new one instead of failing."""
    try:
        conn.check_health()
    except (redis.ConnectionError, redis.TimeoutError):
        conn.disconnect()
