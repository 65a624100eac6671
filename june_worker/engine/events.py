"""TurnEvents: what a turn tells the world while it runs, and the results it ends with.

Two kinds of event, and the difference matters everywhere:

* **structural** events (``turn.*``, ``message.completed``, ``action.*``,
  ``input.requested``, ``context.compacted``) are committed with the step that caused them, get a per-session
  ``seq`` from the store, and are delivered exactly once per session stream;
* **deltas** (``message.delta``, ``reasoning.delta``) are live tokens: never stored,
  never replayed, and tagged with their ``step`` and ``attempt`` so a reader can tell a
  retried step's text apart and drop the deltas of a dead attempt.

Terminal events end a turn's stream: ``turn.completed``, ``turn.failed``,
``turn.cancelled`` and ``input.requested`` (the turn parked). Which types are deltas and which
are terminal is part of the wire protocol (:mod:`june_wire.events`); this module's models must
keep to those names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from june_wire.events import DELTA_TYPES, TERMINAL_TYPES  # the wire's names: readers without the engine use them

from .types import (
    CancelReason,
    ErrorInfo,
    InputRequest,
    JsonValue,
    ParentLink,
    ToolCall,
    Trigger,
    Usage,
    omitted_if_none,
)

__all__ = [
    "DELTA_TYPES",
    "TERMINAL_TYPES",
    "ActionCompleted",
    "ActionRequested",
    "Cancelled",
    "ChildInputRequested",
    "Completed",
    "ContextCompacted",
    "Failed",
    "InputAnswered",
    "InputRequested",
    "MessageCompleted",
    "MessageDelta",
    "ReasoningDelta",
    "Rejected",
    "Suspended",
    "TurnCancelled",
    "TurnCompleted",
    "TurnEvent",
    "TurnEventAdapter",
    "TurnFailed",
    "TurnResult",
    "TurnResultAdapter",
    "TurnStarted",
    "is_structural",
    "is_terminal",
]


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True)

    turn_id: str
    seq: int | None = None
    """Per-session sequence number, set by the store when a structural event commits."""


class TurnStarted(_Event):
    type: Literal["turn.started"] = "turn.started"
    trigger: Trigger
    parent: ParentLink | None = None
    """A child turn's (subagent's) parent: session, turn and the call that delegated to it."""


class MessageDelta(_Event):
    type: Literal["message.delta"] = "message.delta"
    step: str
    text: str
    attempt: int | None = None
    """Which attempt at the turn produced it (1, 2...): a reader drops deltas of an older attempt of the same
    step (a dead worker's). None only in entries written by a version that did not send it."""


class ReasoningDelta(_Event):
    type: Literal["reasoning.delta"] = "reasoning.delta"
    step: str
    text: str
    attempt: int | None = None
    """Which attempt at the turn produced it (1, 2...): a reader drops deltas of an older attempt of the same
    step (a dead worker's). None only in entries written by a version that did not send it."""


class MessageCompleted(_Event):
    type: Literal["message.completed"] = "message.completed"
    step: str
    text: str


def _is_empty(value: list[Any]) -> bool:
    return not value


class ActionRequested(_Event):
    """A tool call of the model's reply, about to run. ``batch``: the ids of the reply's async calls that run
    concurrently, this one among them, in call order; None when it runs alone, in turn. At most ``batch_limit``
    of them (the agent's ``parallel_tools``) run at once: the first ``batch_limit`` start together, and each
    one that ends lets the next of the list start."""

    type: Literal["action.requested"] = "action.requested"
    step: str
    call: ToolCall
    batch: list[str] | None = omitted_if_none()  # a call run alone reads as it always did
    batch_limit: int | None = omitted_if_none()


class ActionCompleted(_Event):
    """A tool call's result committed. ``child_agent``, ``child_session``, ``child_turn_id``: the child turn the call
    delegated to (``ctx.delegate``; the parent turn is the event's own ``turn_id``), left out for other calls."""

    type: Literal["action.completed"] = "action.completed"
    step: str
    call: ToolCall
    result: JsonValue = None
    error: str | None = None
    child_agent: str | None = omitted_if_none()
    child_session: str | None = omitted_if_none()
    child_turn_id: str | None = omitted_if_none()


class InputRequested(_Event):
    """The turn parked on ``request``. For the request of a child turn (``child:<agent>:<turn>``, ``ctx.delegate``)
    ``child_agent``, ``child_session`` and ``child_turn_id`` name it; left out for other requests."""

    type: Literal["input.requested"] = "input.requested"
    step: str | None = None
    request: InputRequest
    child_agent: str | None = omitted_if_none()
    child_session: str | None = omitted_if_none()
    child_turn_id: str | None = omitted_if_none()


class InputAnswered(_Event):
    """One of several open requests of a parked turn was answered (or expired); ``open`` are still waiting.
    The answer that closes the last one is told by the turn's ``turn.started`` (a resume) instead."""

    type: Literal["input.answered"] = "input.answered"
    input_id: str
    open: int


class ContextCompacted(_Event):
    """A compaction step committed: the model summarised the transcript before ``kept_from``, and the summary
    (at ``at``) stands in for it in every later request. Those messages stay in the store."""

    type: Literal["context.compacted"] = "context.compacted"
    step: str
    at: int
    """Index of the summary message in the transcript."""
    kept_from: int
    """Index of the first message every later request still carries as it is."""
    summarized: int
    """Messages this summary took in that no earlier summary had (it also carries the previous summary on)."""
    tokens_before: int
    """The estimate (or the refusal) that led to it: tokens the request would have taken."""
    reason: Literal["threshold", "refused"]
    """``threshold``: the estimate passed the policy's share of the window; ``refused``: the model refused a
    request as too long."""


class ChildInputRequested(_Event):
    """A child turn of this turn (``ctx.delegate``, or a child's child) parked on a request a person answers:
    it is answered on the child's session (``child_agent`` / ``child_session``, turn ``child_turn_id``)."""

    type: Literal["child.input_requested"] = "child.input_requested"
    child_agent: str
    child_session: str
    child_turn_id: str
    request: InputRequest


class TurnCompleted(_Event):
    type: Literal["turn.completed"] = "turn.completed"
    text: str
    usage: Usage | None = None


class TurnFailed(_Event):
    type: Literal["turn.failed"] = "turn.failed"
    error: ErrorInfo
    phase: Literal["model", "tool", "intake"] | None = None
    step: str | None = None


class TurnCancelled(_Event):
    type: Literal["turn.cancelled"] = "turn.cancelled"
    reason: CancelReason


TurnEvent = Annotated[
    TurnStarted
    | MessageDelta
    | ReasoningDelta
    | MessageCompleted
    | ActionRequested
    | ActionCompleted
    | InputRequested
    | InputAnswered
    | ChildInputRequested
    | ContextCompacted
    | TurnCompleted
    | TurnFailed
    | TurnCancelled,
    Field(discriminator="type"),
]
TurnEventAdapter: TypeAdapter[TurnEvent] = TypeAdapter(TurnEvent)


def is_structural(event: TurnEvent) -> bool:
    return event.type not in DELTA_TYPES


def is_terminal(event: TurnEvent) -> bool:
    return event.type in TERMINAL_TYPES


# --- results ---------------------------------------------------------------------------------


class _Result(BaseModel):
    model_config = ConfigDict(frozen=True)

    turn_id: str


class Completed(_Result):
    status: Literal["completed"] = "completed"
    text: str
    usage: Usage | None = None


class Suspended(_Result):
    """The turn parked: ``request`` is the first open request, ``more`` the others (calls run in parallel)."""

    status: Literal["suspended"] = "suspended"
    request: InputRequest
    more: list[InputRequest] = Field(default_factory=list, exclude_if=_is_empty)  # one request reads as it always did


class Failed(_Result):
    status: Literal["failed"] = "failed"
    error: ErrorInfo
    phase: Literal["model", "tool", "intake"] | None = None
    step: str | None = None


class Cancelled(_Result):
    status: Literal["cancelled"] = "cancelled"
    reason: CancelReason


class Rejected(_Result):
    """The turn was refused before it opened (session parked, bad payload, unknown agent)."""

    status: Literal["rejected"] = "rejected"
    reason: str


TurnResult = Annotated[Completed | Suspended | Failed | Cancelled | Rejected, Field(discriminator="status")]
TurnResultAdapter: TypeAdapter[TurnResult] = TypeAdapter(TurnResult)
