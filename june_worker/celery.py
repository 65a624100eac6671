"""Lets ``celery -A june_worker ...`` find the app (Celery looks for a ``celery`` submodule)."""

from .worker.app import app

__all__ = ["app"]
