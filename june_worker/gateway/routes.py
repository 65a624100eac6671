"""The ``/v1`` routes: start a turn, follow events (SSE), read pending input, resume, cancel, reset.

Three answers for the routes that start or continue a turn (``POST .../turns`` and
``POST .../resume``): ``Accept: text/event-stream`` streams the turn's events until its
terminal event; ``?wait=true`` answers with how the turn ended; otherwise 202 at once.

Status codes (the seed's): 401 no or unknown token; 404 unknown agent (or one the token is
not granted), session (or one the caller may not use, :mod:`.access`) or turn; 403 the principal
may not answer; 409 wrong turn, wrong input id, not suspended, reset pending, or a parked session
refusing another turn; 413 a body over JUNE_GATEWAY_MAX_BODY_BYTES; 415 a body not sent as JSON
(:func:`~.deps.json_body`); 422 a malformed request, naming the field; 500 the agent's ``authorize_answer`` failed (the answer was NOT applied);
502/503/504 the broker, a worker, Redis or Postgres did not answer.
"""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse

from producers import new_turn_id

from ..engine.events import (
    Completed,
    Failed,
    InputRequested,
    Rejected,
    Suspended,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    is_terminal,
)
from ..engine.secrets import scrubbed_logger
from ..engine.store import SessionRef, TurnRecord
from ..errors import StreamGapError
from ..events.reader import StreamEvent, afollow
from .access import Action
from .auth import Principal
from .backend import GatewayBackend
from .deps import (
    STREAM_ID_PATTERN,
    AgentName,
    Authenticated,
    Backend,
    SessionId,
    TurnIdPath,
    json_body,
    stream_id,
    unknown_turn,
    use_session,
    wants_sse,
)
from .schemas import (
    AgentList,
    ErrorBody,
    ResumeAccepted,
    ResumeRequest,
    TurnAccepted,
    TurnInfo,
    TurnOutcome,
    TurnRequest,
)
from .sse import SSEResponse, follow_events

__all__ = ["router"]

log = scrubbed_logger("june_worker.gateway")

router = APIRouter(prefix="/v1")

SESSION = "/agents/{agent}/sessions/{session}"
TURN = SESSION + "/turns/{turn_id}"

ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "No bearer token, or an unknown one."},
    404: {
        "model": ErrorBody,
        "description": "Unknown agent (or not granted to this token), session (or one this principal may not use) "
        "or turn.",
    },
    503: {"model": ErrorBody, "description": "The broker, Redis or Postgres is unavailable."},
}
"""The errors a session's routes answer (OpenAPI responses); the control routes add theirs (routes_control)."""
BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    413: {"model": ErrorBody, "description": "The body is larger than JUNE_GATEWAY_MAX_BODY_BYTES."},
    415: {"model": ErrorBody, "description": "The body is not sent as JSON (Content-Type: application/json)."},
}
SSE_DOC = {"text/event-stream": {"schema": {"type": "string", "description": "SSE: id = Redis stream id."}}}
_ERROR_JSON = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
SSE_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": doc["description"], "content": _ERROR_JSON} for code, doc in ERRORS.items()
}
"""The errors of a route whose 200 is an SSE stream: JSON like everywhere else (not its route's media type)."""
Wait = Annotated[bool, Query(description="Answer with how the turn ended (completed, suspended, failed, cancelled).")]
LastEventId = Annotated[
    str | None,
    Header(alias="Last-Event-ID", pattern=STREAM_ID_PATTERN, description="Continue after this event (SSE reconnect)."),
]


def events_path(ref: SessionRef, turn_id: str) -> str:
    """The turn's SSE route, every segment percent-encoded (a session id may hold ``?``, ``#`` or ``%``)."""
    agent, session, turn = (urllib.parse.quote(part, safe="") for part in (ref.agent, ref.session, turn_id))
    return f"/v1/agents/{agent}/sessions/{session}/turns/{turn}/events"


