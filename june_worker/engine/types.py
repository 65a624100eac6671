"""The data a turn is made of: messages, tool calls, model replies, triggers, inputs, results.

Everything here is a pydantic v2 model that round-trips through JSON, because all of it is
stored (messages, step records, suspended checkpoints) or sent between processes. Unions
are discriminated by ``role``, ``kind`` or ``status``; each has one ``TypeAdapter``.

Rule: a field added here must have a default, so that rows written by an older version
still load (see ``tests/golden``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

__all__ = [
    "ABNORMAL_FINISHES",
    "Answerers",
    "AssistantMessage",
    "CancelReason",
    "ErrorInfo",
    "Finish",
    "FinishReason",
    "InboundEvent",
    "InboundTrigger",
    "InputRequest",
    "JsonValue",
    "Message",
    "MessageAdapter",
    "ModelReply",
    "ParentLink",
    "PolicyAnswerer",
    "Principal",
    "ProactiveTrigger",
    "ReasoningBlock",
    "ResumeTrigger",
    "SpeakerIdentity",
    "SummaryMessage",
    "ToolCall",
    "ToolMessage",
    "Trigger",
    "TriggerMessage",
    "Usage",
    "UserAnswerer",
    "UserMessage",
    "omitted_if_none",
]

JsonValue: TypeAlias = Any
"""Any JSON value (object, array, string, number, bool, null)."""


def _is_none(value: object) -> bool:
    return value is None


def omitted_if_none() -> Any:
    """A field that defaults to None and is left out of a dump while None: a field added to a stored or published
    model this way leaves the rows and events without it as they always were. (Checked per field as pydantic
    serialises, which costs less than a model serializer that dumps the model and pops keys afterwards.)"""
    return Field(default=None, exclude_if=_is_none)


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True)


# --- identity ------------------------------------------------------------------------------


class Principal(_Model):
    """A verified identity the app resolved for the speaker (e.g. an account), with claims."""

    model_config = ConfigDict(frozen=True, extra="allow")

    id: str


class SpeakerIdentity(_Model):
    """Who spoke, as the channel reports it; ``attested`` when the channel signs it (Slack does)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    id: str
    attested: bool = False


class InboundEvent(_Model):
    """The message that opened a turn, as a channel delivered it.

    ``source`` keys per-source policies and cannot be forged by a user. ``raw`` is the
    channel's original payload; it is never stored in a checkpoint.
    """

    model_config = ConfigDict(frozen=True, extra="allow")

    source: str
    kind: str | None = None
    user: SpeakerIdentity | None = None
    principal: Principal | None = None
    thread: str | None = None
    text: str | None = None
    raw: JsonValue = None

    def without_raw(self) -> InboundEvent:
        return self.model_copy(update={"raw": None})


# --- triggers --------------------------------------------------------------------------------


class InboundTrigger(_Model):
    kind: Literal["inbound"] = "inbound"
    event: InboundEvent


class ProactiveTrigger(_Model):
    kind: Literal["proactive"] = "proactive"
    by: str = "system"


class ResumeTrigger(_Model):
    kind: Literal["resume"] = "resume"
    call_id: str
    input_id: str | None = None


Trigger = Annotated[InboundTrigger | ProactiveTrigger | ResumeTrigger, Field(discriminator="kind")]


# --- tool calls and model replies -------------------------------------------------------------


class ToolCall(_Model):
    """One call the model asked for; ``id`` is the provider's call id.

    ``provider_state``: an opaque value the provider attached to this call and needs back when the
    transcript is replayed (a signature, the call's caller). The engine stores it with the message
    and never reads it; only the adapter that made it does. Left out of a dump when there is none,
    so rows without it look as they always did.
    """

    id: str
    name: str
    input: dict[str, JsonValue] = Field(default_factory=dict)
    provider_state: JsonValue = omitted_if_none()


class ReasoningBlock(_Model):
    """A provider's reasoning (thinking) block, kept verbatim so it can be sent back on replay."""

    text: str = ""
    signature: str | None = None
    redacted: str | None = None


class Usage(_Model):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cache_read_tokens=self.cache_read_tokens + other.cache_read_tokens,
            cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
        )

    @property
    def context_tokens(self) -> int:
        """Tokens the request took in, cached or not: how much of the context window it filled."""
        return self.input_tokens + self.cache_read_tokens + self.cache_write_tokens


