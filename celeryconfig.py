"""Celery settings for june-worker (Celery reads this module by name: ``celeryconfig``).

Every value comes from the environment; docs/settings.md lists them (JUNE_DATABASE_URL,
JUNE_REDIS_URL, CELERY_BROKER_URL, JUNE_LEASE_S, JUNE_SWEEP_S, ...). The beat schedule runs the
sweeper every JUNE_SWEEP_S seconds and, with JUNE_EXAMPLE_SCHEDULE=1, an example proactive turn
("daily-digest"). Add your own turns with june_worker.schedule(...) (README, "Turns on a schedule").
"""

from june_worker.worker.defaultconfig import *  # noqa: F403
from june_worker.worker.defaultconfig import beat_schedule  # noqa: F401
