"""What can go wrong when a producer talks to june: one shallow tree.

::

    ProducerError
     ├── ProducerConfigError     (also ValueError)       a setting is wrong; fix it, do not retry
     ├── BrokerUnavailable       (also ConnectionError)  the message was not sent; retry later
     ├── DatabaseUnavailable     (also ConnectionError)  durable=True: Postgres did not record the turn; nothing sent
     ├── ResultUnavailable       (also ConnectionError)  sent, but the answer could not be read
     ├── ResultTimeout           (also TimeoutError)     sent, no answer in time: is a worker on the queue?
     ├── TaskFailed                                      the task raised on the worker
     ├── UnexpectedResult                                the worker answered in a shape this client does not know
     └── StreamGapError                                  events a follow asked for are gone from the stream

Bad arguments (an agent name with a space, an empty input id) are plain ``ValueError`` and are
raised before anything is sent. Every class survives pickling: ``__init__`` passes all of its
arguments to ``super().__init__``.
"""

from __future__ import annotations

from june_wire.errors import StreamGapError as WireStreamGapError

__all__ = [
    "BrokerUnavailable",
    "DatabaseUnavailable",
    "ProducerConfigError",
    "ProducerError",
    "ResultTimeout",
    "ResultUnavailable",
    "StreamGapError",
    "TaskFailed",
    "UnexpectedResult",
]


class ProducerError(Exception):
    """Base class of every error a producer raises on purpose."""

    retryable = False


class ProducerConfigError(ProducerError, ValueError):
    """A setting (URL, queue name, key prefix) is missing or malformed."""


class BrokerUnavailable(ProducerError, ConnectionError):
    """The broker (or, for waited calls, the result backend) refused or did not answer: nothing was sent."""

    retryable = True


class DatabaseUnavailable(ProducerError, ConnectionError):
    """A durable send could not record the turn in Postgres (down, or no answer in time): nothing was sent."""

    retryable = True


class ResultUnavailable(ProducerError, ConnectionError):
    """The message was sent but its result could not be read back; the task may have run."""

    retryable = False


class ResultTimeout(ProducerError, TimeoutError):
    """A task's result did not arrive within the wait; the message stays queued and may still run.

    ``withdrawn`` (``reset``): the message expired before the wait ended, so a worker that takes it
    later discards it instead of running it behind what was sent since.
    """

    def __init__(
        self, task: str, what: str, timeout_s: float, queue: str, task_id: str, withdrawn: bool = False
    ) -> None:
        super().__init__(task, what, timeout_s, queue, task_id, withdrawn)
        self.task, self.what, self.timeout_s, self.queue, self.task_id = task, what, timeout_s, queue, task_id
        self.withdrawn = withdrawn

    def __str__(self) -> str:
        asked = (
            f"{self.task} for {self.what} got no result within {self.timeout_s:g}s (task id {self.task_id}): "
            f"is a june worker consuming queue {self.queue!r}?"
        )
        if not self.withdrawn:
            return f"{asked} The message stays queued and may still run."
        return (
            f"{asked} It was withdrawn: it expired unanswered, and a worker that takes it later discards it, "
            "so it did not happen and will not (unless a worker began it just before it expired: what that "
            "worker recorded stands; read the session to know). Send it again once a worker serves the queue."
        )


class TaskFailed(ProducerError):
    """The task raised on the worker instead of returning its summary."""

    def __init__(self, task: str, what: str, error: str) -> None:
        super().__init__(task, what, error)
        self.task, self.what, self.error = task, what, error

    def __str__(self) -> str:
        return f"{self.task} for {self.what} failed on the worker: {self.error}"


class UnexpectedResult(ProducerError):
    """The task returned something other than the summary this client expects (a version mismatch?)."""


class StreamGapError(ProducerError, WireStreamGapError):
    """Events a follow asked for are no longer in the session stream (trimmed away), or a structural ``seq`` jumped.

    ``first_missing_seq``: the first seq you lack (None when your start id was trimmed and you did not pass
    ``last_seq``); ``next_seq``: the first seq the stream still holds after the gap (None: none yet). Reload
    the missing events from the store (the gateway's ``GET .../sessions/{session}/log?after_seq=``), then
    follow again from ``resume_id`` with ``last_seq=next_seq - 1``. Its fields are
    :class:`june_wire.errors.StreamGapError`'s.
    """