def sse_response(backend: GatewayBackend, ref: SessionRef, turn_id: str | None, last_id: str) -> SSEResponse:
    s = backend.settings

    def produce(gone: Callable[[], bool]) -> AsyncIterator[bytes]:
        return follow_events(
            backend.redis,
            backend.keys,
            ref,
            turn_id=turn_id,
            last_id=last_id,
            heartbeat_s=s.heartbeat_s,
            max_stream_s=s.max_stream_s,
            batch=s.stream_batch,
            gone=gone,
        )

    headers = {"X-Turn-Id": turn_id} if turn_id else {}
    return SSEResponse(produce, backend.stats, headers=headers)


def outcome(item: StreamEvent) -> TurnOutcome:
    """How a turn ended, from its terminal event."""
    e, base = item.event, {"turn_id": item.event.turn_id, "last_event_id": item.stream_id}
    if isinstance(e, TurnCompleted):
        return TurnOutcome(status="completed", text=e.text, **base)
    if isinstance(e, InputRequested):
        return TurnOutcome(status="suspended", input=e.request.model_dump(mode="json", by_alias=True), **base)
    if isinstance(e, TurnFailed):
        error = {"message": e.error.message, "type": e.error.type, "phase": e.phase, "step": e.step}
        return TurnOutcome(status="failed", error=error, **base)
    assert isinstance(e, TurnCancelled)
    return TurnOutcome(status="cancelled", reason=e.reason, **base)


def recorded_outcome(rec: TurnRecord, last_id: str) -> TurnOutcome | None:
    """How a turn ended, from its row (when the stream lost its terminal event in a gap); None while unfinished."""
    r, base = rec.result, {"turn_id": rec.turn_id, "last_event_id": last_id}
    if r is None or rec.status in ("queued", "running"):
        return None
    if isinstance(r, Completed):
        return TurnOutcome(status="completed", text=r.text, **base)
    if isinstance(r, Suspended):
        inputs = [q.model_dump(mode="json", by_alias=True) for q in (r.request, *r.more)]
        return TurnOutcome(status="suspended", input=inputs[0], inputs=inputs if r.more else None, **base)
    if isinstance(r, Failed):
        error = {"message": r.error.message, "type": r.error.type, "phase": r.phase, "step": r.step}
        return TurnOutcome(status="failed", error=error, **base)
    if isinstance(r, Rejected):
        return TurnOutcome(status="failed", error={"message": r.reason, "type": None, "phase": "intake"}, **base)
    return TurnOutcome(status="cancelled", reason=r.reason, **base)


async def wait_outcome(backend: GatewayBackend, ref: SessionRef, turn_id: str, last_id: str) -> JSONResponse:
    s = backend.settings
    deadline, last_seq = time.monotonic() + s.wait_s, None
    while (remaining := deadline - time.monotonic()) > 0:
        events = afollow(
            backend.redis, ref.agent, ref.session, turn_id=turn_id, last_id=last_id, timeout_s=remaining,
            block_ms=5000, count=s.stream_batch, include_deltas=False, keys=backend.keys, last_seq=last_seq,
        )  # fmt: skip
        try:
            async with contextlib.aclosing(events):
                async for item in events:
                    if is_terminal(item.event):
                        return JSONResponse(outcome(item).model_dump(mode="json"))
            break
        except StreamGapError as gap:  # the terminal event may be among those trimmed: the turn's row has it
            rec = await backend.turn(ref, turn_id)
            ended = recorded_outcome(rec, gap.resume_id) if rec is not None else None
            if ended is not None:
                return JSONResponse(ended.model_dump(mode="json"))
            last_id, last_seq = gap.resume_id, (gap.next_seq - 1 if gap.next_seq is not None else None)
    raise HTTPException(
        status_code=504,
        detail=f"turn {turn_id} did not end within {s.wait_s:g}s; it goes on: follow {events_path(ref, turn_id)}",
    )


def inbound_event(request: Request, principal: Principal, text: str) -> dict[str, Any]:
    """The inbound event of a turn started here: the speaker is the verified principal (attested), and what they
    said (its ``turn.started`` shows a follower of the session, the page's Watch session, what the person typed)."""
    source = request.app.state.settings.event_source
    return {
        "source": source,
        "kind": "message",
        "user": {"id": principal.id, "attested": True},
        "principal": principal.to_json(),
        "text": text,
    }


@router.get("/agents", response_model=AgentList, responses={401: ERRORS[401]}, summary="Agents this token sees")
async def list_agents(request: Request, principal: Authenticated) -> AgentList:
    agents = [a for a in request.app.state.settings.agents if principal.sees(a)]
    return AgentList(principal=principal.id, agents=agents, operator=principal.operator)


