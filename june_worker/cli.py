"""The ``june`` command: the demo, the worker stack, and schema migration.

``june worker`` / ``june beat`` / ``june flower`` are the plain Celery commands with the
app filled in; any further arguments go to Celery unchanged (``june worker`` and ``june beat`` log at INFO unless
given ``-l``: Celery's WARNING says nothing once a worker is ready). ``june worker`` without ``-c``
runs one pool process per CPU, at most :data:`MAX_DEFAULT_CONCURRENCY` (Celery's own default
has no cap). ``june worker --turns-per-process N [-c P]`` runs P processes (default 1) of N turns
each, on Celery's threads pool, under a supervisor that starts a process again if it dies
(:mod:`june_worker.worker.supervisor`). ``june beat`` with ``JUNE_LOG_FORMAT=json`` runs
``celery --quiet beat`` (no banner: see :func:`beat_args`).
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["MAX_DEFAULT_CONCURRENCY", "beat_args", "main", "with_loglevel", "worker_args"]

CELERY_APP = "june_worker"


MAX_DEFAULT_CONCURRENCY = 8
"""``june worker`` without ``-c``: one pool process per CPU, at most this many. One worker's main process takes
every message from the broker and hands it to its pool (about 1.1-1.5 ms of CPU per turn on the benchmark
machine, docs/benchmarks.md): past about eight pool processes of turns that do not wait, it is the limit, and
more CPUs are used by more workers, not a bigger pool."""

_POOL_SIZE = ("-c", "--concurrency", "--autoscale")


def _celery(*args: str) -> int:
    os.execvp(sys.executable, [sys.executable, "-m", "celery", "-A", CELERY_APP, *args])


def worker_args(rest: list[str], cpus: int | None = None) -> list[str]:
    """``celery worker``'s arguments for ``june worker <rest>``: the pool size capped by default (see
    :data:`MAX_DEFAULT_CONCURRENCY`) unless ``rest`` sets it."""
    if any(a in _POOL_SIZE or a.startswith(("-c", "--concurrency=", "--autoscale=")) for a in rest):
        return ["worker", *rest]
    default = max(1, min(cpus if cpus is not None else (os.cpu_count() or 1), MAX_DEFAULT_CONCURRENCY))
    return ["worker", "-c", str(default), *rest]


def _turns_per_process(rest: list[str]) -> tuple[int, int, list[str]] | None:
    """``--turns-per-process N`` and ``-c P`` taken out of ``rest``: (N, P, what is left); None without the former.
    Raises ValueError naming what is wrong."""
    args = list(rest)
    turns = processes = None
    for flag in ("--turns-per-process", "-c", "--concurrency"):
        for i, arg in enumerate(args):
            value: str | None = None
            if arg == flag and i + 1 < len(args):
                value = args.pop(i + 1)
                args.pop(i)
            elif arg.startswith(flag + "=") or (flag == "-c" and arg.startswith("-c") and arg[2:].isdigit()):
                value = args.pop(i)[len(flag) + (1 if arg.startswith(flag + "=") else 0) :]
            if value is None:
                continue
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{flag} {value!r}: expected a whole number, at least 1")
            if flag == "--turns-per-process":
                turns = int(value)
            else:
                processes = int(value)
            break
    if turns is None:
        return None
    if any(a in ("-P", "--pool") or a.startswith("--pool=") for a in args):
        raise ValueError("--turns-per-process runs Celery's threads pool: leave -P/--pool out")
    if any(a == "--autoscale" or a.startswith("--autoscale=") for a in args):
        raise ValueError("--turns-per-process takes no --autoscale: give the processes with -c")
    return turns, processes or 1, args


POOLS_SUPPORTED = (
    "use prefork (one turn per process), solo, or threads (--turns-per-process N: many turns in one process)"
)
"""What ``june worker`` says of a pool it refuses (also :func:`june_worker.worker.app._check_before_start`)."""


def _greenlet_pool(rest: list[str]) -> str | None:
    """``gevent`` / ``eventlet`` when ``rest`` asks for that pool: its turns' blocking calls would share one thread."""
    for i, arg in enumerate(rest):
        value = None
        if arg in ("-P", "--pool") and i + 1 < len(rest):
            value = rest[i + 1]
        elif arg.startswith("--pool="):
            value = arg.split("=", 1)[1]
        elif arg.startswith("-P") and len(arg) > 2:
            value = arg[2:]
        if value in ("gevent", "eventlet"):
            return value
    return None


