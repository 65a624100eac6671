"""JuneProducer: send june's Celery tasks by name and follow a session's events, without the engine.

A producer owns two minimal Celery apps (no task modules, JSON only) and a Redis client:

* turns (``june.turn``, ``june.proactive``) go to the turn queue (``JUNE_QUEUE``) and are not
  waited for: the call returns the turn id at once, and the turn's events tell how it went;
* control messages (``june.resume``, ``june.cancel``, ``june.reset``) go to the control queue
  (``JUNE_CONTROL_QUEUE``), so they are not stuck behind long turns, and the call waits for the
  task's small JSON summary through the result backend.

Every message is ONE positional JSON object (see ``docs/producers.md``). Its ``argsrepr`` (what
Flower and worker logs show) is a short summary of ids, never the text, the inbound event, an
answer's value or anything else that could hold a secret; ``kwargsrepr`` is empty.

Sending waits at most ``publish_timeout_s`` per try (connect, write, and on RabbitMQ the
broker's confirm) and tries ``publish_retries`` more times; then :class:`BrokerUnavailable`.
On RabbitMQ the queues are declared as the workers declare them (durable, quorum by default).
With ``durable=True`` a turn is first recorded in june's Postgres (:mod:`._durable`), so it
runs even if the broker loses its message.

The rule a reader must not break: **nothing under ``producers/`` imports ``june_worker``**.
Services import this package to talk to june; pulling in the engine (and its dependencies)
would defeat it. ``tests/producers/test_isolation.py`` enforces it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import AsyncGenerator, Generator, Mapping
from typing import Any

import redis
from amqp.exceptions import MessageNacked, PreconditionFailed  # py-amqp, kombu's RabbitMQ client
from celery.exceptions import TimeoutError as CeleryTimeoutError
from kombu.exceptions import OperationalError

from ._apps import QUEUE_TYPES, is_amqp, producer_app
from ._durable import DurableRecorder, check_event, check_storable, turn_payload
from ._follow import FollowState, safe_block_ms
from ._gaps import SCAN, judge_start, queue_start_check
from ._redis_url import RedisClient, aconnect, connect, is_cluster_url, parse_cluster_url
from ._trace import sending
from ._ulid import new_turn_id
from .errors import BrokerUnavailable, ProducerConfigError, ResultTimeout, ResultUnavailable, TaskFailed
from .events import FollowedEvent, session_stream
from .outcomes import ResetOutcome, ResumeOutcome, parse_cancel, parse_reset, parse_resume

__all__ = ["DEFAULT_REDIS_URL", "JuneProducer", "redact"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

# The worker's own rules (june_worker/worker/payloads.py), checked here so a bad name fails at
# the call, before anything is sent, instead of as a rejection on the worker.
_AGENT_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_SESSION_RE = re.compile(r"^[\x21-\x7e]{1,256}$")
_TURN_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_STREAM_ID_RE = re.compile(r"^(\d+(-\d+)?|\$)$")
_MAX_TEXT = 200_000
# The user-info up to the authority's last "@" (a password may hold one), and a password given in the query.
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/;\s]*@")
_QUERY_PASSWORD = re.compile(r"(?P<key>[?&](?:password|passwd|pass)=)[^&#;\s]*", re.IGNORECASE)
# MessageNacked: RabbitMQ refused to confirm a publish.
_SEND_ERRORS = (OperationalError, OSError, redis.RedisError, MessageNacked)

_ANSWER_GRACE_S = 5.0

log = logging.getLogger("producers")


def redact(url: str) -> str:
    """``url`` with its user-info (``user:password@``) replaced by ``***@`` and a ``password=`` in its query by
    ``password=***``: safe for logs and errors."""
    return _QUERY_PASSWORD.sub(r"\g<key>***", _USERINFO.sub(r"\g<scheme>***@", url))


def _check_name(value: object, pattern: re.Pattern[str], what: str, expected: str) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise ValueError(f"invalid {what} {value!r}: expected {expected}")
    return value


def _agent(value: object) -> str:
    return _check_name(value, _AGENT_RE, "agent name", "1-128 characters of A-Z a-z 0-9 _ . -")


def _session(value: object) -> str:
    return _check_name(value, _SESSION_RE, "session id", "1-256 printable ASCII characters, no spaces")


def _turn_id(value: object) -> str:
    return _check_name(value, _TURN_ID_RE, "turn id", "1-128 characters of A-Z a-z 0-9 _ . : -")


def _bounded(value: object, what: str, *, low: int, high: int) -> str:
    if not isinstance(value, str) or not low <= len(value) <= high:
        raise ValueError(f"invalid {what}: expected a string of {low}-{high} characters")
    return value


def _json_object(value: Mapping[str, Any] | None, what: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"invalid {what}: expected a JSON object (a mapping), got {type(value).__name__}")
    _json_value(value, what)
    return dict(value)


def _json_value(value: Any, what: str) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid {what}: it does not serialize to JSON ({exc})") from None
    return value


def _timeout(value: float) -> float:
    if not value > 0:
        raise ValueError(f"timeout_s must be positive, not {value}")
    return value


def _env_number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ProducerConfigError(f"{name}={raw!r} is not a number") from None


def _expiry_s(timeout_s: float) -> float:
    """When a waited message expires, in seconds after it was sent: before the wait ends by a quarter of it, at
    most ``_ANSWER_GRACE_S``, which a worker that began it just in time has to answer."""
    return timeout_s - min(_ANSWER_GRACE_S, timeout_s / 4)


def _cause(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {redact(str(exc)).strip()}"


def _summary(**fields: str | None) -> str:
    """The ``argsrepr`` of a message: ids only, ``{agent=ops session=s1 turn_id=t_...}``."""
    return "{" + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None) + "}"


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
        for name, value in (("queue", queue), ("control_queue", control_queue)):
            if not isinstance(value, str) or not value or any(c.isspace() for c in value):
                raise ProducerConfigError(f"invalid {name} {value!r}: expected a non-empty queue name without spaces")
        if not key_prefix or any(c in key_prefix for c in "{} \r\n\t"):
            raise ProducerConfigError(
                f"invalid key prefix {key_prefix!r}: expected a non-empty name without braces or spaces"
            )
        for name, url in (("redis_url", redis_url), ("broker_url", broker_url), ("result_backend", result_backend)):
            if url is not None and (not isinstance(url, str) or "://" not in url):
                raise ProducerConfigError(f"invalid {name}: expected a URL such as redis://host:6379/0")
        if broker_queue_type not in QUEUE_TYPES:
            raise ProducerConfigError(f"invalid broker_queue_type {broker_queue_type!r}: expected one of {QUEUE_TYPES}")
        if not publish_timeout_s > 0 or not isinstance(publish_retries, int) or publish_retries < 0:
            raise ProducerConfigError(
                f"invalid publish_timeout_s={publish_timeout_s!r} / publish_retries={publish_retries!r}: "
                "expected a positive number of seconds and a count of 0 or more"
            )
        for name, url in (("broker_url", broker_url or redis_url), ("result_backend", result_backend or redis_url)):
            if is_cluster_url(url):
                raise ProducerConfigError(
                    f"{name} is a Redis Cluster: a cluster holds june's events only; give {name} a single Redis "
                    "(redis://) or, for the broker, RabbitMQ (amqp://)"
                )
        if is_cluster_url(redis_url):
            try:
                parse_cluster_url(redis_url)
            except ValueError as exc:
                raise ProducerConfigError(f"invalid redis_url: {exc}") from None
        if durable and not database_url:
            raise ProducerConfigError("durable=True needs database_url (JUNE_DATABASE_URL): june's Postgres")
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
        options = dict(broker_transport_options or {})
        # Turns are fire-and-forget: an app without a result backend does not subscribe to
        # every turn's result channel. Control calls wait, so their app has one.
        self._turn_app = self._app("june-producer", None, options)
        self._control_app = self._app("june-producer-control", self.result_backend, options)
        self.redis: RedisClient = connect(
            redis_url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
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
        if env is None:
            env = os.environ
        for name in (
            "JUNE_REDIS_URL",
            "CELERY_BROKER_URL",
            "CELERY_RESULT_BACKEND",
            "JUNE_QUEUE",
            "JUNE_CONTROL_QUEUE",
            "JUNE_KEY_PREFIX",
            "JUNE_BROKER_QUEUE_TYPE",
            "JUNE_PUBLISH_TIMEOUT_S",
            "JUNE_PUBLISH_RETRIES",
            "JUNE_DATABASE_URL",
        ):
            if name in env and not env[name].strip():
                raise ProducerConfigError(f"{name} is set but empty; unset it for the default or give a value")
        redis_url = env.get("JUNE_REDIS_URL", DEFAULT_REDIS_URL)
        settings: dict[str, Any] = {
            "redis_url": redis_url,
            "broker_url": env.get("CELERY_BROKER_URL", redis_url),
            "result_backend": env.get("CELERY_RESULT_BACKEND", redis_url),
            "queue": env.get("JUNE_QUEUE", "june"),
            "control_queue": env.get("JUNE_CONTROL_QUEUE", "june.control"),
            "key_prefix": env.get("JUNE_KEY_PREFIX", "june"),
            "broker_queue_type": env.get("JUNE_BROKER_QUEUE_TYPE", "quorum").strip().lower(),
            "publish_timeout_s": _env_number(env, "JUNE_PUBLISH_TIMEOUT_S", 5.0),
            "publish_retries": int(_env_number(env, "JUNE_PUBLISH_RETRIES", 3)),
            "database_url": env.get("JUNE_DATABASE_URL"),
        }
        settings.update(overrides)
        return cls(**settings)

    def _app(self, main: str, backend: str | None, transport_options: dict[str, Any]) -> Any:
        return producer_app(
            main,
            broker_url=self.broker_url,
            result_backend=backend,
            queues=(self.queue, self.control_queue),
            default_queue=self.queue,
            transport_options=transport_options,
            queue_type=self.broker_queue_type,
            publish_timeout_s=self.publish_timeout_s,
            publish_retries=self.publish_retries,
            connect_timeout_s=self.connect_timeout_s,
        )

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
        backend = self._control_app.backend
        try:
            consumer = getattr(backend, "result_consumer", None)
            if consumer is not None:
                consumer.stop()
            pool = getattr(getattr(backend, "client", None), "connection_pool", None)
            if pool is not None:
                pool.disconnect()
        except _SEND_ERRORS:
            pass  # closing: a backend that is gone has nothing left to close
        self._turn_app.close()
        self._control_app.close()
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
        tid = _turn_id(turn_id) if turn_id is not None else new_turn_id()
        opened_by = _json_object(trigger, "trigger")
        if opened_by is not None and not isinstance(opened_by.get("kind"), str):
            raise ValueError('invalid trigger: expected {"kind": "proactive", "by": "<who>"}')
        durable = self.durable if durable is None else durable
        payload: dict[str, Any] = {
            "turn_id": tid,
            "agent": _agent(agent),
            "session": _session(session),
            "text": _bounded(text, "text", low=0, high=_MAX_TEXT),
            "event": _json_object(event, "event"),
            "trigger": opened_by,
            "replace": bool(replace),
        }
        delivered_to = _json_object(target, "target")
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
                )
                recorded = self._record(payload["agent"], payload["session"], tid, stored)
            self._send_turn("june.turn", payload, tid, recorded, headers=trace_headers)
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
        tid = _turn_id(turn_id) if turn_id is not None else new_turn_id()
        payload: dict[str, Any] = {
            "turn_id": tid,
            "agent": _agent(agent),
            "session": _session(session),
            "text": _bounded(text, "text", low=1, high=_MAX_TEXT),
            "by": _bounded(by, "by", low=1, high=256),
            "target": _json_object(target, "target"),
        }
        durable = self.durable if durable is None else durable
        if durable:
            check_storable(payload)  # text, by, target: what the record holds
        where = {"agent": payload["agent"], "session": payload["session"], "turn_id": tid, "queue": self.queue}
        with sending("june.proactive", **where) as trace_headers:
            recorded = None
            if durable:
                stored = turn_payload(
                    payload["text"], trigger_by=payload["by"], target=payload["target"], trace=trace_headers
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
        argsrepr = _summary(agent=payload["agent"], session=payload["session"], turn_id=turn_id)
        try:
            self._send(self._turn_app, task, payload, queue=self.queue, argsrepr=argsrepr, headers=headers)
        except BrokerUnavailable as exc:
            if recorded is None:
                raise
            log.warning("%s; turn %s is recorded in Postgres, the sweeper will send it", exc, turn_id)

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
        payload: dict[str, Any] = {
            "agent": _agent(agent),
            "session": _session(session),
            "turn_id": _turn_id(turn_id),
            "input_id": _bounded(input_id, "input id", low=1, high=256),
            "value": _json_value(value, "value"),
            "by": _bounded(by, "by", low=1, high=256) if by is not None else None,
            "principal": _json_object(principal, "principal"),
        }
        result = self._call(
            "june.resume",
            payload,
            what=f"turn {turn_id} of {agent}:{session}",
            argsrepr=_summary(agent=agent, session=session, turn_id=turn_id, input_id=input_id),
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
        payload: dict[str, Any] = {
            "agent": _agent(agent),
            "session": _session(session),
            "turn_id": _turn_id(turn_id),
            "input_id": _bounded(input_id, "input id", low=1, high=256),
            "value": _json_value(value, "value"),
            "by": _bounded(by, "by", low=1, high=256) if by is not None else None,
            "principal": _json_object(principal, "principal"),
            "reply_to": _json_object(reply_to, "reply_to"),
        }
        argsrepr = _summary(agent=agent, session=session, turn_id=turn_id, input_id=input_id)
        self._send(self._control_app, "june.resume", payload, queue=self.control_queue, argsrepr=argsrepr)

    def cancel(self, agent: str, session: str, turn_id: str | None = None, *, timeout_s: float = 30) -> dict[str, Any]:
        """Cancel one turn, or every unfinished turn of the session (``june.cancel``).

        Returns the worker's summary, ``{"status": ..., "turn_ids": [...]}``. A running turn
        stops at its next checkpoint; its events end with ``turn.cancelled``.
        """
        payload: dict[str, Any] = {
            "agent": _agent(agent),
            "session": _session(session),
            "turn_id": _turn_id(turn_id) if turn_id is not None else None,
        }
        what = f"turn {turn_id} of {agent}:{session}" if turn_id else f"session {agent}:{session}"
        result = self._call(
            "june.cancel",
            payload,
            what=what,
            argsrepr=_summary(agent=agent, session=session, turn_id=turn_id),
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
        payload: dict[str, Any] = {"agent": _agent(agent), "session": _session(session)}
        result = self._call(
            "june.reset",
            payload,
            what=f"session {agent}:{session}",
            argsrepr=_summary(agent=agent, session=session),
            timeout_s=timeout_s,
            expiring=True,
        )
        return parse_reset(result)

    # --- events ----------------------------------------------------------------------------------

    def stream_key(self, agent: str, session: str) -> str:
        """The session's stream, ``<prefix>:events:{<agent>:<session>}``."""
        return session_stream(self.key_prefix, _agent(agent), _session(session))

    def last_stream_id(self, agent: str, session: str) -> str:
        """The id of the session stream's newest entry (``"0-0"`` when empty): follow from it to see only what comes next."""
        tail: Any = self.redis.xrevrange(self.stream_key(agent, session), count=1)
        return str(tail[0][0]) if tail else "0-0"

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
        state = self._state(agent, session, turn_id, last_id, timeout_s, block_ms, include_deltas, last_seq)
        if state.last_id == "$":
            state.last_id = self.last_stream_id(agent, session)
        return self._follow(state, count)

    def _follow(self, state: FollowState, count: int) -> Generator[FollowedEvent, None, None]:
        with self.redis.pipeline(transaction=False) as pipe:
            queue_start_check(pipe, state.stream, state.last_id, state.last_seq)
            start = judge_start(state.stream, state.last_id, state.last_seq, pipe.execute(raise_on_error=False))
        after = self.redis.xrange(state.stream, min="(" + state.last_id, count=SCAN) if start.suspect else None
        state.started(start, after)
        state.raise_gap()
        while not state.done:
            response: Any = self.redis.xread({state.stream: state.last_id}, count=count, block=state.block())
            yield from state.take(response)
            state.raise_gap()
            if not response and state.expired():
                return

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
        state = self._state(agent, session, turn_id, last_id, timeout_s, block_ms, include_deltas, last_seq)
        client = aconnect(
            self.redis_url,
            decode_responses=True,
            socket_timeout=self.socket_timeout_s,
            socket_connect_timeout=self.connect_timeout_s,
        )
        try:
            if state.last_id == "$":
                tail: Any = await client.xrevrange(state.stream, count=1)
                state.last_id = str(tail[0][0]) if tail else "0-0"
            async with client.pipeline(transaction=False) as pipe:
                queue_start_check(pipe, state.stream, state.last_id, state.last_seq)
                start = judge_start(
                    state.stream, state.last_id, state.last_seq, await pipe.execute(raise_on_error=False)
                )
            after = await client.xrange(state.stream, min="(" + state.last_id, count=SCAN) if start.suspect else None
            state.started(start, after)
            state.raise_gap()
            while not state.done:
                response: Any = await client.xread({state.stream: state.last_id}, count=count, block=state.block())
                for event in state.take(response):
                    yield event
                state.raise_gap()
                if not response and state.expired():
                    return
        finally:
            await client.aclose()

    def _state(
        self,
        agent: str,
        session: str,
        turn_id: str | None,
        last_id: str,
        timeout_s: float | None,
        block_ms: int,
        include_deltas: bool,
        last_seq: int | None,
    ) -> FollowState:
        if not isinstance(last_id, str) or not _STREAM_ID_RE.match(last_id):
            raise ValueError(f"invalid last_id {last_id!r}: expected a stream id such as 1700000000000-0, 0-0 or $")
        return FollowState(
            self.stream_key(agent, session),
            turn_id=_turn_id(turn_id) if turn_id is not None else None,
            last_id=last_id,
            block_ms=safe_block_ms(self.socket_timeout_s, block_ms),
            timeout_s=timeout_s,
            include_deltas=include_deltas,
            last_seq=last_seq,
            reload=f"the store (the gateway's GET /v1/agents/{agent}/sessions/{session}/log)",
        )

    # --- sending ---------------------------------------------------------------------------------

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
        except _SEND_ERRORS as exc:
            raise BrokerUnavailable(
                f"could not send {task} {argsrepr} to queue {queue!r}: broker {redact(self.broker_url)} did not "
                f"take it ({_cause(exc)}); is it running, and is CELERY_BROKER_URL right?"
            ) from exc
        except PreconditionFailed as exc:
            raise ProducerConfigError(
                f"broker {redact(self.broker_url)} refused queue {queue!r} as declared ({_cause(exc)}): it exists "
                "with other arguments; set broker_queue_type (JUNE_BROKER_QUEUE_TYPE) to what the workers use"
            ) from exc
        except RuntimeError as exc:
            # Before publishing a waited task Celery subscribes to its result; when the result
            # backend cannot be reached it gives up with a RuntimeError caused by the connection error.
            if not isinstance(exc.__cause__, _SEND_ERRORS):
                raise
            raise BrokerUnavailable(
                f"could not send {task} {argsrepr}: result backend {redact(self.result_backend)} did not answer "
                f"({_cause(exc.__cause__)}), so nothing was sent; is it running, and is CELERY_RESULT_BACKEND right?"
            ) from exc

    def _call(
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

        ``expiring``: the message expires a little before the wait ends (:func:`_expiry_s`), so a task no
        worker began in time never runs later; the timeout then says so (``ResultTimeout.withdrawn``).
        """
        timeout_s = _timeout(timeout_s)
        expires = _expiry_s(timeout_s) if expiring else None
        result = self._send(
            self._control_app, task, payload, queue=self.control_queue, argsrepr=argsrepr, expires=expires
        )
        try:
            # disable_sync_subtasks=False: a service may call this from its own Celery task; the wait
            # is on june's control queue, never on the caller's own pool, so it cannot deadlock it.
            value = result.get(timeout=timeout_s, propagate=False, disable_sync_subtasks=False)
        except CeleryTimeoutError:
            self._abandon(result)
            raise ResultTimeout(task, what, timeout_s, self.control_queue, str(result.id), withdrawn=expiring) from None
        except (*_SEND_ERRORS, RuntimeError) as exc:
            cause = exc.__cause__ if isinstance(exc, RuntimeError) else exc
            if not isinstance(cause, _SEND_ERRORS):
                raise
            raise ResultUnavailable(
                f"{task} for {what} was sent, but its result could not be read from "
                f"{redact(self.result_backend)} ({_cause(cause)}); it may have run"
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

    @staticmethod
    def _abandon(result: Any) -> None:
        """Stop listening for a result and drop it from the backend (best effort)."""
        try:
            result.forget()
        except (*_SEND_ERRORS, RuntimeError):
            pass