@router.post(
    SESSION + "/turns",
    status_code=202,
    dependencies=[Depends(json_body)],
    response_model=TurnAccepted,
    summary="Start a turn",
    responses={
        **ERRORS,
        **BODY_ERRORS,
        200: {"model": TurnOutcome, "content": SSE_DOC, "description": "With ?wait=true, or an SSE stream."},
        409: {"model": ErrorBody, "description": "The session is parked on another turn's input."},
        504: {"model": ErrorBody, "description": "?wait=true: the turn did not end in time (it goes on)."},
    },
)
async def start_turn(
    request: Request, agent: AgentName, session: SessionId, body: TurnRequest, principal: Authenticated,
    backend: Backend, wait: Wait = False,
) -> Response:  # fmt: skip
    """Enqueue a turn (``june.turn``). ``Accept: text/event-stream``: the response is the turn's events until
    its terminal event; ``?wait=true``: how it ended; otherwise 202 with its ``turn_id`` at once."""
    ref = await use_session(request, principal, agent, session, "start")
    turn_id = body.turn_id or new_turn_id()
    existing = await backend.turn(ref, turn_id) if body.turn_id else None
    if existing is None:
        parked = await backend.park_in_the_way(ref)  # none while a reset is pending: the turn runs after it (S90)
        if parked is not None and parked.turn_id != turn_id:
            raise HTTPException(
                status_code=409,
                detail=f"session {session!r} is parked on turn {parked.turn_id}, waiting for input "
                f"{parked.request.id!r}: answer it (resume) or reset the session before starting another turn",
            )
    start_id = "0-0" if existing is not None else await backend.tail(ref)
    await backend.start_turn(
        ref, turn_id, body.text, event=inbound_event(request, principal, body.text), replace=body.replace
    )
    log.info("turn %s of %s sent for %s", turn_id, ref, principal.id)
    if wants_sse(request):
        return sse_response(backend, ref, turn_id, start_id)
    if wait:
        return await wait_outcome(backend, ref, turn_id, start_id)
    accepted = TurnAccepted(turn_id=turn_id, agent=agent, session=session, events=events_path(ref, turn_id))
    return JSONResponse(accepted.model_dump(), status_code=202, headers={"Location": events_path(ref, turn_id)})


async def known_turn(
    request: Request, principal: Principal, agent: str, session: str, turn_id: str, action: Action
) -> SessionRef:
    """The turn's session, if the caller may ``action`` it and the turn is known; else "unknown turn" (404)."""
    ref = await use_session(request, principal, agent, session, action, turn_id=turn_id)
    backend: GatewayBackend = request.app.state.backend
    if await backend.turn(ref, turn_id) is None and not await backend.turn_sent(ref, turn_id):
        raise unknown_turn(agent, session, turn_id)
    return ref


@router.get(TURN, response_model=TurnInfo, responses=ERRORS, summary="A turn's status")
async def get_turn(
    request: Request, agent: AgentName, session: SessionId, turn_id: TurnIdPath, principal: Authenticated,
    backend: Backend,
) -> TurnInfo:  # fmt: skip
    ref = await known_turn(request, principal, agent, session, turn_id, "follow")
    rec = await backend.turn(ref, turn_id)
    if rec is None:
        return TurnInfo(turn_id=turn_id, status="sent")
    result = rec.result.model_dump(mode="json", by_alias=True, exclude={"turn_id"}) if rec.result else None
    return TurnInfo(turn_id=turn_id, status=rec.status, result=result)


@router.get(
    TURN + "/events",
    response_class=SSEResponse,
    responses={
        **SSE_ERRORS,
        200: {"content": SSE_DOC, "description": "The turn's events, ending on its terminal one."},
    },
    summary="Follow a turn (SSE)",
)
async def turn_events(
    request: Request, agent: AgentName, session: SessionId, turn_id: TurnIdPath, principal: Authenticated,
    backend: Backend, last_event_id: LastEventId = None,
) -> Response:  # fmt: skip
    """The turn's events from its start (or after ``Last-Event-ID``), ending after its terminal event
    (``turn.completed``, ``turn.failed``, ``turn.cancelled``, or ``input.requested``: parked)."""
    last_event_id = stream_id(last_event_id, ("header", "Last-Event-ID"))
    ref = await known_turn(request, principal, agent, session, turn_id, "follow")
    return sse_response(backend, ref, turn_id, last_event_id or "0-0")


