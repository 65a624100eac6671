"""The Celery side: the app, its tasks, the per-process host, session leases and the sweeper.

``celery -A june_worker worker`` (or ``june worker``) starts a worker. Importing a part of this package (the host,
the queue) does not make the Celery app: ``app`` is loaded when asked for (``celery -A june_worker.worker`` does).

The modules import downwards only: ``tasks`` -> ``process`` -> ``sweeper`` / ``children`` / ``control`` -> ``host``
-> ``queue``, ``inflight``, ``rendering``, ``transcripts``, ``settings``; ``app`` (the Celery app and its signals)
sits beside ``process`` and below ``tasks``, and reaches the host only to load agents.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:  # PEP 562: the Celery app only for whoever asks for it
    if name == "app":
        from .app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
