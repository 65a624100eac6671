"""The Celery side: the app, its tasks, the per-process host, session leases and the sweeper.

``celery -A june_worker.worker worker`` (or ``-A june_worker``) starts a worker.
"""

from .app import app

__all__ = ["app"]
