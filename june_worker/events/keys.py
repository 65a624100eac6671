"""Redis key names, for the worker's modules that import them from here: they live in :mod:`june_wire.keys`
(the producers use the same), and this module holds no logic of its own."""

from june_wire.keys import DEFAULT_KEYS, EventKeys, broker_unacked_keys, default_firehose_partitions

__all__ = ["DEFAULT_KEYS", "EventKeys", "broker_unacked_keys", "default_firehose_partitions"]
