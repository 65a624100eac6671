"""The JSON objects the Celery tasks accept, one pydantic model per task.

Every task takes exactly one JSON object. Anything else (a list, two arguments, unknown
fields, a wrong type) is a :class:`~june_worker.errors.PayloadError` naming the field and
what was expected; the task records the rejection and returns, it never retries.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from june_wire.storable import unstorable_reason

from ..engine.types import InboundEvent, JsonValue, Principal
from ..errors import PayloadError

__all__ = [
    "CancelMessage",
    "ProactiveMessage",
    "ResetMessage",
    "ResumeMessage",
    "SweepMessage",
    "TurnMessage",
    "parse_payload",
]

Name = Annotated[str, StringConstraints(pattern=r"^[\x21-\x7e]{1,256}$")]
AgentName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")]
TurnId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _SessionMessage(_Message):
    agent: AgentName
    session: Name


class TurnMessage(_SessionMessage):
    """``june.turn``: run a turn (or replay it: the same ``turn_id`` is the same turn)."""

    turn_id: TurnId
    text: Annotated[str, StringConstraints(max_length=200_000)]
    event: InboundEvent | None = None
    trigger: dict[str, Any] | None = None
    """``{"kind": "proactive", "by": "cron:daily"}`` opens the turn with a trigger message."""
    replace: bool = False
    target: dict[str, JsonValue] | None = None
    """Where the agent's ``deliver`` hook renders the finished turn."""
    sent_at: Annotated[float, Field(gt=0, allow_inf_nan=False, strict=True)] | None = None
    """When the producer sent the message (epoch seconds, its own clock): the queue wait metric counts from it."""

    def trigger_by(self) -> str | None:
        if self.trigger is None:
            return None
        if self.trigger.get("kind") != "proactive" or not isinstance(self.trigger.get("by"), str):
            raise PayloadError('trigger must be {"kind": "proactive", "by": "<who>"}')
        return str(self.trigger["by"])


class ResumeMessage(_SessionMessage):
    """``june.resume``: answer a parked turn. ``by`` must be an identity the sender verified."""

    turn_id: TurnId
    input_id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    value: JsonValue = None
    by: str | None = None
    principal: Principal | None = None
    reply_to: dict[str, JsonValue] | None = None
    """A channel target naming the answerer: a refused answer is told to them there (a Slack ephemeral note)."""


class CancelMessage(_SessionMessage):
    """``june.cancel``: cancel one turn, or every unfinished turn of the session when ``turn_id`` is absent."""

    turn_id: TurnId | None = None


class ResetMessage(_SessionMessage):
    """``june.reset``: retire the session's history under its current generation."""


class ProactiveMessage(_SessionMessage):
    """``june.proactive``: a turn nobody typed, e.g. from Celery beat; ``by`` says who started it."""

    text: Annotated[str, StringConstraints(min_length=1, max_length=200_000)]
    by: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    turn_id: TurnId | None = None
    """Defaults to one derived from the Celery task id, so a redelivered message is the same turn."""
    target: dict[str, JsonValue] | None = None
    """Where the agent's ``deliver`` hook renders the result (a channel, a thread...)."""


class SweepMessage(_Message):
    """``june.sweep``: recover what a dead worker or a lost message left behind."""

    limit: int = Field(default=500, ge=1, le=100_000)


M = TypeVar("M", bound=BaseModel)


def parse_payload(model: type[M], args: tuple[Any, ...], kwargs: dict[str, Any]) -> M:
    """The one JSON object a task was sent, validated; :class:`PayloadError` says what is wrong."""
    if kwargs or len(args) != 1:
        raise PayloadError(
            f"expected exactly one JSON object argument, got {len(args)} positional and {len(kwargs)} keyword arguments"
        )
    (raw,) = args
    if not isinstance(raw, dict):
        raise PayloadError(f"expected a JSON object, got {type(raw).__name__}")
    unstorable = unstorable_reason(raw)
    if unstorable is not None:  # Postgres and JSON cannot hold it: refuse it whole rather than alter it
        raise PayloadError(f"invalid {model.__name__} payload: {unstorable}")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(payload)'}: {err['msg']}" for err in exc.errors()[:5]
        )
        raise PayloadError(f"invalid {model.__name__} payload: {problems}") from None
