"""The JSON bodies of the gateway's routes, as pydantic models (they make the OpenAPI schema).

Request bodies forbid unknown fields: a client that sends ``by`` or ``principal`` gets a 422
naming the field, because who answers is the token's principal, never a field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer

__all__ = [
    "AgentList",
    "CancelOutcome",
    "ErrorBody",
    "Pending",
    "PendingInput",
    "ResetOutcome",
    "ResumeAccepted",
    "ResumeRequest",
    "TurnAccepted",
    "TurnInfo",
    "TurnOutcome",
    "TurnRequest",
]

TurnId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$", examples=["t_01JD0Q8ZJ6F0W4K9Y3V7T2B1NC"])]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TurnRequest(_Body):
    """Start a turn: what the user typed. The gateway adds the inbound event (source, verified user)."""

    text: str = Field(max_length=200_000, description="What the user said.")
    turn_id: TurnId | None = Field(
        default=None, description="Resend an earlier turn (the worker runs a turn id once); minted when absent."
    )
    replace: bool = Field(default=False, description="Cancel the session's unfinished turns in favour of this one.")


class ResumeRequest(_Body):
    """Answer the input a parked turn waits for. Who answers is the token's principal."""

    input_id: str = Field(min_length=1, max_length=256, description="The id of the pending input request.")
    value: Any = Field(description="The answer: any JSON value the request's schema accepts (true / false to approve).")

    @field_validator("value")
    @classmethod
    def _json(cls, value: Any) -> Any:
        """Python's JSON parser takes ``NaN`` and ``Infinity``; JSON has no such values, and no worker could read one."""
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:
            raise ValueError("the answer must be JSON: NaN and Infinity are not JSON values") from None
        return value


class ErrorBody(BaseModel):
    detail: Any = Field(
        description="What was wrong: a sentence, or a list of {loc, msg, type} for a malformed request."
    )


class TurnAccepted(BaseModel):
    turn_id: str
    agent: str
    session: str
    status: Literal["queued"] = "queued"
    events: str = Field(description="The turn's SSE route, relative to the server.")


class TurnOutcome(BaseModel):
    """How a turn ended (``wait=true``): completed with text, parked, failed or cancelled."""

    turn_id: str
    status: Literal["completed", "suspended", "failed", "cancelled"]
    text: str | None = None
    input: dict[str, Any] | None = Field(default=None, description="The pending request, when suspended.")
    inputs: list[dict[str, Any]] | None = Field(
        default=None,
        description="Every open request, when the turn waits on several and the ending was read from its row "
        "(GET .../pending lists them always); left out otherwise.",
    )
    error: dict[str, Any] | None = Field(default=None, description="message, type, phase and step, when failed.")
    reason: str | None = Field(default=None, description="Why it was cancelled.")
    last_event_id: str = Field(description="Stream id of the terminal event: follow on from it after a resume.")

    @model_serializer(mode="wrap")
    def _without_missing_inputs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.inputs is None:  # an outcome reads as it always did unless the turn waits on several requests
            data.pop("inputs", None)
        return data


class Pending(BaseModel):
    turn_id: str
    input: dict[str, Any] = Field(description="id, prompt, schema and answerers of the (first) open request.")
    inputs: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Every open request, the first one first, when there are several (a turn whose calls ran in "
        "parallel may wait on several, each answered on its own; it goes on after the last); left out when the "
        "turn waits on one.",
    )

    @model_serializer(mode="wrap")
    def _without_one_input_list(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if len(self.inputs) <= 1:
            data.pop("inputs", None)
        return data


class PendingInput(BaseModel):
    agent: str
    session: str
    pending: Pending | None = Field(description="The input the session is parked on; null when it is not parked.")


class ResumeAccepted(BaseModel):
    turn_id: str
    input_id: str
    status: Literal["accepted"] = "accepted"
    by: str = Field(description="The principal the answer was recorded as.")
    open: list[str] = Field(
        default_factory=list,
        description="Requests of the park still open after this answer (the turn goes on once none is); left out "
        "when none is.",
    )

    @model_serializer(mode="wrap")
    def _without_nothing_open(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if not self.open:
            data.pop("open", None)
        return data


class CancelOutcome(BaseModel):
    status: str = Field(description="cancel-requested, or nothing-to-cancel for a whole session.")
    turn_ids: list[str]


class ResetOutcome(BaseModel):
    status: Literal["reset", "pending"]
    previous_session: str | None = None
    generation: int | None = None
    reason: str | None = None


class TurnInfo(BaseModel):
    turn_id: str
    status: str = Field(description="queued, running, suspended, completed, failed, cancelled, rejected; sent: "
                        "sent by this gateway, not yet taken by a worker.")  # fmt: skip
    result: dict[str, Any] | None = None


class AgentList(BaseModel):
    principal: str
    agents: list[str]
    operator: bool = Field(default=False, description="The token is an operator's: it may use the console.")
