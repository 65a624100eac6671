"""Slack's Events API and interactivity endpoints: verify, enqueue, answer 200 within Slack's 3 seconds.

``POST /slack/events`` and ``POST /slack/interactivity`` (turned on by ``SLACK_SIGNING_SECRET``,
:mod:`.slack_settings`). Each request's signature is checked first, as Slack documents it:
HMAC-SHA256 of ``v0:<timestamp>:<body>`` over the body's raw bytes under the signing secret,
compared in constant time, a timestamp more than five minutes away refused. A missing, garbled, bad
or old signature is a 401 and nothing else happens (never a 500: ``slack_sdk``'s
``SignatureVerifier`` raises on a missing or non-numeric timestamp and on a body that is not UTF-8,
so it is not used); a signed body that is not UTF-8 is a 400. Then:

* ``url_verification`` answers its challenge;
* an event that starts a turn (:func:`~june_worker.channels.slack.inbound.parse_event`) is sent as
  ``june.turn`` with the thread as its ``target``: the worker runs and renders it. Its turn id is
  derived from the event, so Slack's retries never start a second turn (the worker records a turn
  id once, and the gateway does not even send an event it sent already: each copy claims the turn
  id in Redis with ``SET NX`` before sending, and a send that fails gives the claim back);
* a click on Approve / Deny (:func:`~june_worker.channels.slack.inbound.parse_actions`) is sent as
  ``june.resume`` by the clicker's verified id, not waited for: the worker tells a refused
  clicker, and only them, in an ephemeral note, and renders the continuation into the prompt.

A payload that is not Slack's is a 400 naming what is wrong. This process makes no Slack call
and holds no bot token: rendering is the worker's. The Slack app is a principal of its own
(``slack``, confined to ``slack:`` sessions of one agent) and goes through :mod:`.access` like
every other caller. Why not ``slack_bolt``: its app wants the bot token (or an authorize
function) in the process that receives requests and dispatches to listeners of its own, while
this process only verifies and enqueues.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import inspect
import json
import logging
import re
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from ..channels.slack.inbound import SlackPayloadError, clicker_team, parse_actions, parse_event, speaker_team
from ..engine.types import Principal as EventPrincipal
from .auth import Principal
from .deps import get_backend, get_settings, use_session
from .slack_settings import SlackGatewaySettings

__all__ = ["router"]

log = logging.getLogger("june_worker.gateway.slack")

router = APIRouter(prefix="/slack", tags=["slack"])

_OK = {"ok": True}
_CLAIM_S = 30
"""How long a claim on an event lasts while it is being sent: a gateway that died mid-send blocks Slack's later
retries of it (about 1 and 5 minutes on) no longer than this."""


_TWIN_WAIT_S = 2.0
"""How long a copy of an event that another request is sending waits for that send, inside Slack's 3 s."""


async def _sent_by_its_twin(client: Any, seen: str) -> bool:
    """Whether the request that claimed ``seen`` sent its turn, waiting up to :data:`_TWIN_WAIT_S` for it to say."""
    deadline = asyncio.get_running_loop().time() + _TWIN_WAIT_S
    while True:
        state = await client.get(seen)
        if state in ("1", b"1"):
            return True
        if state is None or asyncio.get_running_loop().time() >= deadline:  # its send failed, or is slow
            return False
        await asyncio.sleep(0.05)


def _slack(request: Request) -> SlackGatewaySettings:
    slack = get_settings(request).slack
    assert slack is not None, "the Slack routes are mounted only with Slack settings"
    return slack


_MAX_AGE_S = 300
"""A request signed longer ago than this is refused (Slack's own rule: a replayed request is stale)."""
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_SIGNATURE = re.compile(r"v0=[0-9a-f]{64}")


