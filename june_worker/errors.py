"""Every error june-worker raises on purpose, in one shallow tree.

::

    JuneError                         base of everything below
    ├── ConfigError                   a deployment or definition mistake; fix the code or settings
    │   └── AgentDefinitionError      an agent's directory, tools or policies do not assemble
    ├── TurnError                     a turn could not run to a result
    │   ├── TurnFailedError           the turn ended ``failed`` (raised by ``turn()``)
    │   ├── TurnCancelledError        the turn ended ``cancelled`` (raised by ``turn()``)
    │   ├── TurnSuspendedError        the turn parked for input (raised by ``turn()``)
    │   ├── TurnRejectedError         the turn was refused before it opened
    │   ├── ModelStepError            the model stopped abnormally with nothing to say
    │   ├── ModelStreamError          the model stream broke its contract (no final reply)
    │   └── ModelProviderError        the provider refused or broke a call (``retryable`` says which)
    │       └── ContextWindowExceededError  the request was longer than the model's context window (never retried)
    ├── FatalToolError                a tool says the turn cannot go on; fails the turn
    ├── TransientError                an infrastructure fault that may pass: the step runs again (retryable)
    │   └── StoreUnavailableError     the store's connection was lost, or it refused a statement for now
    │                                 (serialization failure, deadlock, shutdown); also a StoreError
    ├── StoreError                    the store refused an operation
    │   ├── LeaseLostError            a commit was fenced off: another worker holds the session
    │   ├── TurnEndedError            a commit would change the status of a turn that has ended
    │   ├── MessageIndexTakenError    a commit's transcript index was taken: another runner committed first
    │   ├── CancelRequestedError      the opening commit found a stored cancel request
    │   ├── ResetNotSupportedError    the store has no reset operation
    │   ├── StoreLockedError          another open SQLiteStore (another process) serves the file
    │   └── UnusableTurnError         a worker picked a queued turn whose stored record no worker can run
    ├── ResumeError                   a resume was not applied
    │   ├── ResumeAuthorizationError  ``by`` may not answer this request (HTTP 403)
    │   ├── ResumeConflictError       wrong turn, wrong input id, not suspended, reset pending (409)
    │   └── InvalidAnswerError        the answer does not match the request's JSON schema (HTTP 422)
    ├── InputTimeoutError             a parked input expired before anyone answered
    ├── DelegationError               a tool may not start this child turn (depth, fan-out, agent); the model reads it
    ├── StreamGapError                a follower's position was trimmed from a session stream, or a seq is missing
    ├── ChannelError                  a channel (Slack, a webhook) refused or failed a call (``retryable`` says which)
    └── PayloadError                  a task payload failed validation (never retried)

Exceptions that cross a process boundary (Celery results) must survive pickling, so every
class passes all of its constructor arguments to ``super().__init__``.

``ParkSignal`` and ``CancelSignal`` in :mod:`june_worker.engine.signals` are deliberately
*not* here: they derive from ``BaseException`` so that a tool's ``except Exception`` never
swallows them.
"""

from __future__ import annotations

from june_wire.errors import StreamGapError as WireStreamGapError

__all__ = [
    "AgentDefinitionError",
    "CancelRequestedError",
    "ChannelError",
    "ConfigError",
    "ContextWindowExceededError",
    "DelegationError",
    "FatalToolError",
    "InputTimeoutError",
    "InvalidAnswerError",
    "JuneError",
    "LeaseLostError",
    "MessageIndexTakenError",
    "ModelProviderError",
    "ModelStepError",
    "ModelStreamError",
    "PayloadError",
    "PoisonTurnError",
    "ResetNotSupportedError",
    "ResumeAuthorizationError",
    "ResumeConflictError",
    "ResumeError",
    "StoreError",
    "StoreLockedError",
    "StoreUnavailableError",
    "StreamGapError",
    "TransientError",
    "TurnCancelledError",
    "TurnEndedError",
    "TurnError",
    "TurnFailedError",
    "TurnRejectedError",
    "TurnSuspendedError",
    "UnusableTurnError",
]


class JuneError(Exception):
    """Base class of every error june-worker raises on purpose."""

    retryable = False


class DelegationError(JuneError):
    """A tool may not start this child turn: too deep, too many for one turn, or an agent nobody serves."""


class ConfigError(JuneError):
    """A deployment or definition mistake: retrying will not help, fixing the setup will."""


class AgentDefinitionError(ConfigError):
    """An agent's instructions, tools or surface policies do not assemble."""


class TurnError(JuneError):
    """A turn could not run to a result."""


class TurnFailedError(TurnError):
    """The turn ended ``failed``; ``turn()`` raises this with the turn's error message."""


class TurnCancelledError(TurnError):
    """The turn ended ``cancelled``; ``turn()`` raises this with the reason."""


class TurnSuspendedError(TurnError):
    """The turn parked for human input, which ``turn()`` does not wait for."""


class TurnRejectedError(TurnError):
    """The turn was refused before its opening message was stored."""


class ModelStepError(TurnError):
    """The model stopped abnormally (``max_tokens``, ``refusal``...) with an empty reply."""


