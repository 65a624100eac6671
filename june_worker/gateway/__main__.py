"""``june gateway`` (or ``python -m june_worker.gateway``): serve the gateway with uvicorn.

Settings come from the environment (:mod:`.settings`); ``--host`` / ``--port`` override
``JUNE_GATEWAY_HOST`` / ``JUNE_GATEWAY_PORT``. A configuration mistake exits with status 2
and one line, before anything listens.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from ..errors import ConfigError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="june gateway", description="serve june's HTTP gateway (SSE, /v1, the page)")
    parser.add_argument("--host", help="address to listen on (JUNE_GATEWAY_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (JUNE_GATEWAY_PORT, default 8080)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = parser.parse_args(argv)
    try:
        import uvicorn

        from .app import create_app
        from .settings import GatewaySettings, token_loader
    except ImportError as exc:
        print(
            f"june gateway: {exc}; install the gateway extra from a june-worker checkout or its wheel: "
            "pip install './june-worker[gateway]'",
            file=sys.stderr,
        )
        return 2
    try:
        settings = GatewaySettings.from_env()
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        settings = dataclasses.replace(settings, **overrides)
    except ConfigError as exc:
        print(f"june gateway: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(settings, tokens=token_loader()),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        access_log=settings.access_log,
        # SSE responses last until their client leaves: stop waiting for them after a few seconds.
        timeout_graceful_shutdown=5,
        proxy_headers=False,
        ws="none",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
