"""Kept only for ``june_worker/worker/settings.py``, the one importer left, which the settings-layer change
rewrites: the names live in :mod:`june_wire.keys`. Delete this module once that importer imports from there."""

from june_wire.keys import default_firehose_partitions

__all__ = ["default_firehose_partitions"]
