"""Kept only for ``june_worker/worker/settings.py``, the one importer left, which the settings-layer change
rewrites: the names live in :mod:`june_wire.redis_url`. Delete this module once that importer imports from there."""

from june_wire.redis_url import is_cluster_url, parse_cluster_url

__all__ = ["is_cluster_url", "parse_cluster_url"]
