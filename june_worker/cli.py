"""The ``june`` command: the demo, the worker stack, and schema migration.

``june worker`` / ``june beat`` / ``june flower`` are the plain Celery commands with the
app filled in; any further arguments go to Celery unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]

CELERY_APP = "june_worker.worker"


def _celery(*args: str) -> int:
    os.execvp(sys.executable, [sys.executable, "-m", "celery", "-A", CELERY_APP, *args])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="june", description="june-worker: durable AI-agent turns")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo agent in process on SQLite (no server, no API key)")
    demo.add_argument("--db", default=os.path.join(".june", "demo.db"), help="SQLite file (default .june/demo.db)")
    for name, text in (
        ("worker", "start a Celery worker (celery -A june_worker.worker worker ...)"),
        ("beat", "start Celery beat: the sweeper and proactive schedules"),
        ("flower", "start Flower, the Celery monitor (the 'flower' extra)"),
    ):
        sub.add_parser(name, help=text, add_help=False)
    sub.add_parser("migrate", help="create or upgrade the Postgres schema at JUNE_DATABASE_URL")
    sub.add_parser("gateway", help="serve the HTTP gateway (the 'gateway' extra)", add_help=False)

    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main([args.db])
    if args.command in ("worker", "beat", "flower"):
        return _celery(args.command, *rest)
    if args.command == "migrate":
        from .stores.postgres import PostgresStore

        url = os.environ.get("JUNE_DATABASE_URL")
        if not url:
            parser.error("set JUNE_DATABASE_URL to the Postgres database to migrate")
        PostgresStore(url).close()
        print("schema is up to date")
        return 0
    if args.command == "gateway":
        from .gateway.__main__ import main as gateway_main

        return gateway_main(rest)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