FinishReason = Literal["stop", "tool_calls", "max_tokens", "content_filter", "refusal", "malformed_tool_call", "other"]
ABNORMAL_FINISHES: frozenset[str] = frozenset(
    {"max_tokens", "content_filter", "refusal", "malformed_tool_call", "other"}
)


class Finish(_Model):
    """Why the model stopped; ``raw`` keeps the provider's own value (``end_turn``, ``pause_turn``...)."""

    reason: FinishReason
    raw: str | None = None

    @property
    def abnormal(self) -> bool:
        return self.reason in ABNORMAL_FINISHES


class ModelReply(_Model):
    """The authoritative result of one model call."""

    text: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning: list[ReasoningBlock] = Field(default_factory=list)

    @property
    def empty(self) -> bool:
        """Nothing to say: no tool call and no text but whitespace (a refusal of ``"\\n\\n"`` is empty)."""
        return not self.text.strip() and not self.tool_calls


# --- messages -------------------------------------------------------------------------------------


class UserMessage(_Model):
    role: Literal["user"] = "user"
    turn_id: str
    text: str


class TriggerMessage(_Model):
    """The opening of a proactive turn: no human sent it; ``by`` says what did (``cron:daily``)."""

    role: Literal["trigger"] = "trigger"
    turn_id: str
    text: str
    by: str


class AssistantMessage(_Model):
    """A model reply. ``usage``: what the call that wrote it reported (how full the context window was);
    left out of a dump when the model reported none, so rows without it look as they always did.
    ``window_tokens``: for a reply made of several requests (its ``usage`` summed over them), how full the
    window is with it (the last request's input plus its output); left out when None."""

    role: Literal["assistant"] = "assistant"
    turn_id: str
    text: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning: list[ReasoningBlock] = Field(default_factory=list)
    usage: Usage | None = omitted_if_none()
    window_tokens: int | None = omitted_if_none()


class ToolMessage(_Model):
    role: Literal["tool"] = "tool"
    turn_id: str
    call_id: str
    name: str
    result: JsonValue = None
    is_error: bool = False


class SummaryMessage(_Model):
    """What the model wrote about the transcript before ``kept_from`` when the session neared its context window.

    It stands in for ``messages[:kept_from]`` in every later model request (the request starts with it,
    then the messages from ``kept_from`` on); those messages stay in the store as they were. Written by
    the compaction step of a context policy (:mod:`june_worker.engine.context`).
    """

    role: Literal["summary"] = "summary"
    turn_id: str
    text: str
    kept_from: int


Message = Annotated[
    UserMessage | TriggerMessage | AssistantMessage | ToolMessage | SummaryMessage, Field(discriminator="role")
]
MessageAdapter: TypeAdapter[Message] = TypeAdapter(Message)


# --- human input ------------------------------------------------------------------------------


class UserAnswerer(_Model):
    """Exactly this verified identity may answer."""

    user: str


class PolicyAnswerer(_Model):
    """An app rule decides who may answer, through the agent's ``authorize_answer`` hook."""

    policy: str
    scope: str | None = None


Answerers = UserAnswerer | PolicyAnswerer


class InputRequest(_Model):
    """What a parked turn waits for. ``json_schema`` (``schema`` on the wire) checks the answer."""

    id: str
    prompt: str
    json_schema: dict[str, JsonValue] | None = Field(default=None, alias="schema")
    answerers: Answerers | None = None
    call_id: str | None = None
    timeout_s: float | None = None
    """How long the request waits for an answer once the turn parks (``request_input(timeout_s=...)``)."""
    expires_at: float | None = None
    """Unix time after which the request is answered with a timeout. The store stamps it when the turn
    parks, by its own clock (the database's, for Postgres); what a running tool or an event shows is
    the parking process's estimate of the same moment."""


class ParentLink(_Model):
    """Where a child turn (a subagent, ``ctx.delegate``) came from: the parent's session, turn and tool call.

    ``depth`` is 1 for a child of a top-level turn, 2 for a grandchild, and so on.
    """

    agent: str
    session: str
    turn_id: str
    call_id: str
    depth: int = 1


# --- errors and results -----------------------------------------------------------------------------

CancelReason = Literal["requested", "replaced", "reset", "parent"]
"""``parent``: a child turn (subagent) whose parent turn was cancelled or reset (docs/subagents.md)."""


class ErrorInfo(_Model):
    """A failure as it is reported: message, class, cause chain and a stack without locals."""

    message: str
    type: str | None = None
    cause_chain: list[str] = Field(default_factory=list)
    stack: str | None = None
