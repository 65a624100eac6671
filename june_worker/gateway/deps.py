"""What every route needs first: the caller's principal, the session it addresses, and the 404 rules.

An agent the workers do not serve and an agent the token is not granted are the same 404,
word for word, so a token cannot learn which agents exist; a session the caller may not use
(:mod:`.access`) and one that does not exist are the same 404 too.
"""

from __future__ import annotations

import email.message
import re
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..engine.secrets import scrubbed_logger
from ..engine.store import SessionRef
from .access import Action, HookFailed, SessionState, allowed
from .auth import Principal
from .backend import GatewayBackend
from .settings import GatewaySettings

__all__ = [
    "AgentName",
    "Authenticated",
    "Backend",
    "SessionId",
    "TurnIdPath",
    "authenticate",
    "json_body",
    "not_found",
    "stream_id",
    "use_session",
    "wants_sse",
]

log = scrubbed_logger("june_worker.gateway")

_bearer = HTTPBearer(
    auto_error=False,
    description="A token from JUNE_GATEWAY_TOKENS / JUNE_GATEWAY_TOKENS_FILE: `Authorization: Bearer <token>`.",
)
STREAM_ID_PATTERN = r"^\d{1,20}(-\d{1,20})?$"
STREAM_ID_RE = re.compile(STREAM_ID_PATTERN)
_STREAM_ID_MAX = 2**64 - 1  # each part of a Redis stream id is an unsigned 64-bit number

AgentName = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.\-]{1,128}$", description="An agent name.")]
SessionId = Annotated[
    str,
    Path(pattern=r"^[\x21-\x7e]{1,256}$", description="The app's session id: printable ASCII, no spaces, no '/'."),
]
TurnIdPath = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$", description="A turn id.")]


def get_backend(request: Request) -> GatewayBackend:
    backend: GatewayBackend = request.app.state.backend
    return backend


def get_settings(request: Request) -> GatewaySettings:
    settings: GatewaySettings = request.app.state.settings
    return settings


Backend = Annotated[GatewayBackend, Depends(get_backend)]


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status_code=401, detail=detail, headers={"WWW-Authenticate": "Bearer"})


async def authenticate(  # async: a sync dependency would cost a thread hop on every request
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
) -> Principal:
    """The verified caller; 401 without a known bearer token (unless insecure development mode)."""
    settings = get_settings(request)
    if credentials is None:
        if settings.insecure_dev:
            return Principal(id=settings.dev_principal, operator=True)
        raise _unauthorized("a bearer token is required: Authorization: Bearer <token>")
    principal = settings.tokens.lookup(credentials.credentials)
    if principal is None:
        client = request.client.host if request.client else "?"
        log.warning("refused %s %s from %s: unknown bearer token", request.method, request.url.path, client)
        raise _unauthorized("unknown bearer token")
    return principal


Authenticated = Annotated[Principal, Depends(authenticate)]


def is_json(content_type: str) -> bool:
    """``application/json`` or ``application/<anything>+json``, whatever its parameters (what FastAPI parses)."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


async def json_body(request: Request, principal: Authenticated) -> None:
    """415 for a body sent as anything but JSON (``text/plain``, XML, a form, or no ``Content-Type`` at all).

    415, not 422: the body is not refused for what it says but for the format it declares, which
    the route does not read; the client fixes its ``Content-Type``, not its content. An empty body
    is left to the route (the 422 naming the missing body). After the caller is known: a 401 first.
    """
    content_type = request.headers.get("content-type", "")
    if is_json(content_type) or not await request.body():
        return
    message = email.message.Message()
    message["content-type"] = content_type
    got = message.get_content_type() if content_type else "no Content-Type"
    raise HTTPException(
        status_code=415,
        detail=f"the request body must be JSON, sent with Content-Type: application/json (got {got[:100]})",
    )


def not_found(what: str) -> HTTPException:
    return HTTPException(status_code=404, detail=what)


def check_agent(request: Request, principal: Principal, agent: str) -> None:
    if agent not in get_settings(request).agents or not principal.sees(agent):
        raise not_found(f"unknown agent {agent!r}")


def unknown_session(agent: str, session: str) -> HTTPException:
    return not_found(f"unknown session {session!r} of agent {agent!r}")


def unknown_turn(agent: str, session: str, turn_id: str) -> HTTPException:
    return not_found(f"unknown turn {turn_id!r} in session {session!r} of agent {agent!r}")


async def use_session(
    request: Request, principal: Principal, agent: str, session: str, action: Action, *, turn_id: str | None = None
) -> SessionRef:
    """The addressed session, if the caller may ``action`` it (:mod:`.access`).

    Otherwise the 404 of a session that does not exist, word for word: "unknown turn" on a turn's
    route, "unknown session" elsewhere. Every action but ``start`` needs the session to exist; a
    ``start`` that opens a new session records the caller as its owner (if another caller got
    there first, the 404).
    """
    check_agent(request, principal, agent)
    backend = get_backend(request)
    ref = SessionRef(agent, session)
    state = await backend.session_state(ref)
    hook = get_settings(request).authorize_session
    try:
        ok = await allowed(principal, agent, session, action, state, hook, backend.blocking)
        if ok and action == "start" and not state.exists:
            owner = await backend.claim(ref, principal.id)
            if owner != principal.id:  # another caller opened it in between: decide again, as its owner's
                ok = await allowed(principal, agent, session, action, SessionState(owner, True), hook, backend.blocking)
    except HookFailed:
        raise HTTPException(status_code=503, detail="session access could not be decided; retry later") from None
    if not ok or (action != "start" and not state.exists):
        raise unknown_turn(agent, session, turn_id) if turn_id is not None else unknown_session(agent, session)
    return ref


def stream_id(value: str | None, loc: tuple[str, str]) -> str | None:
    """A stream id from a request, or a 422 naming ``loc`` when a part is past Redis's range (2^64 - 1)."""
    if value is None or value == "$":
        return value
    if any(int(part) > _STREAM_ID_MAX for part in value.split("-")):
        raise HTTPException(
            status_code=422,
            detail=[{"loc": list(loc), "msg": f"a stream id part is at most {_STREAM_ID_MAX}", "type": "value_error"}],
        )
    return value


def wants_sse(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "").lower()
