"""The SessionStore seam: where a session's transcript, steps, turns and events live.

The engine reads a session once per turn (:meth:`SessionStore.load`) and then writes it
only through :meth:`SessionStore.commit`, one call per checkpoint. The one rule an
implementation must not break: **a commit is atomic**. Its messages, steps, events,
session and turn changes, and, when the commit is built by a sync tool, every write the
tool made through the :class:`StoreHandle`, land together or not at all. Exactly-once for
sync tools rests on that; the memory store cannot roll back and says so.

The store methods are synchronous on purpose: a sync tool runs inside the step's
transaction, and it cannot await. A commit is one short local transaction, so blocking
the event loop for it costs less than a thread hop.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from june_wire.keys import SessionRef  # a session's address is part of the wire (its keys are made of it)

from .events import TurnEvent, TurnResult
from .types import InboundEvent, InputRequest, JsonValue, Message, ParentLink, Principal

__all__ = [
    "INITIATOR_STEP",
    "OpenInput",
    "UNFINISHED_TURN_STATUSES",
    "Commit",
    "CommitBuilder",
    "ENDED_TURN_STATUSES",
    "ResetResult",
    "SessionRef",
    "SessionSnapshot",
    "SessionStatus",
    "SessionStore",
    "StepRecord",
    "StoreHandle",
    "SuspendedCheckpoint",
    "SurfacePolicy",
    "TurnPayload",
    "TurnRecord",
    "TurnStatus",
    "input_step_id",
    "park_expiry",
    "parked_on",
]

SessionStatus = Literal["new", "running", "suspended", "done"]
TurnStatus = Literal["queued", "running", "suspended", "completed", "failed", "cancelled", "rejected"]
UNFINISHED_TURN_STATUSES: frozenset[str] = frozenset({"queued", "running"})
ENDED_TURN_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled", "rejected"})
INITIATOR_STEP = "session:initiator"
"""Reserved step key holding the session's first resolved principal."""


def input_step_id(turn_id: str, input_id: str) -> str:
    """Answers are turn-scoped: a later turn asking with the same id parks again."""
    return f"input:{turn_id}:{input_id}"


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True)


class SurfacePolicy(_Record):
    """How turns from one inbound source differ: a system-prompt overlay and denied tools."""

    source: str | None = None
    overlay: str | None = None
    mode: Literal["append", "replace"] = "append"
    deny_tools: list[str] = Field(default_factory=list)


class TurnPayload(_Record):
    """What a turn was asked to do. Stored with the turn so a sweeper can redeliver it."""

    text: str
    event: InboundEvent | None = None
    trigger_by: str | None = None
    """Set for a proactive turn: the opening is a ``trigger`` message attributed to it."""
    replace: bool = False
    target: dict[str, JsonValue] | None = None
    """Where the agent's ``deliver`` hook renders the result (proactive turns)."""
    parent: ParentLink | None = None
    """Set for a child turn started by a tool of another turn (``ctx.delegate``): its end answers that turn."""
    trace: dict[str, str] | None = None
    """The W3C trace context (``traceparent``, ``tracestate``) of whoever sent the turn, from its message's
    headers: whichever process runs the turn makes its span a child of that one (june_worker/observe)."""
    sent_at: float | None = None
    """When the producer sent the turn (epoch seconds, by the producer's clock), if it said: the worker's queue wait
    metric counts from it (else from the record's ``created_at``). Never compared with another clock to decide
    anything."""
    queue: str | None = None
    """The broker queue the turn was sent on: the one its producer chose (a durable producer records it), else the
    one its first message came from. Whoever sends the turn again (the sweeper, a resume, a woken parent) sends it
    there, to the workers that serve its agent; None (a record older than this field): the sender's default
    queue."""


class TurnRecord(_Record):
    turn_id: str
    agent: str
    session: str
    position: int = 0
    """Arrival order within the session; turns run in this order."""
    status: TurnStatus = "queued"
    payload: TurnPayload
    cancel_reason: str | None = None
    attempts: int = 0
    result: TurnResult | None = None
    generation: int = 0
    created_at: float = 0.0
    finished_at: float | None = None
    last_error: str | None = None
    """Why the turn's last attempt ended without a result (a transient fault it could not outlast)."""