def _signature_problem(
    secret: str, body: bytes, timestamp: str | None, signature: str | None, now: float
) -> str | None:
    """What is wrong with a request's Slack signature, or None when Slack signed ``body`` within five minutes.

    Slack signs ``v0:<timestamp>:<body>`` over the body's raw bytes (HMAC-SHA256 under the signing secret). Checked
    here on bytes, never decoded first: a body that is not UTF-8 is still signed or not, and a missing or garbled
    header is a refusal, never an exception (``slack_sdk``'s verifier raises on both).
    """
    if not timestamp:
        return "no X-Slack-Request-Timestamp header"
    if not _TIMESTAMP.fullmatch(timestamp):
        return "X-Slack-Request-Timestamp is not a number of seconds"
    if not signature:
        return "no X-Slack-Signature header"
    if not _SIGNATURE.fullmatch(signature):
        return "X-Slack-Signature is not 'v0=' and 64 hex digits"
    if abs(now - int(timestamp)) > _MAX_AGE_S:
        return "the signature's timestamp is more than five minutes away"
    expected = hmac.new(secret.encode(), b"v0:" + timestamp.encode() + b":" + body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(f"v0={expected}".encode(), signature.encode()):
        return "the signature does not match the body"
    return None


async def _verified(request: Request) -> bytes:
    """The request's body, if Slack signed it within the last five minutes; else 401 (nothing else happens)."""
    body = await request.body()
    problem = _signature_problem(
        _slack(request).signing_secret, body, request.headers.get("X-Slack-Request-Timestamp"),
        request.headers.get("X-Slack-Signature"), time.time(),
    )  # fmt: skip
    if problem is not None:
        client = request.client.host if request.client else "?"
        log.warning("refused %s from %s: %s", request.url.path, client, problem)
        raise HTTPException(status_code=401, detail="invalid or expired Slack request signature")
    return body


def _text(body: bytes) -> str:
    """A verified body as text; 400 when it is not UTF-8 (Slack sends UTF-8 only)."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(f"the body is not UTF-8 (byte {exc.start})") from None


def _bad(detail: str) -> HTTPException:
    return HTTPException(status_code=400, detail=f"not a Slack payload: {detail}")


def _principal(slack: SlackGatewaySettings) -> Principal:
    return Principal(id="slack", agents=frozenset({slack.agent}), session_prefixes=("slack:",))


async def _resolve(
    request: Request, user: str, team: str | None, *, user_team: str | None, channel: str | None
) -> EventPrincipal | None:
    """The app's principal for a Slack user; None (anonymous, the turn still runs) when the hook fails or is slow.

    ``team``: the workspace that received the request; ``user_team``: the sender's own (Slack Connect).
    """
    slack = _slack(request)
    hook = slack.resolve_identity
    if hook is None:
        return None
    extra = slack.resolver_arguments(user_team, channel)  # only the keywords the hook names: old ones take two
    try:
        if inspect.iscoroutinefunction(hook):
            found: Any = await asyncio.wait_for(hook(user, team, **extra), slack.resolve_timeout_s)
        else:
            backend = get_backend(request)
            found = await asyncio.wait_for(backend.blocking(lambda: hook(user, team, **extra)),
                                           slack.resolve_timeout_s)  # fmt: skip
        if found is None:
            return None
        if not isinstance(found, Mapping) or not isinstance(found.get("id"), str):
            raise TypeError(f"returned {type(found).__name__}, not a mapping with an 'id'")
        return EventPrincipal.model_validate(dict(found))
    except Exception as exc:  # the app's directory is down or slow: the speaker stays attested, the turn anonymous
        log.warning("the Slack identity resolver failed (%s); the turn runs without a principal", type(exc).__name__)
        return None


@router.post("/events", summary="Slack Events API (signed by Slack)", response_model=None)
async def events(request: Request) -> Response:
    text = _text(await _verified(request))
    try:
        payload = json.loads(text)
    except ValueError:
        raise _bad("the body is not JSON") from None
    if not isinstance(payload, dict):
        raise _bad("the body is not a JSON object")
    kind = payload.get("type")
    if kind == "url_verification":
        challenge = payload.get("challenge")
        if not isinstance(challenge, str):
            raise _bad("url_verification without a challenge")
        return JSONResponse({"challenge": challenge})
    if kind != "event_callback":
        return JSONResponse(_OK)
    slack = _slack(request)
    try:
        turn = parse_event(payload, respond_to=slack.respond_to, replace_in_flight=slack.replace_in_flight)
        user_team = speaker_team(payload) if turn is not None else None
    except SlackPayloadError as exc:
        raise _bad(str(exc)) from None
    if turn is None:
        return JSONResponse(_OK)
    backend = get_backend(request)
    ref = await use_session(request, _principal(slack), slack.agent, turn.session, "start")
    seen = backend.keys.gateway_slack_seen(ref, turn.turn_id)
    # Claimed before sending, in one command: the message and app_mention copies of one message arrive at once,
    # and only one of them may be sent (a copy that replaces in flight must not race its twin).
    if not await backend.redis.set(seen, "sending", ex=_CLAIM_S, nx=True):
        retry = request.headers.get("X-Slack-Retry-Num", "-")
        if await _sent_by_its_twin(backend.redis, seen):
            log.info("Slack delivered the event of turn %s again (retry %s); sent already", turn.turn_id, retry)
            return JSONResponse(_OK)
        # The copy that claimed it is still sending (a broker slow or down) or gave up: a 200 now would stop
        # Slack's retries, and the message would be lost if that send fails. Slack tries this copy again.
        log.info("Slack delivered the event of turn %s again (retry %s) while it is being sent; not yet acknowledged",
                 turn.turn_id, retry)  # fmt: skip
        return JSONResponse({"ok": False, "error": "the same event is being sent; retry later"}, status_code=503)
    try:
        user = turn.event.user.id if turn.event.user else ""
        team, channel = turn.target.get("team_id"), turn.target.get("channel_id")
        principal = await _resolve(request, user, team if isinstance(team, str) else None, user_team=user_team,
                                   channel=channel if isinstance(channel, str) else None)  # fmt: skip
        event = turn.event.model_copy(update={"principal": principal}) if principal else turn.event
        await backend.start_turn(
            ref, turn.turn_id, turn.text, event=event.model_dump(mode="json", exclude_none=True),
            replace=turn.replace, target=dict(turn.target),
        )  # fmt: skip
    except Exception:
        with contextlib.suppress(Exception):  # not sent: Slack's retry may send it (if Redis is gone too, in _CLAIM_S)
            await backend.redis.delete(seen)
        raise
    await backend.redis.set(seen, "1", ex=slack.dedupe_ttl_s)
    log.info("Slack %s in %s sent as turn %s", turn.event.kind, ref, turn.turn_id)
    return JSONResponse(_OK)


@router.post("/interactivity", summary="Slack interactivity: Approve / Deny clicks (signed by Slack)")
async def interactivity(request: Request) -> Response:
    text = _text(await _verified(request))
    try:
        form = urllib.parse.parse_qs(text, strict_parsing=True)
        payload = json.loads(form["payload"][0])
    except (ValueError, KeyError):
        raise _bad("expected a form with a JSON payload field") from None
    if not isinstance(payload, dict):
        raise _bad("the payload is not a JSON object")
    try:
        answers = parse_actions(payload)
        user_team = clicker_team(payload) if answers else None
    except SlackPayloadError as exc:
        raise _bad(str(exc)) from None
    slack = _slack(request)
    backend = get_backend(request)
    for answer in answers:
        ref = await use_session(request, _principal(slack), slack.agent, answer.session, "resume")
        team = payload.get("team", {}).get("id") if isinstance(payload.get("team"), dict) else None
        channel = answer.reply_to.get("channel_id")
        principal = await _resolve(request, answer.by, team if isinstance(team, str) else None, user_team=user_team,
                                   channel=channel if isinstance(channel, str) else None)  # fmt: skip
        await backend.send_resume(
            ref, answer.turn_id, answer.input_id, answer.value, by=answer.by,
            principal=principal.model_dump(mode="json") if principal else None, reply_to=dict(answer.reply_to),
        )  # fmt: skip
        log.info("Slack answer to %s of %s (input %s) sent, by %s", answer.turn_id, ref, answer.input_id, answer.by)
    return Response(status_code=200)
