"""Sending june's tasks by name, and waiting for a control task's summary: where the broker's and the result
backend's failures become :mod:`.errors`.

A :class:`Sender` owns two minimal Celery apps (:mod:`._apps`): one without a result backend for turns
(fire-and-forget: it does not subscribe to every turn's result channel) and one with it for control
messages, whose summary a caller waits for. Sending waits at most ``publish_timeout_s`` per try
(connect, write, and on RabbitMQ the broker's confirm) and tries ``publish_retries`` more times; then
:class:`~.errors.BrokerUnavailable`.

The rule a reader must not break: **an error names where it went wrong without its secrets**: every URL
in a message passes :func:`june_wire.redis_url.redact`, and the message's ``argsrepr`` holds ids only
(:func:`._checks.summary`); ``kwargsrepr`` is empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
from amqp.exceptions import MessageNacked, PreconditionFailed  # py-amqp, kombu's RabbitMQ client
from celery.exceptions import TimeoutError as CeleryTimeoutError
from kombu.exceptions import OperationalError

from june_wire.redis_url import redact

from ._apps import is_amqp, producer_app
from ._checks import positive_timeout
from .errors import BrokerUnavailable, ProducerConfigError, ResultTimeout, ResultUnavailable, TaskFailed

__all__ = ["SEND_ERRORS", "Sender", "cause", "expiry_s"]

# MessageNacked: RabbitMQ refused to confirm a publish.
SEND_ERRORS = (OperationalError, OSError, redis.RedisError, MessageNacked)

_ANSWER_GRACE_S = 5.0


def expiry_s(timeout_s: float) -> float:
    """When a waited message expires, in seconds after it was sent: before the wait ends by a quarter of it, at
    most ``_ANSWER_GRACE_S``, which a worker that began it just in time has to answer."""
    return timeout_s - min(_ANSWER_GRACE_S, timeout_s / 4)


def cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {redact(str(exc)).strip()}"


class Sender:
    """The two Celery apps of one producer, and how a message goes out on them."""

    def __init__(
        self,
        *,
        broker_url: str,
        result_backend: str,
        queue: str,
        control_queue: str,
        transport_options: Mapping[str, Any],
        queue_type: str,
        publish_timeout_s: float,
        publish_retries: int,
        connect_timeout_s: float,
    ) -> None:
        self.broker_url = broker_url
        self.result_backend = result_backend
        self.queue = queue
        self.control_queue = control_queue
        self.publish_timeout_s = publish_timeout_s

        def app(main: str, backend: str | None) -> Any:
            return producer_app(
                main,
                broker_url=broker_url,
                result_backend=backend,
                queues=(queue, control_queue),
                default_queue=queue,
                transport_options=dict(transport_options),
                queue_type=queue_type,
                publish_timeout_s=publish_timeout_s,
                publish_retries=publish_retries,
                connect_timeout_s=connect_timeout_s,
            )

        self.turn_app = app("june-producer", None)
        self.control_app = app("june-producer-control", result_backend)

    def send_turn(self, task: str, payload: dict[str, Any], *, argsrepr: str, headers: dict[str, str] | None) -> None:
        """Send a turn's message to the turn queue; nobody waits for its result."""
        self._send(self.turn_app, task, payload, queue=self.queue, argsrepr=argsrepr, headers=headers)

    def send_control(self, task: str, payload: dict[str, Any], *, argsrepr: str) -> None:
        """Send a control message to the control queue without waiting for how the worker took it."""
        self._send(self.control_app, task, payload, queue=self.control_queue, argsrepr=argsrepr)

    def call(
        self,
        task: str,
        payload: dict[str, Any],
        *,
        what: str,
        argsrepr: str,
        timeout_s: float,
        expiring: bool = False,
    ) -> Any:
        """Send a control task and wait for its summary.

        ``expiring``: the message expires a little before the wait ends (:func:`expiry_s`), so a task no
        worker began in time never runs later; the timeout then says so (``ResultTimeout.withdrawn``).
        """
        timeout_s = positive_timeout(timeout_s)
        expires = expiry_s(timeout_s) if expiring else None
        result = self._send(
            self.control_app, task, payload, queue=self.control_queue, argsrepr=argsrepr, expires=expires
        )
        try:
            # disable_sync_subtasks=False: a service may call this from its own Celery task; the wait
            # is on june's control queue, never on the caller's own pool, so it cannot deadlock it.
            value = result.get(timeout=timeout_s, propagate=False, disable_sync_subtasks=False)
        except CeleryTimeoutError:
            self._abandon(result)
            raise ResultTimeout(task, what, timeout_s, self.control_queue, str(result.id), withdrawn=expiring) from None
        except (*SEND_ERRORS, RuntimeError) as exc:
            reason = exc.__cause__ if isinstance(exc, RuntimeError) else exc
            if not isinstance(reason, SEND_ERRORS):
                raise
            raise ResultUnavailable(
                f"{task} for {what} was sent, but its result could not be read from "
                f"{redact(self.result_backend)} ({cause(reason)}); it may have run"
            ) from exc
        if not result.successful():
            state = result.state
            self._abandon(result)
            if expiring and state == "REVOKED":  # a worker took it after it expired, and discarded it
                raise ResultTimeout(task, what, timeout_s, self.control_queue, str(result.id), withdrawn=True)
            error = f"{type(value).__name__}: {value}" if isinstance(value, BaseException) else repr(value)
            raise TaskFailed(task, what, f"{state} {error}")
        self._abandon(result)  # the summary was read: do not leave it in the backend for a day
        return value

    def close(self) -> None:
        """Close the broker pools and this thread's result-backend connections (Celery keeps a result backend
        per thread; those of other threads close when they are garbage-collected)."""
        backend = self.control_app.backend
        try:
            consumer = getattr(backend, "result_consumer", None)
            if consumer is not None:
                consumer.stop()
            pool = getattr(getattr(backend, "client", None), "connection_pool", None)
            if pool is not None:
                pool.disconnect()
        except SEND_ERRORS:
            pass  # closing: a backend that is gone has nothing left to close
        self.turn_app.close()
        self.control_app.close()

    def _send(
        self,
        app: Any,
        task: str,
        payload: dict[str, Any],
        *,
        queue: str,
        argsrepr: str,
        headers: dict[str, str] | None = None,
        expires: float | None = None,
    ) -> Any:
        options: dict[str, Any] = {}
        if is_amqp(self.broker_url):  # a socket write and the broker's confirm wait this long at most
            options = {"timeout": self.publish_timeout_s, "confirm_timeout": self.publish_timeout_s}
        if expires is not None:  # seconds from now; the message carries the instant, the worker's clock judges it
            options["expires"] = expires
        if headers:
            options["headers"] = headers
        try:
            return app.send_task(task, args=[payload], queue=queue, argsrepr=argsrepr, kwargsrepr="", **options)
        except SEND_ERRORS as exc:
            raise BrokerUnavailable(
                f"could not send {task} {argsrepr} to queue {queue!r}: broker {redact(self.broker_url)} did not "
                f"take it ({cause(exc)}); is it running, and is CELERY_BROKER_URL right?"
            ) from exc
        except PreconditionFailed as exc:
            raise ProducerConfigError(
                f"broker {redact(self.broker_url)} refused queue {queue!r} as declared ({cause(exc)}): it exists "
                "with other arguments; set broker_queue_type (JUNE_BROKER_QUEUE_TYPE) to what the workers use"
            ) from exc
        except RuntimeError as exc:
            # Before publishing a waited task Celery subscribes to its result; when the result
            # backend cannot be reached it gives up with a RuntimeError caused by the connection error.
            if not isinstance(exc.__cause__, SEND_ERRORS):
                raise
            raise BrokerUnavailable(
                f"could not send {task} {argsrepr}: result backend {redact(self.result_backend)} did not answer "
                f"({cause(exc.__cause__)}), so nothing was sent; is it running, and is CELERY_RESULT_BACKEND right?"
            ) from exc

    @staticmethod
    def _abandon(result: Any) -> None:
        """Stop listening for a result and drop it from the backend (best effort)."""
        try:
            result.forget()
        except (*SEND_ERRORS, RuntimeError):
            pass
