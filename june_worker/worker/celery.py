"""Lets ``celery -A june_worker.worker ...`` find the app however much of this package is imported already."""

from .app import app

__all__ = ["app"]