class StepRecord(_Record):
    """A memoized step result under a stable id (``model:<n>``, ``tool:<n>:<callId>``, ``input:...``)."""

    step_id: str
    turn_id: str | None = None
    data: JsonValue = None


class OpenInput(_Record):
    """One open request of a parked turn, and the tool call that asked it."""

    request: InputRequest
    call_id: str


class SuspendedCheckpoint(_Record):
    """Everything a parked turn needs to continue days later, in another process.

    A turn parks with every request its calls left open (calls run in parallel may each ask one):
    ``request``/``call_id`` is the first open one, ``more`` the others, in call order. Each is answered
    on its own; an answer that leaves others open rewrites the checkpoint without them and moves
    ``version`` on (an answer applies only to the version it read, so two answers racing for different
    requests both apply, one after the other, and two for the same request apply once); the answer
    that closes the last one re-queues the turn.
    """

    turn_id: str
    request: InputRequest
    call_id: str
    opening_text: str
    policy: SurfacePolicy | None = None
    event: InboundEvent | None = None
    principal: Principal | None = None
    more: list[OpenInput] = Field(default_factory=list)
    version: int = 0

    @model_serializer(mode="wrap")
    def _without_defaults_of_several(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if not self.more and not self.version:  # a park on one request is stored as it always was
            data.pop("more", None)
            data.pop("version", None)
        return data

    def inputs(self) -> list[OpenInput]:
        """Every open request, the first one first."""
        return [OpenInput(request=self.request, call_id=self.call_id), *self.more]

    def answering(self, input_id: str) -> SuspendedCheckpoint | None:
        """This checkpoint seen from one of its open requests (``request`` is that one, ``more`` the others in
        their order); None when no open request has that id."""
        inputs = self.inputs()
        found = next((i for i in inputs if i.request.id == input_id), None)
        if found is None:
            return None
        if found.request.id == self.request.id:
            return self
        others = [i for i in inputs if i.request.id != input_id]
        return self.model_copy(update={"request": found.request, "call_id": found.call_id, "more": others})

    def park_timeout(self) -> float | None:
        """The shortest ``timeout_s`` of the open requests: what the store's expiry stamp counts from the park."""
        timeouts = [i.request.timeout_s for i in self.inputs() if i.request.timeout_s is not None]
        return min(timeouts) if timeouts else None

    @property
    def expires_at(self) -> float | None:
        """When the first open request expires, as the store stamped it; None: none of them does."""
        stamps = [i.request.expires_at for i in self.inputs() if i.request.expires_at is not None]
        return min(stamps) if stamps else None

    def due(self) -> list[OpenInput]:
        """The open requests that expire first (the ones the store's expiry stamp is for)."""
        first = self.park_timeout()
        return [i for i in self.inputs() if first is not None and i.request.timeout_s == first]

    def with_expiry(self, expires_at: float | None) -> SuspendedCheckpoint:
        """This checkpoint as a store reports it: each request's expiry from the store's own stamp (the stamp is
        the first expiry, ``park_timeout()`` after the park; a request expires ``timeout_s`` after the park)."""
        first = self.park_timeout()
        if expires_at is None or first is None:
            return self
        parked_at = expires_at - first

        def stamped(r: InputRequest) -> InputRequest:
            if r.timeout_s is None:
                return r
            return r.model_copy(update={"expires_at": parked_at + r.timeout_s})

        more = [i.model_copy(update={"request": stamped(i.request)}) for i in self.more]
        return self.model_copy(update={"request": stamped(self.request), "more": more})


def parked_on(parked: SuspendedCheckpoint | None, turn_id: str, input_id: str, version: int) -> bool:
    """Whether ``parked`` is that turn's park at that version with that request open (``Commit.expect_suspended``)."""
    return (
        parked is not None
        and parked.turn_id == turn_id
        and parked.version == version
        and parked.answering(input_id) is not None
    )


def park_expiry(commit: Commit, now: float, current: float | None) -> float | None:
    """The expiry stamp a commit that sets ``suspended`` gives the park, by the store's clock ``now``."""
    assert commit.suspended is not None
    first = commit.suspended.park_timeout()
    if first is None:
        return None
    if commit.repark_from is not None and current is not None:
        return current - commit.repark_from + first
    return now + first


class SessionSnapshot(_Record):
    ref_agent: str
    ref_session: str
    generation: int = 0
    status: SessionStatus = "new"
    suspended: SuspendedCheckpoint | None = None
    reset_pending: bool = False
    messages: list[Message] = Field(default_factory=list)
    steps: dict[str, StepRecord] = Field(default_factory=dict)
    """Every step record of the session, or at least the reserved ``session:*`` ones and those of its
    unfinished turns: nothing reads the steps of a turn that ended (a worker reads only those)."""
    event_seq: int = 0
    compacted_at: int | None = None
    """Index in ``messages`` of the latest :class:`~.types.SummaryMessage` (None: the session was never
    compacted). A store reports it so that nobody has to look through a long transcript for it."""


class ResetResult(_Record):
    previous_session: str
    """The archived address, ``<session>#g<generation>``."""
    generation: int


@dataclass
class Commit:
    """One checkpoint: everything in it is written in one transaction.

    ``messages`` carry their transcript index: the engine knows it (it holds the
    transcript), and a duplicate index fails the commit, which is how a second writer of
    the same step is refused even without a lease.
    """

    messages: list[tuple[int, Message]] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    events: list[TurnEvent] = field(default_factory=list)
    status: SessionStatus | None = None
    suspended: SuspendedCheckpoint | None = None
    clear_suspended: bool = False
    turn_id: str | None = None
    turn_status: TurnStatus | None = None
    turn_result: TurnResult | None = None
    """Written whenever ``turn_status`` is: None clears a previous result (a resumed turn)."""
    expect_suspended: tuple[str, str] | None = None
    """(turn_id, input_id): apply only if the session is parked on that turn with that request open, at
    checkpoint ``expect_version``, else :class:`~june_worker.errors.ResumeConflictError`. Makes racing
    resumes apply once."""
    expect_version: int = 0
    """With ``expect_suspended``: the checkpoint's ``version`` the answer was made from."""
    repark_from: float | None = None
    """With ``suspended``: the checkpoint replaces the current park's (an answer left other requests open),
    whose ``park_timeout()`` this was: the expiry stays counted from the original park, not from now."""
    expect_not_cancelled: bool = False
    """Apply only if no cancel was requested for ``turn_id``, else
    :class:`~june_worker.errors.CancelRequestedError`: the commit that opens a turn never opens a
    cancelled one, however late the cancel's signal arrives."""
    turn_error: str | None = None
    """Recorded as the turn's ``last_error`` (why an attempt ended without a result)."""
    count_attempt: bool = True
    """With ``turn_status="running"``: the commit counts a start of the turn (``attempts + 1``). False when the
    host counted this start already, in the statement that picked the turn (a worker)."""
    expect_expired: bool = False
    """With ``expect_suspended``: apply only if the park's stored expiry has passed by the store's clock,
    else :class:`~june_worker.errors.ResumeConflictError` (not expired yet)."""
    cancel_reason: str | None = None
    """With ``turn_id``: mark the turn cancel-requested in this commit (a reason already stored stays), whatever
    its status but ended: unlike :meth:`SessionStore.request_cancel`, also a parked turn. The parked parent of
    child turns is cancelled this way (docs/subagents.md): it ends ``cancelled`` when it next runs."""

    # A commit that sets ``suspended`` makes the store stamp the park's expiry (``park_timeout()`` from now,
    # by the store's clock; with ``repark_from``, moved by the difference from the old park's); ``pending``
    # and ``load`` report each request's ``expires_at`` from that stamp (``SuspendedCheckpoint.with_expiry``).

    # Every commit that sets ``turn_status`` applies only while the turn has not ended
    # (completed, failed, cancelled, rejected): else :class:`~june_worker.errors.TurnEndedError`.


class StoreHandle(Protocol):
    """The store's own transaction, lent to a sync tool.

    One placeholder style everywhere: ``?``. Writes made here commit or roll back with the
    step.
    """

    def execute(self, sql: str, *params: Any) -> int:
        """Run a statement in the step's transaction; return the affected row count."""
        ...

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        """Run a query in the step's transaction and return its rows."""
        ...

    def unwrap(self) -> Any:
        """The driver's own connection, for what ``execute`` cannot express."""
        ...


CommitBuilder: TypeAlias = Callable[[StoreHandle], Commit]


class SessionStore(Protocol):
    """Durable state of sessions. Implementations: memory, SQLite, Postgres."""

    supports_rollback: bool
    """False only for the memory store: a sync tool's writes are not undone on error."""

    def load(self, ref: SessionRef) -> SessionSnapshot:
        """The whole live session: status, checkpoint, transcript, steps and ``compacted_at``. One read per turn."""
        ...

    def commit(self, ref: SessionRef, commit: Commit | CommitBuilder, *, fence: int | None = None) -> list[TurnEvent]:
        """Write one checkpoint atomically; return its events with their assigned ``seq``.

        ``commit`` may be a builder: it is called with a :class:`StoreHandle` on the open
        transaction (a sync tool runs inside it) and returns the commit to write. If it
        raises, everything it wrote is rolled back and the exception propagates.
        ``fence``, when given, must equal the session's current fencing token or the commit
        fails with :class:`~june_worker.errors.LeaseLostError` and writes nothing.
        """
        ...

    def enqueue_turn(self, ref: SessionRef, turn_id: str, payload: TurnPayload) -> tuple[TurnRecord, bool]:
        """Record a turn as queued unless it exists; return the stored record and whether it is new."""
        ...

    def get_turn(self, ref: SessionRef, turn_id: str) -> TurnRecord | None: ...

    def pending(self, ref: SessionRef) -> SuspendedCheckpoint | None:
        """The checkpoint of the turn the session is parked on, if any. Cheap: no transcript read."""
        ...

    def unfinished_turns(self, ref: SessionRef) -> list[TurnRecord]:
        """Turns ``queued`` or ``running``, in arrival order."""
        ...

    def reject_turn(
        self,
        ref: SessionRef,
        turn_id: str,
        payload: TurnPayload,
        reason: str,
        *,
        fence: int | None = None,
        new_only: bool = False,
    ) -> tuple[TurnRecord, list[TurnEvent]]:
        """Record the turn as ``rejected`` with its ``turn.failed`` (phase intake) event, in one transaction.

        A turn not recorded yet is inserted as rejected (never queued first, so nothing can run
        it); one still queued or running becomes rejected, unless ``new_only`` (a refused copy of a
        message must not end the turn its first copy recorded); one that ended is left as it is.
        A store that takes records from outside the workers (Postgres: durable producers) also
        rejects, whatever ``new_only`` says, a queued turn that never started whose own record no
        worker can use, putting ``payload`` in its place.
        Returns the stored record and the events written (none when nothing changed).
        """
        ...

    def request_cancel(self, ref: SessionRef, reason: str, *, turn_ids: Sequence[str] | None = None) -> list[str]:
        """Durably mark unfinished turns (all of them when ``turn_ids`` is None) as cancel-requested.

        Never touches a suspended turn. Returns the ids marked.
        """
        ...

    def events(self, ref: SessionRef, *, turn_id: str | None = None, after_seq: int = 0) -> list[TurnEvent]:
        """Committed structural events, in ``seq`` order."""
        ...

    def child_turns(self, parent: SessionRef, parent_turn_id: str, agents: Collection[str]) -> list[TurnRecord]:
        """The child turns (``TurnPayload.parent``) that turn ``parent_turn_id`` started, on any of ``agents``.

        They live in the sessions ``"<parent session>:sub:..."``: a range of session ids, read along
        the turns' primary key (agent, session, ...), never a scan of every turn.
        """
        ...

    def reset(self, ref: SessionRef, *, fence: int | None = None) -> ResetResult:
        """Archive messages and steps under the current generation, clear them, bump the generation.

        Turns still queued or running are the caller's to cancel first. ``fence``: as for
        :meth:`commit`, the reset applies only under that lease.
        """
        ...

    def close(self) -> None: ...
