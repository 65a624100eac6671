"""Redis clients from a URL, for the worker's modules that import them from here: they live in
:mod:`june_wire.redis_url` (the producers use the same), and this module holds no logic of its own."""

from june_wire.redis_url import connect, is_cluster_url, parse_cluster_url

__all__ = ["connect", "is_cluster_url", "parse_cluster_url"]
