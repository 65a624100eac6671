"""Thin clients for services that enqueue turns and follow their events. Imports nothing of the engine."""

__all__: list[str] = []
