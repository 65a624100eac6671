"""The Celery app. Settings come from the top-level ``celeryconfig`` module (Celery's convention),
which reads the environment; without it, the same defaults are built here.

Start workers with ``celery -A june_worker worker`` (or ``june worker``): ``-A june_worker``
finds this app through :mod:`june_worker.celery`.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from celery import Celery

__all__ = ["app"]

log = logging.getLogger("june_worker.worker")


def _config() -> Any:
    name = os.environ.get("CELERY_CONFIG_MODULE", "celeryconfig")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        from . import defaultconfig

        return defaultconfig


app = Celery("june_worker")
app.config_from_object(_config())
app.autodiscover_tasks(["june_worker.worker"], related_name="tasks", force=True)
