"""The ``/v1`` routes that read or steer a session without streaming: pending input, cancel, reset."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from .deps import AgentName, Authenticated, Backend, SessionId, TurnIdPath, use_session
from .routes import ERRORS, SESSION, TURN, known_turn
from .schemas import CancelOutcome, ErrorBody, Pending, PendingInput, ResetOutcome

__all__ = ["router"]

router = APIRouter(prefix="/v1")

_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    504: {"model": ErrorBody, "description": "No worker answered in time."},
}


@router.get(SESSION + "/pending", response_model=PendingInput, responses=_ERRORS, summary="The pending input")
async def pending(
    request: Request, agent: AgentName, session: SessionId, principal: Authenticated, backend: Backend
) -> PendingInput:
    """The input request the session is parked on (``pending`` is null when it is not parked)."""
    ref = await use_session(request, principal, agent, session, "pending")
    parked = await backend.pending(ref)
    found = None
    if parked is not None:
        inputs = [i.request.model_dump(mode="json", by_alias=True) for i in parked.inputs()]
        found = Pending(turn_id=parked.turn_id, input=inputs[0], inputs=inputs)
    return PendingInput(agent=agent, session=session, pending=found)


@router.post(
    TURN + "/cancel",
    response_model=CancelOutcome,
    responses={**_ERRORS, 409: {"model": ErrorBody, "description": "The turn is neither queued nor running."}},
    summary="Cancel a turn",
)
async def cancel_turn(
    request: Request, agent: AgentName, session: SessionId, turn_id: TurnIdPath, principal: Authenticated,
    backend: Backend,
) -> CancelOutcome:  # fmt: skip
    """Cancel one queued or running turn; it stops at its next checkpoint and its stream ends ``turn.cancelled``."""
    ref = await known_turn(request, principal, agent, session, turn_id, "cancel")
    result = await backend.cancel(ref, turn_id)
    if result.get("status") == "nothing-to-cancel":
        rec = await backend.turn(ref, turn_id)
        state = rec.status if rec is not None else "not yet taken by a worker"
        raise HTTPException(status_code=409, detail=f"turn {turn_id} is not queued or running ({state})")
    return CancelOutcome(status=str(result["status"]), turn_ids=list(result.get("turn_ids", [])))


@router.post(SESSION + "/cancel", response_model=CancelOutcome, responses=_ERRORS, summary="Cancel a session's turns")
async def cancel_session(
    request: Request, agent: AgentName, session: SessionId, principal: Authenticated, backend: Backend
) -> CancelOutcome:
    """Cancel every queued or running turn of the session (``nothing-to-cancel`` when there is none)."""
    ref = await use_session(request, principal, agent, session, "cancel")
    result = await backend.cancel(ref, None)
    return CancelOutcome(status=str(result["status"]), turn_ids=list(result.get("turn_ids", [])))


@router.post(
    SESSION + "/reset",
    response_model=ResetOutcome,
    responses={**_ERRORS, 202: {"model": ResetOutcome, "description": "Pending: it happens when the session is free."}},
    summary="Reset a session",
)
async def reset(
    request: Request, agent: AgentName, session: SessionId, principal: Authenticated, backend: Backend
) -> JSONResponse:
    """Cancel unfinished turns (reason ``reset``), end a park, and archive the history under its generation."""
    ref = await use_session(request, principal, agent, session, "reset")
    result = await backend.reset(ref)
    if result.status == "rejected":
        raise HTTPException(status_code=422, detail=result.reason or "the worker rejected the reset")
    body = ResetOutcome(
        status=result.status, previous_session=result.previous_session, generation=result.generation,
        reason=result.reason,
    )  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"), status_code=200 if result.done else 202)
