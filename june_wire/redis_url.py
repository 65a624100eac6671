"""Redis clients from a URL: one Redis (``redis://``, ``rediss://``, ``unix://``) or a Redis Cluster.

A Redis Cluster is named by the scheme ``redis+cluster://`` (``rediss+cluster://`` with TLS),
followed by one or more of its nodes, comma-separated; the client learns the others from them::

    redis+cluster://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379
    rediss+cluster://:secret@redis-0.internal:6380

A cluster has one database, 0: a path other than ``/`` or ``/0`` is refused, and so is a query
string. Only event streams, their markers and the control channels live on such a Redis (every
key of one session shares a hash tag; see :mod:`.keys`); a Celery broker or result backend cannot
be a cluster.

The rule a reader must not break: **every command a client of a cluster sends names keys of one
hash slot** (a pipeline may mix slots: it is split per node, never run as one transaction).

The only module of :mod:`june_wire` that needs ``redis``: the engine never imports it (ruff's TID251).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, TypeAlias
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException

__all__ = [
    "CLUSTER_SCHEMES",
    "UNAVAILABLE",
    "AsyncRedisClient",
    "ClusterAddress",
    "LazyRedisCluster",
    "RedisClient",
    "aconnect",
    "connect",
    "describe",
    "health_check_interval_s",
    "is_cluster",
    "is_cluster_url",
    "parse_cluster_url",
    "redact",
    "socket_timeout_s",
]

UNAVAILABLE: tuple[type[BaseException], ...] = (redis.RedisError, RedisClusterException, OSError)
"""Redis could not answer: one Redis's errors, and a cluster client's own (no node reachable, keys of two slots),
which is not a ``RedisError``."""

RedisClient: TypeAlias = "redis.Redis | RedisCluster"
AsyncRedisClient: TypeAlias = "aioredis.Redis | AsyncRedisCluster"

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

# The user-info up to the authority's last "@" (a password may hold one), and a password given in the query.
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/;\s]*@")
_QUERY_PASSWORD = re.compile(r"(?P<key>[?&](?:password|passwd|pass)=)[^&#;\s]*", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the user-info of every URL in it (``user:password@``) replaced by ``***@`` and a
    ``password=`` in a query by ``password=***``: safe for logs and errors (any URL: Redis, AMQP, Postgres)."""
    return _QUERY_PASSWORD.sub(r"\g<key>***", _USERINFO.sub(r"\g<scheme>***@", text))


def is_cluster_url(url: str) -> bool:
    """True for a ``redis+cluster://`` or ``rediss+cluster://`` URL."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


@dataclass(frozen=True)
class ClusterAddress:
    """Where a cluster's client starts: its seed nodes, credentials, and whether to use TLS."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False


