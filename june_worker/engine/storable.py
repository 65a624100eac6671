"""The storable-string rules, for the modules that import them from here (the turn loop's, the worker's): they
live in :mod:`june_wire.storable` (durable producers judge strings by the same), and this module holds no logic."""

from june_wire.storable import storable_json, storable_text, unstorable_reason

__all__ = ["storable_json", "storable_text", "unstorable_reason"]