class ModelStreamError(TurnError):
    """The model stream ended without a final reply, or yielded something unknown."""


class ModelProviderError(TurnError):
    """The model provider refused or broke a call; ``retryable`` says whether a later attempt may succeed."""

    def __init__(
        self,
        message: str,
        status_code: int | None = None,
        error_type: str | None = None,
        request_id: str | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message, status_code, error_type, request_id, retryable)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type
        self.request_id = request_id
        self.retryable = retryable

    def __str__(self) -> str:
        return self.message


class ContextWindowExceededError(ModelProviderError):
    """The provider refused a request as longer than the model's context window. Never retried as it is: the
    turn runner compacts the transcript once and asks again (its context policy), then fails the turn."""

    def __init__(
        self,
        message: str,
        status_code: int | None = None,
        error_type: str | None = None,
        request_id: str | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message, status_code, error_type, request_id, False)


class PoisonTurnError(TurnError):
    """The same turn failed or killed its process ``max_attempts`` times; it ends ``failed`` and the session moves on."""


class FatalToolError(JuneError):
    """Raised by a tool for a mistake the model cannot fix; the turn fails instead of continuing."""


class TransientError(JuneError):
    """An infrastructure fault that may pass (a lost connection, a deadlock): the same step runs again."""

    retryable = True


class StoreError(JuneError):
    """The store refused an operation."""


class StoreUnavailableError(StoreError, TransientError):
    """The store could not be reached or refused a statement for now; whatever committed stays committed.

    The outcome of a commit that raised this is unknown: the caller re-reads the session and
    goes on from what the store holds, never re-sends the commit blindly.
    """

    retryable = True


class LeaseLostError(StoreError):
    """A commit carried a fencing token that is no longer current; another worker owns the session."""


class TurnEndedError(StoreError):
    """A commit would change the status of a turn that already ended; nothing was written."""


class MessageIndexTakenError(StoreError):
    """A commit's transcript index holds a message already: another runner of the session committed there first
    (a lost race: the in-process runtime takes no lease); nothing was written."""


class CancelRequestedError(StoreError):
    """The commit that opens a turn found a stored cancel request; nothing was written."""

    def __init__(self, reason: str, message: str | None = None) -> None:
        super().__init__(reason, message)
        self.reason = reason
        self.message = message or f"the turn was cancelled before it opened ({reason})"

    def __str__(self) -> str:
        return self.message


class ResetNotSupportedError(StoreError):
    """The store does not implement reset; nothing was cancelled or cleared."""


class UnusableTurnError(StoreError):
    """A pick of a session's next turn (with its lease) found a queued record no worker can run: one made
    outside the workers (a durable producer's) that cannot be read, or holds a string no store holds. The
    picker still holds the lease (``fence``) and rejects the turn under it, so the session goes on."""

    def __init__(self, session: str, turn_id: str, reason: str, fence: int) -> None:
        super().__init__(session, turn_id, reason, fence)
        self.session, self.turn_id, self.reason, self.fence = session, turn_id, reason, fence

    def __str__(self) -> str:
        return f"turn {self.turn_id} of {self.session} cannot be run: {self.reason}"


class StoreLockedError(StoreError):
    """Another open ``SQLiteStore`` (in another process, or this one) serves the SQLite file; close it first."""


class ResumeError(JuneError):
    """A resume was not applied; the turn stays as it was."""


class ResumeAuthorizationError(ResumeError):
    """The resumer's verified identity may not answer this request."""


class ResumeConflictError(ResumeError):
    """The resume does not match the session: wrong turn or input id, not suspended, or reset pending."""


class InvalidAnswerError(ResumeError):
    """The answer does not validate against the request's JSON schema."""


class InputTimeoutError(JuneError):
    """Raised inside a tool by ``request_input`` when its park expired unanswered."""

    def __init__(self, input_id: str, message: str | None = None) -> None:
        super().__init__(input_id, message)
        self.input_id = input_id
        self.message = message or f"input {input_id!r} expired before anyone answered"

    def __str__(self) -> str:
        return self.message


class StreamGapError(JuneError, WireStreamGapError):
    """Events a follower asked for are no longer in the session stream (trimmed), or its ``seq`` jumped.

    ``first_missing_seq`` is the first seq the follower lacks (None when its position was trimmed and it
    did not say which seq it holds); ``next_seq`` the first seq the stream still holds after the gap
    (None: none yet). Reload the missing events from the store, then follow again from ``resume_id``
    with ``last_seq=next_seq - 1``. Its fields are :class:`june_wire.errors.StreamGapError`'s.
    """


class PayloadError(JuneError):
    """A message payload failed validation; it is rejected once and never retried."""


class ChannelError(JuneError):
    """A channel refused or failed a call: ``method`` and ``code`` name it; ``retryable`` when a later try may work."""

    def __init__(self, message: str, method: str = "", code: str = "", retryable: bool = False) -> None:
        super().__init__(message, method, code, retryable)
        self.message = message
        self.method = method
        self.code = code
        self.retryable = retryable

    def __str__(self) -> str:
        return self.message