def with_loglevel(rest: list[str]) -> list[str]:
    """``rest`` with ``-l INFO`` added unless it gives a level: Celery's default (WARNING) leaves a worker that is
    ready silent after its banner, and beat silent about what it sends."""
    given = any(a in ("-l", "--loglevel") or a.startswith("--loglevel=") or (a.startswith("-l") and a[2:].isalpha())
                for a in rest)  # fmt: skip
    return rest if given else [*rest, "-l", "INFO"]


def beat_args(rest: list[str], log_format: str | None = None) -> list[str]:
    """``celery beat``'s arguments for ``june beat <rest>``: with ``JUNE_LOG_FORMAT=json``, Celery's ``--quiet`` first,
    since beat prints its banner before june could turn it into JSON (june_worker/worker/logformat.py)."""
    fmt = os.environ.get("JUNE_LOG_FORMAT", "") if log_format is None else log_format
    return ["--quiet", "beat", *rest] if fmt.strip().lower() == "json" else ["beat", *rest]


def _migrate(parser: argparse.ArgumentParser, partitions: int | None) -> int:
    """``june migrate``: one line naming the cause when Postgres cannot be used (within seconds), else what it did."""
    from .worker.startcheck import check_postgres, migrate, postgres_problem, say_applied

    url = os.environ.get("JUNE_DATABASE_URL")
    if not url:
        parser.error("set JUNE_DATABASE_URL to the Postgres database to migrate")
    problem = check_postgres(url)
    if problem is not None:
        print(f"june migrate: {problem.text}", file=sys.stderr)
        return 1
    import psycopg

    try:
        applied = migrate(url)
        print(say_applied(applied))
        if partitions is not None:
            from .stores.postgres import PostgresStore

            store = PostgresStore(url, min_size=1, max_size=1)
            try:
                changed = store.partition(partitions)
            except ValueError as exc:
                parser.error(str(exc))
            finally:
                store.close()
            print(f"per-session tables {'now' if changed else 'already'} in {partitions} hash partitions")
    except psycopg.Error as exc:
        print(f"june migrate: {postgres_problem(url, exc).text}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="june", description="june-worker: durable AI-agent turns")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo agent in process on SQLite (no server, no API key)")
    demo.add_argument("--db", default=os.path.join(".june", "demo.db"), help="SQLite file (default .june/demo.db)")
    for name, text in (
        ("worker", "start a Celery worker (celery -A june_worker worker ...)"),
        ("beat", "start Celery beat: the sweeper and proactive schedules"),
        ("flower", "start Flower, the Celery monitor (the 'flower' extra)"),
    ):
        sub.add_parser(name, help=text, add_help=False)
    migrate = sub.add_parser("migrate", help="create or upgrade the Postgres schema at JUNE_DATABASE_URL")
    migrate.add_argument(
        "--partitions",
        type=int,
        metavar="N",
        help="also hash-partition the per-session tables by (agent, session) into N partitions (2-1024), once; "
        "see docs/scaling.md",
    )
    sub.add_parser("gateway", help="serve the HTTP gateway (the 'gateway' extra)", add_help=False)

    args, rest = parser.parse_known_args(argv)
    if args.command in ("worker", "beat", "migrate"):
        # a bad setting is one line and exit 2 here, not Celery's "Unable to load celery application" and a traceback
        from .errors import ConfigError
        from .worker.settings import WorkerSettings

        try:
            WorkerSettings.from_env()
        except ConfigError as exc:
            print(f"june {args.command}: {exc}", file=sys.stderr)
            return 2
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main([args.db])
    if args.command == "worker":
        greenlets = _greenlet_pool(rest)
        if greenlets is not None:
            # said here, once, before Celery imports (and monkey-patches with) it: one line instead of a traceback
            print(f"june worker: --pool {greenlets} is not supported: {POOLS_SUPPORTED}", file=sys.stderr)
            return 2
        rest = with_loglevel(rest)
        try:
            many = _turns_per_process(rest)
        except ValueError as exc:
            print(f"june worker: {exc}", file=sys.stderr)
            return 2
        if many is not None:
            from .worker.supervisor import supervise

            turns, processes, celery_args = many
            return supervise(CELERY_APP, turns=turns, processes=processes, rest=celery_args)
        return _celery(*worker_args(rest))
    if args.command == "beat":
        return _celery(*beat_args(with_loglevel(rest)))
    if args.command == "flower":
        return _celery(args.command, *rest)
    if args.command == "migrate":
        return _migrate(parser, args.partitions)
    if args.command == "gateway":
        from .gateway.__main__ import main as gateway_main

        return gateway_main(rest)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
