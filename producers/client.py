"""JuneProducer: send june's Celery tasks by name and follow a session's events, without the engine.

This module owns the producer's public face: its settings, and one method per message it sends
(``start_turn``, ``proactive``, ``resume``, ``send_resume``, ``cancel``, ``reset``) and per way of
reading events (``follow``, ``afollow``). Each method checks its arguments (:mod:`._checks`), builds
the message's one positional JSON object (see ``docs/producers.md``) and hands it on:

* turns (``june.turn``, ``june.proactive``) go to the turn queue (``JUNE_QUEUE``) and are not
  waited for: the call returns the turn id at once, and the turn's events tell how it went;
* control messages (``june.resume``, ``june.cancel``, ``june.reset``) go to the control queue
  (``JUNE_CONTROL_QUEUE``), so they are not stuck behind long turns, and the call waits for the
  task's small JSON summary through the result backend.

How a message goes out and what a broker's failure becomes is :mod:`._sender`; reading streams is
:mod:`._reader` (over :mod:`june_wire.follow`); the settings' checks and variables are
:mod:`._settings`. With ``durable=True`` a turn is first recorded in june's Postgres (:mod:`._durable`),
so it runs even if the broker loses its message.

The rule a reader must not break: **nothing under ``producers/`` imports ``june_worker``**; the wire
protocol both sides share is :mod:`june_wire`. Services import this package to talk to june; pulling
in the engine (and its dependencies) would defeat it. ``tests/producers/test_isolation.py`` enforces it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Generator, Mapping
from typing import Any

from june_wire.events import FollowedEvent
from june_wire.ids import SENT_AT_HEADER, new_turn_id
from june_wire.keys import EventKeys
from june_wire.redis_url import RedisClient, connect, redact

from . import _checks as check
from ._durable import DurableRecorder, check_event, check_storable, turn_payload
from ._reader import EventReader
from ._sender import Sender
from ._settings import DEFAULT_REDIS_URL, check_settings, settings_from_env
from ._trace import sending
from .errors import BrokerUnavailable, ProducerConfigError
from .metrics import producer_metrics
from .outcomes import ResetOutcome, ResumeOutcome, parse_cancel, parse_reset, parse_resume

__all__ = ["DEFAULT_REDIS_URL", "JuneProducer", "redact"]

log = logging.getLogger("producers")


def _resume_payload(
    agent: str,
    session: str,
    turn_id: str,
    input_id: str,
    value: Any,
    by: str | None,
    principal: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The ``june.resume`` message's fields, each checked (what :meth:`JuneProducer.resume` and
    :meth:`JuneProducer.send_resume` both send)."""
    return {
        "agent": check.agent(agent),
        "session": check.session(session),
        "turn_id": check.turn_id(turn_id),
        "input_id": check.bounded(input_id, "input id", low=1, high=256),
        "value": check.json_value(value, "value"),
        "by": check.bounded(by, "by", low=1, high=256) if by is not None else None,
        "principal": check.json_object(principal, "principal"),
    }


