"""Celery settings for june-worker, from the environment (see :mod:`june_worker.worker.settings`).

The repository's top-level ``celeryconfig.py`` re-exports these; copy that file to change them.
"""

from __future__ import annotations

import json

from ..schedules import schedule
from .broker import celery_options
from .settings import WorkerEnv, WorkerSettings

_s = WorkerSettings.from_env()
_e = WorkerEnv.load()

broker_url = _s.broker_url
result_backend = _s.result_backend
broker_connection_retry_on_startup = True

# Per broker (june_worker/worker/broker.py): the queues (durable; quorum on RabbitMQ), persistent
# messages, publisher confirms on RabbitMQ, the Redis visibility timeout tied to the lease, and a
# publish that gives up after a bounded time instead of hanging.
_broker = celery_options(_s)
task_queues = _broker["task_queues"]
task_create_missing_queue_type = _broker["task_create_missing_queue_type"]
task_default_delivery_mode = _broker["task_default_delivery_mode"]
broker_transport_options = _broker["broker_transport_options"]
broker_connection_timeout = _broker["broker_connection_timeout"]
task_publish_retry = _broker["task_publish_retry"]
task_publish_retry_policy = _broker["task_publish_retry_policy"]

# JSON only: a pickled message is refused before it reaches a task.
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

# A message is acknowledged after its task ran; a killed worker's message goes back to the queue. It is not
# redelivered forever: the statement that picks a turn counts its start (worker/queue.py), and a turn started
# JUNE_MAX_ATTEMPTS times is given up as poison.
task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1
task_track_started = False  # no STARTED state: one result-backend write less per task
result_expires = 24 * 3600
# One result backend (and its Redis connection pool) for the whole process, not one per thread: with many turns per
# process (the threads pool) each of its N threads would make its own at its first task (redis-py's backend is
# safe to share between threads).
result_backend_thread_safe = True
result_extended = False  # True would store each task's arguments (text, answers) with its result

task_default_queue = _s.queue
task_routes = {
    "june.resume": {"queue": _s.control_queue},
    "june.cancel": {"queue": _s.control_queue},
    "june.reset": {"queue": _s.control_queue},
    "june.sweep": {"queue": _s.control_queue},
}

# Task events, for Flower and `celery events`. They cost every task a few PUBLISHes (about 40 % of
# an empty task's CPU here); JUNE_TASK_EVENTS=0 turns them off where nothing watches.
worker_send_task_events = _s.task_events
task_send_sent_event = True

beat_schedule: dict[str, dict[str, object]] = {
    "june-sweep": {
        "task": "june.sweep",
        "schedule": _s.sweep_s,
        "args": [{}],
        "options": {"queue": _s.control_queue, "expires": max(_s.sweep_s, 1.0)},
    },
}

# june's scheduler: in memory (no celerybeat-schedule files), a fresh turn id per proactive turn (worker/beat.py)
beat_scheduler = "june_worker.worker.beat:Scheduler"

if _e.example_schedule:
    # An example proactive turn (README, "Turns on a schedule"): the ops agent summarizes its day. Tests set the
    # period short.
    beat_schedule.update(
        schedule(
            "daily-digest",
            agent=_e.example_agent,
            session=_e.example_session,
            text="Summarize today's open threads and post the highlights.",
            every=_e.example_schedule_every_s,
            by="cron:daily",
            # where the agent's channel delivers it, e.g. {"channel": "slack", "channel_id": "C024BE91L"}
            target=json.loads(_e.example_target) if _e.example_target else None,
        )
    )
