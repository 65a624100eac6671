"""The gateway's ASGI app: ``uvicorn june_worker.gateway.app:create_app --factory``.

:func:`create_app` reads the settings once (or takes them), loads nothing else at import
time, and opens its clients in the lifespan. Besides the ``/v1`` routes it serves the live
turn page at ``/``, the operator console at ``/console``, ``/metrics``, ``/healthz`` (no token: Redis and Postgres answer?) and the OpenAPI
schema at ``/openapi.json`` (and ``/docs``).

SIGHUP reloads the token table (``JUNE_GATEWAY_TOKENS_FILE`` read again) without a restart: a revoked
token is refused from then on. A table that does not load keeps the one in use, saying why in the log.

The rule a reader must not break: **errors from the services behind the gateway become
502/503/504 with a sentence**, never a traceback or a URL with its password.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import logging
import re
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from importlib import resources

import psycopg
import psycopg_pool
import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from redis.exceptions import RedisClusterException
from starlette.exceptions import HTTPException

from producers import BrokerUnavailable, ResultTimeout, ResultUnavailable, TaskFailed, UnexpectedResult

from .. import __version__
from ..engine.secrets import scrub_handlers, scrubbed_logger
from ..errors import ConfigError, StoreUnavailableError
from .auth import TokenTable
from .backend import GatewayBackend
from .guards import BodyLimit, body_parse_error, install_query_redaction, validation_error
from .metrics import install_metrics
from .routes import router as turn_router
from .routes_console import router as console_router
from .routes_control import router as control_router
from .routes_log import router as log_router
from .settings import GatewaySettings, token_loader

__all__ = ["create_app"]

log = scrubbed_logger("june_worker.gateway")


def _page(name: str) -> tuple[str, dict[str, str]]:
    """A page and its headers: a CSP that allows exactly its own inline script and style (by hash)."""
    html = resources.files(__package__).joinpath(name).read_text(encoding="utf-8")

    def hashes(tag: str) -> str:
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)

    csp = (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html, {
        "Content-Security-Policy": csp,
        "Cache-Control": "no-cache",
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
    }


def _warn_if_insecure(settings: GatewaySettings) -> None:
    if settings.insecure_dev:
        banner = "!" * 78
        log.warning(banner)
        log.warning("JUNE_GATEWAY_INSECURE_DEV=1: requests WITHOUT a token are let in as %r,", settings.dev_principal)
        log.warning("with every agent. Local development only: never expose this gateway.")
        log.warning(banner)


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    async def broker(request: Request, exc: Exception) -> JSONResponse:
        log.warning("%s %s: broker unavailable: %s", request.method, request.url.path, exc)
        return _error(503, "the broker is unavailable; nothing was sent, retry later")

    async def timeout(request: Request, exc: Exception) -> JSONResponse:
        log.warning("%s %s: %s", request.method, request.url.path, exc)
        if isinstance(exc, ResultTimeout) and exc.withdrawn:  # a reset: it expired unanswered, no worker runs it
            return _error(504, "no june worker answered in time; the message was withdrawn and will not run")
        return _error(504, "no june worker answered in time; the message stays queued and may still run")

    async def upstream(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s: the worker's answer could not be used: %s", request.method, request.url.path, exc)
        return _error(502, f"the worker's answer could not be used ({type(exc).__name__})")

    async def database(request: Request, exc: Exception) -> JSONResponse:
        log.warning("%s %s: Postgres unavailable (%s)", request.method, request.url.path, type(exc).__name__)
        return _error(503, "the database is unavailable; retry later")

    async def event_store(request: Request, exc: Exception) -> JSONResponse:
        log.warning("%s %s: Redis unavailable (%s)", request.method, request.url.path, type(exc).__name__)
        return _error(503, "the event store is unavailable; retry later")

    app.add_exception_handler(BrokerUnavailable, broker)
    app.add_exception_handler(ResultTimeout, timeout)
    for upstream_error in (ResultUnavailable, TaskFailed, UnexpectedResult):
        app.add_exception_handler(upstream_error, upstream)
    for database_error in (StoreUnavailableError, psycopg.OperationalError, psycopg_pool.PoolTimeout):
        app.add_exception_handler(database_error, database)
    app.add_exception_handler(redis.RedisError, event_store)
    app.add_exception_handler(RedisClusterException, event_store)  # a cluster client's own: no node answered
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, body_parse_error)


def reload_tokens(app: FastAPI, load: Callable[[], TokenTable]) -> bool:
    """Take a newly read token table into use (SIGHUP); a table that does not load keeps the one in use."""
    current: GatewaySettings = app.state.settings
    try:
        settings = dataclasses.replace(current, tokens=load())  # validated as at start: no tokens is refused
    except ConfigError as exc:
        log.error("SIGHUP: token table not reloaded, the %d token(s) in use stay: %s", len(current.tokens), exc)
        return False
    app.state.settings = settings
    log.info("SIGHUP: token table reloaded: %d token(s)", len(settings.tokens))
    return True


@contextmanager
def _reload_on_sighup(app: FastAPI, load: Callable[[], TokenTable] | None) -> Iterator[None]:
    """While the app serves, SIGHUP reloads its token table (where the process can take signals on this loop)."""
    loop = asyncio.get_running_loop()
    installed = False
    if load is not None:
        try:
            loop.add_signal_handler(signal.SIGHUP, reload_tokens, app, load)
            installed = True
        except (RuntimeError, ValueError, NotImplementedError, AttributeError):
            # not the main thread (an app served in a thread), or no SIGHUP here: restart to change tokens
            log.info("SIGHUP does not reload the token table in this process: restart the gateway to change it")
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGHUP)


def create_app(settings: GatewaySettings | None = None, *, tokens: Callable[[], TokenTable] | None = None) -> FastAPI:
    """The gateway app; settings from the environment when not given (a bad one is a ConfigError, at once).

    ``tokens``: how SIGHUP reads the token table again; by default, with settings from the environment, the
    environment's (:func:`~.settings.token_loader`); none for settings given without it.
    """
    if settings is None:
        settings = GatewaySettings.from_env()
        tokens = tokens if tokens is not None else token_loader()
    backend = GatewayBackend(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # logging is configured by now, however the app was launched: scrub whatever its handlers write
        for name in ("", "uvicorn", "uvicorn.access"):
            scrub_handlers(logging.getLogger(name))
        _warn_if_insecure(settings)
        await backend.start()
        log.info("june gateway serving agents %s with %d token(s)", ", ".join(settings.agents), len(settings.tokens))
        try:
            with _reload_on_sighup(app, tokens):
                yield
        finally:
            await backend.close()
            await backend.blocking(app.state.metrics.state.close)

    app = FastAPI(
        title="june gateway",
        version=__version__,
        description="HTTP and SSE over june's Celery tasks and Redis event streams. "
        "Every /v1 route needs `Authorization: Bearer <token>`.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.backend = backend
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    install_query_redaction()
    app.include_router(turn_router)
    app.include_router(control_router)
    app.include_router(log_router)
    if settings.slack is not None:
        from .slack import router as slack_router  # needs slack_sdk (the slack extra)

        app.include_router(slack_router)
    app.include_router(console_router)
    app.state.metrics = install_metrics(app, settings, backend)

    html, page_headers = _page("page.html")
    console_html, console_headers = _page("console.html")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(html, headers=page_headers)

    @app.get("/console", response_class=HTMLResponse, include_in_schema=False)
    async def console_page() -> HTMLResponse:
        return HTMLResponse(console_html, headers=console_headers)

    @app.get("/healthz", summary="Health: Redis and Postgres answer", tags=["health"])
    async def healthz() -> JSONResponse:
        checks = await backend.health()
        ok = all(v == "ok" for v in checks.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", **checks}, status_code=200 if ok else 503)

    app.state.metrics.start_at_zero(app)

    return app
