"""What keeps the gateway's requests and answers bounded: body size, error echoes, and the access log.

* :class:`BodyLimit`: a body over ``max_body_bytes`` is a 413, decided from ``Content-Length``
  before reading, or while reading a body sent without one; never buffered whole.
* :func:`validation_error`: a 422 names the field and the rule, and echoes at most
  :data:`ECHO_CHARS` characters of what was sent (a 10 MB field is not sent back).
* :func:`body_parse_error`: a body that is not UTF-8, or JSON nested too deep to parse, is the
  same 422 ``json_invalid`` as any other body that is not JSON (FastAPI says 400).
* :class:`QueryRedaction`: the access log shows a query parameter only where its name is one of
  the gateway's own and its value has that parameter's shape (:data:`QUERY_SHAPES`); anything else
  is ``[redacted]``, so a token sent as ``?access_token=...``, ``?<token>`` or ``?wait=true;<token>``
  (and refused) is not written down.

The rule a reader must not break: **nothing a client sent is echoed or logged unbounded**.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "ECHO_CHARS",
    "QUERY_SHAPES",
    "REDACTED",
    "BodyLimit",
    "BodyTooLarge",
    "QueryRedaction",
    "body_parse_error",
    "install_query_redaction",
    "redact_query",
    "validation_error",
]

ECHO_CHARS = 200
REDACTED = "[redacted]"


def _pattern(regex: str) -> Callable[[str], bool]:
    compiled = re.compile(regex)
    return lambda value: compiled.fullmatch(value) is not None


def _console_cursor(value: str) -> bool:
    """A cursor the console made: base64url of a JSON array (see ``console.encode_cursor``)."""
    if len(value) > 2048 or re.fullmatch(r"[A-Za-z0-9_\-]+", value) is None:
        return False
    try:
        key = json.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
    except (ValueError, binascii.Error):
        return False
    return isinstance(key, list)


QUERY_SHAPES: dict[str, Callable[[str], bool]] = {
    "wait": _pattern(r"(?i)(1|0|t|f|y|n|true|false|yes|no|on|off)"),  # what a bool query parameter accepts
    "after": _pattern(r"\d{1,20}(-\d{1,20})?|\$"),
    "after_seq": _pattern(r"\d{1,20}"),
    "limit": _pattern(r"\d{1,4}"),
    "status": _pattern(r"new|running|suspended|done|rejected"),
    "cursor": _console_cursor,
}
"""Every query parameter of the gateway's routes, and the shape of a value the access log may show.

A value of another shape (``wait=true;access_token=...``) and a parameter of another name are
``[redacted]``: only what the gateway itself would accept is written down (a test checks that every
route's query parameters are here).
"""


class BodyTooLarge(HTTPException):
    """A request body over the limit (an HTTPException, so the framework answers it as the 413 it is)."""

    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=f"the request body is larger than {limit} bytes")


class BodyLimit:
    """ASGI middleware: refuse a request body over ``limit`` bytes with 413, without reading it whole."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            too_large = BodyTooLarge(self.limit)
            # Connection: close, as the body is left unread: the server will not read on into the next request.
            await JSONResponse({"detail": too_large.detail}, 413, headers={"Connection": "close"})(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)


def _clip(value: Any) -> Any:
    """What a 422 may echo of ``value``: itself if its JSON is short, else the first :data:`ECHO_CHARS`
    characters of its text, marked as cut. Always something the answer's JSON can hold: a value that
    JSON cannot (bytes, NaN, an object) or UTF-8 cannot (a lone surrogate) is echoed as its text, escaped,
    so the 422 is never a 500."""
    try:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")  # a lone surrogate ("\ud800" in the JSON sent) has no UTF-8: UnicodeEncodeError
        safe = value
    except (TypeError, ValueError, RecursionError):
        safe = text = _text(value)
    if len(text) <= ECHO_CHARS:
        return safe
    return text[:ECHO_CHARS] + f"… ({len(text)} characters)"


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")  # at most max_body_bytes (BodyLimit)
    try:
        text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return repr(type(value))
    return text.encode("utf-8", errors="backslashreplace").decode("utf-8")  # "\ud800" stays readable


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 (``detail: [{type, loc, msg, input, ctx}]``), with ``input`` and ``ctx`` bounded."""
    assert isinstance(exc, RequestValidationError)
    errors: list[dict[str, Any]] = []
    for error in exc.errors()[:20]:
        out = {"type": error.get("type"), "loc": list(error.get("loc", ())), "msg": _clip(str(error.get("msg", "")))}
        if "input" in error:
            out["input"] = _clip(error["input"])
        ctx = error.get("ctx")
        if isinstance(ctx, dict):
            out["ctx"] = {
                str(k): _clip(v if isinstance(v, (str, int, float, bool)) else str(v)) for k, v in ctx.items()
            }
        errors.append(out)
    return JSONResponse({"detail": errors}, status_code=422)


async def body_parse_error(request: Request, exc: Exception) -> Response:
    """A body FastAPI could not parse (invalid UTF-8, JSON nested too deep) is a 422 ``json_invalid``."""
    assert isinstance(exc, HTTPException)
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, (UnicodeDecodeError, RecursionError)):
        why = "not UTF-8" if isinstance(cause, UnicodeDecodeError) else "nested too deep"
        error = {"type": "json_invalid", "loc": ["body"], "msg": f"JSON decode error: the body is {why}"}
        return JSONResponse({"detail": [error]}, status_code=422)
    return await http_exception_handler(request, exc)


class QueryRedaction(logging.Filter):
    """On uvicorn's access log: replace the value of every query parameter but the gateway's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


def redact_query(path: str) -> str:
    """``/p?wait=1&access_token=abc&wait=x`` → ``/p?wait=1&[redacted]&wait=[redacted]``.

    A parameter of a name the gateway does not take is ``[redacted]`` whole (its name may be the
    secret: ``?<token>``); one it takes keeps its value only if the value has the parameter's shape.
    """
    base, _, query = path.partition("?")
    parts = []
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True, errors="replace"):
        shape = QUERY_SHAPES.get(name)
        if shape is None:
            parts.append(REDACTED)
            continue
        shown = value if value == "" or shape(value) else REDACTED
        parts.append(f"{name}={urllib.parse.quote(shown, safe='[]$')}")
    return f"{base}?{'&'.join(parts)}"


def install_query_redaction() -> None:
    """Attach :class:`QueryRedaction` to ``uvicorn.access`` once per process."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QueryRedaction) for f in access.filters):
        access.addFilter(QueryRedaction())
