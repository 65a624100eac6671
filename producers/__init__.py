"""Thin clients for services that enqueue turns and follow their events. Imports nothing of the engine.

::

    from producers import JuneProducer

    producer = JuneProducer.from_env()
    turn_id = producer.start_turn("ops", "s1", "summarize this thread")
    for event in producer.follow("ops", "s1", turn_id=turn_id):   # catch-up, then live; ends on terminal
        print(event.type, event.data)

The rule a reader must not break: nothing here imports ``june_worker``; this package depends
on celery (to send tasks by name), redis and rich (the CLI) only, and on :mod:`june_wire`, the
wire protocol it shares with the workers (standard library and redis). See ``docs/producers.md``.
"""

from june_wire.events import DELTA_TYPES, TERMINAL_TYPES, FollowedEvent
from june_wire.ids import new_turn_id

from .client import JuneProducer
from .errors import (
    BrokerUnavailable,
    DatabaseUnavailable,
    ProducerConfigError,
    ProducerError,
    ResultTimeout,
    ResultUnavailable,
    StreamGapError,
    TaskFailed,
    UnexpectedResult,
)
from .outcomes import ResetOutcome, ResumeOutcome

__all__ = [
    "DELTA_TYPES",
    "TERMINAL_TYPES",
    "BrokerUnavailable",
    "DatabaseUnavailable",
    "FollowedEvent",
    "JuneProducer",
    "ProducerConfigError",
    "ProducerError",
    "ResetOutcome",
    "ResultTimeout",
    "ResultUnavailable",
    "ResumeOutcome",
    "StreamGapError",
    "TaskFailed",
    "UnexpectedResult",
    "new_turn_id",
]
