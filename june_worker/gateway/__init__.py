"""The HTTP gateway: june's turns over HTTP and server-sent events (the ``gateway`` extra).

An ASGI app (FastAPI) over the same Celery tasks and Redis streams producers use: it sends
``june.turn`` / ``june.resume`` / ``june.cancel`` / ``june.reset`` by name, follows session
streams for SSE (the SSE id is the Redis stream id, so ``Last-Event-ID`` resumes exactly),
and reads pending input and turn status from Postgres. It never runs a turn.

Start it with ``june gateway`` or ``uvicorn june_worker.gateway.app:create_app --factory``;
see ``docs/gateway.md``. Modules: :mod:`.settings` (environment), :mod:`.auth` (bearer
tokens), :mod:`.access` (who may use a session) and :mod:`.owners` (who opened it),
:mod:`.backend` (producer, Redis, Postgres), :mod:`.sse` (the stream), :mod:`.routes` and
:mod:`.routes_control` (``/v1``), :mod:`.guards` (bounded bodies, echoes and logs), :mod:`.app`
(the factory), :mod:`.client` (reading SSE).

The rule a reader must not break: **who answers a parked turn is the token's principal**;
no route takes ``by`` from the client.
"""

from .app import create_app
from .auth import Principal, TokenTable
from .settings import GatewaySettings

__all__ = ["GatewaySettings", "Principal", "TokenTable", "create_app"]