@router.get(
    SESSION + "/events",
    response_class=SSEResponse,
    responses={**SSE_ERRORS, 200: {"content": SSE_DOC, "description": "The session's events, live."}},
    summary="Follow a session (SSE)",
)
async def session_events(
    request: Request, agent: AgentName, session: SessionId, principal: Authenticated, backend: Backend,
    last_event_id: LastEventId = None,
    after: Annotated[
        str | None,
        Query(pattern=r"^(\d{1,20}(-\d{1,20})?|\$)$", description="Start after this stream id; '$': only new events."),
    ] = None,
) -> Response:  # fmt: skip
    """Every event of the session after ``Last-Event-ID`` (or ``after``; from the start by default), then
    live ones. It does not end on a turn's end; it ends after JUNE_GATEWAY_MAX_STREAM_S (reconnect)."""
    start = stream_id(last_event_id, ("header", "Last-Event-ID")) or stream_id(after, ("query", "after")) or "0-0"
    ref = await use_session(request, principal, agent, session, "follow")
    if start == "$":
        start = await backend.tail(ref)
    return sse_response(backend, ref, None, start)


@router.post(
    TURN + "/resume",
    status_code=202,
    dependencies=[Depends(json_body)],
    response_model=ResumeAccepted,
    summary="Answer a parked turn",
    responses={
        **ERRORS,
        **BODY_ERRORS,
        200: {"model": TurnOutcome, "content": SSE_DOC, "description": "With ?wait=true, or an SSE stream."},
        403: {"model": ErrorBody, "description": "This principal may not answer the request."},
        409: {"model": ErrorBody, "description": "Wrong turn or input id, not suspended, or a reset is pending."},
        500: {"model": ErrorBody, "description": "authorize_answer failed; the answer was NOT applied."},
        504: {"model": ErrorBody, "description": "No worker answered in time, or ?wait=true ran out."},
    },
)
async def resume(
    request: Request, agent: AgentName, session: SessionId, turn_id: TurnIdPath, body: ResumeRequest,
    principal: Authenticated, backend: Backend, wait: Wait = False,
) -> Response:  # fmt: skip
    """Answer the input the turn is parked on, as the token's principal (``by``), and let the turn go on.
    ``Accept: text/event-stream`` streams the continuation; ``?wait=true`` answers with how it ended."""
    ref = await use_session(request, principal, agent, session, "resume")
    start_id = await backend.tail(ref)
    result = await backend.resume(
        ref, turn_id, body.input_id, body.value, by=principal.id, principal=principal.to_json()
    )
    reason = result.reason or result.status
    if result.status == "forbidden":
        raise HTTPException(status_code=403, detail=reason)
    if result.status == "conflict":
        raise HTTPException(status_code=409, detail=reason)
    if result.status in ("invalid", "rejected"):
        raise HTTPException(status_code=422, detail=[{"loc": ["body", "value"], "msg": reason, "type": result.status}])
    if result.status == "error":
        raise HTTPException(
            status_code=500, detail=f"the answer was NOT applied; the same answer can be retried ({reason})"
        )
    log.info("turn %s of %s resumed (input %s) by %s", turn_id, ref, body.input_id, principal.id)
    if result.open and not wants_sse(request):  # other requests still open: the turn waits for them
        accepted = ResumeAccepted(turn_id=turn_id, input_id=body.input_id, by=principal.id, open=list(result.open))
        return JSONResponse(accepted.model_dump(), status_code=202, headers={"Location": events_path(ref, turn_id)})
    if wants_sse(request):
        return sse_response(backend, ref, turn_id, start_id)
    if wait:
        return await wait_outcome(backend, ref, turn_id, start_id)
    accepted = ResumeAccepted(turn_id=turn_id, input_id=body.input_id, by=principal.id)
    return JSONResponse(accepted.model_dump(), status_code=202, headers={"Location": events_path(ref, turn_id)})