class JuneProducer:
    """Sends ``june.*`` tasks by name and follows session streams; see the module docstring.

    ``redis_url`` is where the event streams are (``JUNE_REDIS_URL``); ``broker_url`` and
    ``result_backend`` default to it, as on the worker. These are the ones used: Celery's variables in
    the process's environment (``CELERY_BROKER_URL``...) do not override them (:mod:`._apps`). ``queue`` / ``control_queue`` /
    ``key_prefix`` must match the worker's ``JUNE_QUEUE`` / ``JUNE_CONTROL_QUEUE`` /
    ``JUNE_KEY_PREFIX``. ``broker_transport_options`` must match the worker's when it sets
    any that change key names (e.g. kombu's ``global_keyprefix``); on RabbitMQ,
    ``broker_queue_type`` must match the worker's ``JUNE_BROKER_QUEUE_TYPE``.

    ``publish_timeout_s`` / ``publish_retries``: how long one try to send may take and how many
    more tries are made before :class:`BrokerUnavailable` (``JUNE_PUBLISH_TIMEOUT_S``,
    ``JUNE_PUBLISH_RETRIES``, as on the worker). ``database_url`` (``JUNE_DATABASE_URL``) and
    ``durable``: see :meth:`start_turn`.

    Safe to share between threads (Celery keeps a result backend per thread). :meth:`afollow`
    uses its own ``redis.asyncio`` connection per call, so it works from any event loop.
    """

    def __init__(
        self,
        redis_url: str = DEFAULT_REDIS_URL,
        *,
        broker_url: str | None = None,
        result_backend: str | None = None,
        queue: str = "june",
        control_queue: str = "june.control",
        key_prefix: str = "june",
        broker_transport_options: Mapping[str, Any] | None = None,
        socket_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        publish_timeout_s: float = 5.0,
        publish_retries: int = 3,
        broker_queue_type: str = "quorum",
        database_url: str | None = None,
        durable: bool = False,
    ) -> None:
        check_settings(
            redis_url=redis_url,
            broker_url=broker_url,
            result_backend=result_backend,
            queue=queue,
            control_queue=control_queue,
            key_prefix=key_prefix,
            broker_queue_type=broker_queue_type,
            publish_timeout_s=publish_timeout_s,
            publish_retries=publish_retries,
            database_url=database_url,
            durable=durable,
        )
        self.redis_url = redis_url
        self.broker_url = broker_url or redis_url
        self.result_backend = result_backend or redis_url
        self.queue = queue
        self.control_queue = control_queue
        self.key_prefix = key_prefix
        self.socket_timeout_s = socket_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.publish_timeout_s = publish_timeout_s
        self.publish_retries = publish_retries
        self.broker_queue_type = broker_queue_type
        self.durable = durable
        self._recorder = DurableRecorder(database_url, timeout_s=publish_timeout_s) if database_url else None
        self._sender = Sender(
            broker_url=self.broker_url,
            result_backend=self.result_backend,
            queue=queue,
            control_queue=control_queue,
            transport_options=dict(broker_transport_options or {}),
            queue_type=broker_queue_type,
            publish_timeout_s=publish_timeout_s,
            publish_retries=publish_retries,
            connect_timeout_s=connect_timeout_s,
        )
        self.redis: RedisClient = connect(
            redis_url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
        )
        self._events = EventReader(
            self.redis,
            redis_url,
            EventKeys(prefix=key_prefix),
            socket_timeout_s=socket_timeout_s,
            connect_timeout_s=connect_timeout_s,
        )
        # Where this producer sends: the broker it was given, never one Celery's variables name (see _apps).
        log.info(
            "producer: turns to queue %r, control to %r, on broker %s; results from %s; events on %s (prefix %r)",
            queue,
            control_queue,
            redact(self.broker_url),
            redact(self.result_backend),
            redact(redis_url),
            key_prefix,
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> JuneProducer:
        """A producer configured by the worker's variables: ``JUNE_REDIS_URL``, ``CELERY_BROKER_URL``,
        ``CELERY_RESULT_BACKEND`` (both default to ``JUNE_REDIS_URL``), ``JUNE_QUEUE`` (``june``),
        ``JUNE_CONTROL_QUEUE`` (``june.control``), ``JUNE_KEY_PREFIX`` (``june``),
        ``JUNE_BROKER_QUEUE_TYPE`` (``quorum``), ``JUNE_PUBLISH_TIMEOUT_S`` (5),
        ``JUNE_PUBLISH_RETRIES`` (3) and ``JUNE_DATABASE_URL`` (only used for ``durable=True``).

        ``overrides`` are passed to the constructor on top of what the environment says.
        """
        settings = settings_from_env(os.environ if env is None else env)
        settings.update(overrides)
        return cls(**settings)

    @property
    def _turn_app(self) -> Any:
        """The Celery app turns are sent with (no result backend)."""
        return self._sender.turn_app

    @property
    def _control_app(self) -> Any:
        """The Celery app control messages are sent with, and their summaries read."""
        return self._sender.control_app

    def __repr__(self) -> str:
        return (
            f"JuneProducer(redis={redact(self.redis_url)!r}, broker={redact(self.broker_url)!r}, "
            f"result_backend={redact(self.result_backend)!r}, queue={self.queue!r}, "
            f"control_queue={self.control_queue!r}, key_prefix={self.key_prefix!r})"
        )

    # --- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the broker pools, this thread's result-backend connections and the Redis client.

        The producer is not usable afterwards. (Celery keeps a result backend per thread; those
        of other threads close when they are garbage-collected.)
        """
        self._sender.close()
        self.redis.close()
        if self._recorder is not None:
            self._recorder.close()

    def __enter__(self) -> JuneProducer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- turns: sent, not waited for -------------------------------------------------------------

    def start_turn(
        self,
        agent: str,
        session: str,
        text: str,
        *,
        event: Mapping[str, Any] | None = None,
        turn_id: str | None = None,
        replace: bool = False,
        trigger: Mapping[str, Any] | None = None,
        target: Mapping[str, Any] | None = None,
        durable: bool | None = None,
    ) -> str:
        """Enqueue a turn (``june.turn``) and return its id at once; follow its events with :meth:`follow`.

        ``turn_id``: give the id of an earlier send to resend the same turn (the worker runs it
        once); by default a new ``t_`` + ULID. ``event``: the inbound event as the channel
        delivered it (``{"source": "slack", "user": {...}, ...}``). ``replace``: cancel the
        session's unfinished turns in favour of this one. ``trigger``:
        ``{"kind": "proactive", "by": "cron:daily"}`` when nobody typed ``text``. ``target``:
        where the agent's ``deliver`` hook renders the finished turn.

        ``durable`` (default: the producer's ``durable``): record the turn in june's Postgres
        first, then send its message. A turn that was recorded runs even if the broker loses the
        message or is down right now (the sweeper sends it again within about a sweep period),
        so then this returns the turn id and logs a warning instead of raising
        :class:`BrokerUnavailable`. Not with ``replace``. A session parked on another turn's
        input records nothing (unless a reset is pending: the turn then queues behind it); the
        message is sent and the worker rejects the turn, as without ``durable``. A string no store can hold (a NUL, a lone surrogate) in ``text``, ``event``,
        ``trigger`` or ``target`` is a ``ValueError`` before anything is recorded or sent (without
        ``durable`` the worker refuses the message and records the rejection).
        :class:`DatabaseUnavailable`: Postgres did not answer; nothing was sent.
        """
        tid = check.turn_id(turn_id) if turn_id is not None else new_turn_id()
        opened_by = check.json_object(trigger, "trigger")
        if opened_by is not None and not isinstance(opened_by.get("kind"), str):
            raise ValueError('invalid trigger: expected {"kind": "proactive", "by": "<who>"}')
        durable = self.durable if durable is None else durable
        payload: dict[str, Any] = {
            "turn_id": tid,
            "agent": check.agent(agent),
            "session": check.session(session),
            "text": check.bounded(text, "text", low=0, high=check.MAX_TEXT),
            "event": check.json_object(event, "event"),
            "trigger": opened_by,
            "replace": bool(replace),
        }
        delivered_to = check.json_object(target, "target")
        if delivered_to is not None:
            payload["target"] = delivered_to
        if durable:
            if replace:
                raise ValueError(
                    "replace=True cannot be durable: the worker cancels the running turn when it records one"
                )
            if opened_by is not None and (
                opened_by.get("kind") != "proactive" or not isinstance(opened_by.get("by"), str)
            ):
                raise ValueError('invalid trigger: expected {"kind": "proactive", "by": "<who>"}')
            check_event(payload["event"])
            check_storable(payload)  # text, event, trigger, target: what the record holds
        where = {"agent": payload["agent"], "session": payload["session"], "turn_id": tid, "queue": self.queue}
        with sending("june.start_turn", **where) as trace_headers:
            recorded = None
            if durable:
                stored = turn_payload(
                    payload["text"],
                    event=payload["event"],
                    trigger_by=opened_by["by"] if opened_by is not None else None,
                    target=delivered_to,
                    trace=trace_headers,
                    queue=self.queue,
                )
                recorded = self._record(payload["agent"], payload["session"], tid, stored)
            # when it was sent, by the producer's clock: the worker's june_turn_queue_wait_seconds counts from it
            stamped = {**(trace_headers or {}), SENT_AT_HEADER: repr(time.time())}
            self._send_turn("june.turn", payload, tid, recorded, headers=stamped)
        return tid

    def proactive(
        self,
        agent: str,
        session: str,
        text: str,
        *,
        by: str,
        target: Mapping[str, Any] | None = None,
        turn_id: str | None = None,
        durable: bool | None = None,
    ) -> str:
        """Enqueue a turn nobody typed (``june.proactive``), e.g. from a scheduler; returns its turn id.

        ``by`` says who started it (``cron:daily``); ``target`` is where the agent's delivery
        hook renders the result (a channel, a thread...). ``durable``: as for :meth:`start_turn`
        (a NUL or a lone surrogate in ``text``, ``by`` or ``target`` is a ``ValueError`` then).
        """
        tid = check.turn_id(turn_id) if turn_id is not None else new_turn_id()
        payload: dict[str, Any] = {
            "turn_id": tid,
            "agent": check.agent(agent),
            "session": check.session(session),
            "text": check.bounded(text, "text", low=1, high=check.MAX_TEXT),
            "by": check.bounded(by, "by", low=1, high=256),
            "target": check.json_object(target, "target"),
        }
        durable = self.durable if durable is None else durable
        if durable:
            check_storable(payload)  # text, by, target: what the record holds
        where = {"agent": payload["agent"], "session": payload["session"], "turn_id": tid, "queue": self.queue}
        with sending("june.proactive", **where) as trace_headers:
            recorded = None
            if durable:
                stored = turn_payload(
                    payload["text"],
                    trigger_by=payload["by"],
                    target=payload["target"],
                    trace=trace_headers,
                    queue=self.queue,
                )
                recorded = self._record(payload["agent"], payload["session"], tid, stored)
            self._send_turn("june.proactive", payload, tid, recorded, headers=trace_headers)
        return tid

    def _record(self, agent: str, session: str, turn_id: str, stored: str) -> bool | None:
        if self._recorder is None:
            raise ProducerConfigError("durable=True needs database_url (JUNE_DATABASE_URL): june's Postgres")
        return self._recorder.record(agent, session, turn_id, stored)

    def _send_turn(
        self,
        task: str,
        payload: dict[str, Any],
        turn_id: str,
        recorded: bool | None,
        *,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Send a turn's message; if it was recorded first (durable), a broker that is down is only logged.

        ``headers``: the trace context of the producer's span (W3C ``traceparent``), in the message's headers."""
        argsrepr = check.summary(agent=payload["agent"], session=payload["session"], turn_id=turn_id)
        try:
            self._sender.send_turn(task, payload, argsrepr=argsrepr, headers=headers)
        except BrokerUnavailable as exc:
            if recorded is None:
                raise
            log.warning("%s; turn %s is recorded in Postgres, the sweeper will send it", exc, turn_id)
            producer_metrics().durable_fallback(task)

    # --- control: sent to the control queue, waited for ------------------------------------------

    def resume(
        self,
        agent: str,
        session: str,
        turn_id: str,
        input_id: str,
        value: Any,
        *,
        by: str | None = None,
        principal: Mapping[str, Any] | None = None,
        timeout_s: float = 30,
    ) -> ResumeOutcome:
        """Answer a parked turn's input request (``june.resume``) and return how the worker took it.

        ``by``: the identity of whoever answered, as your service verified it (the worker checks
        it against the request's answerers). Only an ``accepted`` outcome resumes the turn; follow
        its events from the last stream id you saw to watch it continue.
        """
        payload = _resume_payload(agent, session, turn_id, input_id, value, by, principal)
        result = self._sender.call(
            "june.resume",
            payload,
            what=f"turn {turn_id} of {agent}:{session}",
            argsrepr=check.summary(agent=agent, session=session, turn_id=turn_id, input_id=input_id),
            timeout_s=timeout_s,
        )
        return parse_resume(result)

    def send_resume(
        self,
        agent: str,
        session: str,
        turn_id: str,
        input_id: str,
        value: Any,
        *,
        by: str | None = None,
        principal: Mapping[str, Any] | None = None,
        reply_to: Mapping[str, Any] | None = None,
    ) -> None:
        """Send ``june.resume`` without waiting for how the worker took it (a channel that must answer at once).

        ``reply_to``: a channel target naming the answerer; a refused answer is told to them there
        (a Slack ephemeral note), since nobody waits here to hear it.
        """
        payload = _resume_payload(agent, session, turn_id, input_id, value, by, principal)
        payload["reply_to"] = check.json_object(reply_to, "reply_to")
        argsrepr = check.summary(agent=agent, session=session, turn_id=turn_id, input_id=input_id)
        self._sender.send_control("june.resume", payload, argsrepr=argsrepr)

    def cancel(self, agent: str, session: str, turn_id: str | None = None, *, timeout_s: float = 30) -> dict[str, Any]:
        """Cancel one turn, or every unfinished turn of the session (``june.cancel``).

        Returns the worker's summary, ``{"status": ..., "turn_ids": [...]}``. A running turn
        stops at its next checkpoint; its events end with ``turn.cancelled``.
        """
        payload: dict[str, Any] = {
            "agent": check.agent(agent),
            "session": check.session(session),
            "turn_id": check.turn_id(turn_id) if turn_id is not None else None,
        }
        what = f"turn {turn_id} of {agent}:{session}" if turn_id else f"session {agent}:{session}"
        result = self._sender.call(
            "june.cancel",
            payload,
            what=what,
            argsrepr=check.summary(agent=agent, session=session, turn_id=turn_id),
            timeout_s=timeout_s,
        )
        return parse_cancel(result)

    def reset(self, agent: str, session: str, *, timeout_s: float = 60) -> ResetOutcome:
        """Retire the session's history under its current generation (``june.reset``).

        Returns once a worker has recorded the reset: ``reset`` (done) or ``pending`` (the session is busy; the
        worker running it resets it when its turn ends). Either way, a turn sent after this returns runs on the
        new generation, also on a parked session (S90), whichever queue a worker serves first. No answer within
        ``timeout_s`` is a :class:`ResultTimeout` with ``withdrawn``: the message expired a little before the
        wait ended, and a worker that takes it later discards it, so the reset will not happen behind turns
        sent since.
        """
        payload: dict[str, Any] = {"agent": check.agent(agent), "session": check.session(session)}
        result = self._sender.call(
            "june.reset",
            payload,
            what=f"session {agent}:{session}",
            argsrepr=check.summary(agent=agent, session=session),
            timeout_s=timeout_s,
            expiring=True,
        )
        return parse_reset(result)

    # --- events ----------------------------------------------------------------------------------

    def stream_key(self, agent: str, session: str) -> str:
        """The session's stream, ``<prefix>:events:{<agent>:<session>}``."""
        return self._events.stream_key(agent, session)

    def last_stream_id(self, agent: str, session: str) -> str:
        """The id of the session stream's newest entry (``"0-0"`` when empty): follow from it to see only what comes next."""
        return self._events.last_stream_id(agent, session)

    def follow(
        self,
        agent: str,
        session: str,
        *,
        turn_id: str | None = None,
        last_id: str = "0-0",
        timeout_s: float | None = None,
        block_ms: int = 5000,
        include_deltas: bool = True,
        count: int = 100,
        last_seq: int | None = None,
    ) -> Generator[FollowedEvent, None, None]:
        """A session's events after ``last_id``: what the stream holds, then new ones as they come.

        ``last_id``: ``"0-0"`` from the start, a ``stream_id`` you saw to continue after it
        (nothing missed, nothing repeated), ``"$"`` for only what comes after this call. With
        ``turn_id``: only that turn's events, ending after its terminal event
        (``turn.completed`` / ``turn.failed`` / ``turn.cancelled`` / ``input.requested``).
        ``timeout_s``: stop waiting for new events after this long (``0``: catch up, then stop);
        without a turn id and without a timeout it follows until you stop iterating.
        ``last_seq``: the last structural ``seq`` you hold, when you continue from a ``stream_id``.
        Events the stream no longer holds raise :class:`~producers.errors.StreamGapError` (first
        missing seq, how to reload, where to go on), never skipped. Redis errors propagate: follow
        again from the last ``stream_id`` you handled.
        """
        state = self._events.state(agent, session, turn_id, last_id, timeout_s, block_ms, include_deltas, last_seq)
        return self._events.follow(state, count)

    async def afollow(
        self,
        agent: str,
        session: str,
        *,
        turn_id: str | None = None,
        last_id: str = "0-0",
        timeout_s: float | None = None,
        block_ms: int = 5000,
        include_deltas: bool = True,
        count: int = 100,
        last_seq: int | None = None,
    ) -> AsyncGenerator[FollowedEvent, None]:
        """:meth:`follow` on ``redis.asyncio``, with the same contract (``"$"`` is pinned when iteration starts).

        It opens its own connection and closes it when the iteration ends; if you stop early,
        close the iterator (``async with contextlib.aclosing(producer.afollow(...)) as events``).
        """
        state = self._events.state(agent, session, turn_id, last_id, timeout_s, block_ms, include_deltas, last_seq)
        async with contextlib.aclosing(self._events.afollow(state, count)) as events:
            async for event in events:
                yield event
