"""SessionStore implementations: memory (tests), SQLite (embedded default), Postgres (workers).

``PostgresStore`` is imported lazily so that the embedded default needs no driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .memory import MemoryStore
from .sqlite import SQLiteStore

if TYPE_CHECKING:
    from .postgres import PostgresStore

__all__ = ["MemoryStore", "PostgresStore", "SQLiteStore"]


def __getattr__(name: str) -> Any:
    if name == "PostgresStore":
        from .postgres import PostgresStore

        return PostgresStore
    raise AttributeError(name)