def parse_cluster_url(url: str) -> ClusterAddress:
    """The seed nodes and credentials of a ``redis+cluster://`` URL; ValueError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in CLUSTER_SCHEMES:
        raise ValueError(f"not a Redis Cluster URL: expected {' or '.join(s + '://' for s in CLUSTER_SCHEMES)}")
    split = urlsplit("//" + rest)  # the netloc holds every host:port of the seed list
    if split.path not in ("", "/", "/0"):
        raise ValueError("a Redis Cluster URL names no database but 0 (got a path other than /0)")
    if split.query or split.fragment:
        raise ValueError("a Redis Cluster URL takes no query string or fragment")
    credentials, _, hosts = split.netloc.rpartition("@")
    username, _, password = credentials.partition(":")
    nodes: list[tuple[str, int]] = []
    for part in hosts.split(","):
        host, _, port = part.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("a Redis Cluster URL lists its nodes as host:port, comma-separated")
        nodes.append((host, int(port)))
    return ClusterAddress(
        nodes=tuple(nodes),
        username=unquote(username) or None,
        password=unquote(password) or None,
        tls=scheme.lower() == "rediss+cluster",
    )


class LazyRedisCluster(RedisCluster):
    """A ``RedisCluster`` that learns the slot map on its first use, not in its constructor.

    Like ``redis.Redis``, which connects on its first command: a process that makes its client
    while the cluster is unreachable starts anyway, and its first command raises
    ``redis.ConnectionError`` (tried again at the next command) instead of the constructor. It
    keeps the options it was given (:attr:`options`): ``RedisCluster`` drops some of them, such as
    ``health_check_interval``, that a caller making its own connections to the nodes may want.
    """

    def __init__(self, **options: Any) -> None:  # noqa: D107 - see the class
        self.__dict__["_lazy_options"] = options
        self.__dict__["_lazy_pending"] = True
        self.__dict__["_lazy_lock"] = threading.RLock()
        self.__dict__["_lazy_busy"] = False

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not set yet: the cluster's own state, before its first use.
        state = self.__dict__
        if name.startswith("_lazy") or not state.get("_lazy_pending") or state.get("_lazy_busy"):
            raise AttributeError(name)
        with state["_lazy_lock"]:
            if state["_lazy_pending"]:
                state["_lazy_busy"] = True
                try:
                    RedisCluster.__init__(self, **state["_lazy_options"])
                except RedisClusterException as exc:
                    raise redis.ConnectionError(f"no node of the Redis Cluster answered: {exc}") from exc
                finally:
                    state["_lazy_busy"] = False
                state["_lazy_pending"] = False
        return object.__getattribute__(self, name)

    @property
    def options(self) -> dict[str, Any]:
        """The options this client was made with (``startup_nodes`` and connection options)."""
        return dict(self.__dict__["_lazy_options"])

    @property
    def seeds(self) -> list[str]:
        """``host:port`` of the nodes it was given to start from (never connects)."""
        return [f"{n.host}:{n.port}" for n in self.__dict__["_lazy_options"]["startup_nodes"]]

    def close(self) -> None:
        if not self.__dict__.get("_lazy_pending"):  # nothing to close before the first use
            super().close()


def connect(url: str, **options: Any) -> RedisClient:
    """A client of the Redis at ``url``: ``redis.Redis``, or a ``RedisCluster`` for a cluster URL.

    ``options`` are the connection options both take (``decode_responses``, ``socket_timeout``,
    ``socket_connect_timeout``, ``health_check_interval``, ``retry``...). Neither connects before its
    first command (:class:`LazyRedisCluster`).
    """
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **options)
    where = parse_cluster_url(url)
    return LazyRedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in where.nodes],  # type: ignore[no-untyped-call]
        username=where.username,
        password=where.password,
        ssl=where.tls,
        **options,
    )


def aconnect(url: str, **options: Any) -> AsyncRedisClient:
    """:func:`connect` for ``redis.asyncio``; a cluster client learns its slot map on its first command."""
    if not is_cluster_url(url):
        return aioredis.Redis.from_url(url, **options)
    where = parse_cluster_url(url)
    return AsyncRedisCluster(
        startup_nodes=[AsyncClusterNode(host, port) for host, port in where.nodes],
        username=where.username,
        password=where.password,
        ssl=where.tls,
        **options,
    )


def is_cluster(client: Any) -> bool:
    """True for a client of a Redis Cluster, sync or async."""
    return isinstance(client, RedisCluster | AsyncRedisCluster)


def describe(client: Any) -> str:
    """Where ``client`` connects, without its credentials and without connecting: ``host:port/db``, ``unix:path``,
    or the cluster's seed nodes."""
    if isinstance(client, LazyRedisCluster):
        return f"Redis Cluster {','.join(client.seeds)}"
    if is_cluster(client):
        return f"Redis Cluster {','.join(n.name for n in client.get_nodes())}"
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None) or {}
    if "path" in kwargs:
        return f"unix:{kwargs['path']}"
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}/{kwargs.get('db', 0)}"


def _connection_options(client: Any) -> dict[str, Any]:
    if isinstance(client, LazyRedisCluster):
        return client.options
    if is_cluster(client):
        return dict(client.get_connection_kwargs())
    return dict(getattr(getattr(client, "connection_pool", None), "connection_kwargs", None) or {})


def socket_timeout_s(client: Any) -> float | None:
    """The socket timeout of ``client``'s connections (None: none, or not known)."""
    value = _connection_options(client).get("socket_timeout")
    return float(value) if value else None


def health_check_interval_s(client: Any) -> float:
    """How long ``client``'s connections may sit idle before they PING first (0: never)."""
    return float(_connection_options(client).get("health_check_interval") or 0)
