"""The worker's and beat's log output: every record scrubbed of secrets; with ``JUNE_LOG_FORMAT=json``, every line
one JSON object (:class:`~june_worker.observe.logs.JsonFormatter`), whoever wrote it.

Celery sets logging up itself (``celery.app.log``): a handler on the root logger, one on the task logger
``celery.task`` and one on billiard's logger ``multiprocessing``, the last two not propagating. That last one is where
the worker's main process reports a pool process that died (``Process 'ForkPoolWorker-2' pid:... exited with
'signal 9 (SIGKILL)'``). After Celery set up a logger (``after_setup_logger``, ``after_setup_task_logger``), every
handler of every logger configured so far gets the scrubbing filter and, in json mode, the JSON formatter. Pool
processes inherit those handlers when they fork.

Some lines are not log records, and json mode deals with each in the worker's main process, from
``celeryd_init`` (the worker's first signal):

- what is written before Celery's logging is set up (the ``SecurityWarning`` of a worker run as root): warnings go to
  logging (``logging.captureWarnings``), and the root logger has a JSON handler on stderr until Celery's own
  replaces it;
- the banner (printed to stdout): logged instead, as one record of ``celery.apps.worker`` holding its text without
  the ASCII art (``celery --quiet worker``: neither);
- the shutdown and restart notices Celery writes from its signal handlers (``worker: Warm shutdown (MainProcess)``,
  ``celery.apps.worker.safe_say``, straight to the file descriptor so as to take no lock): written as one JSON line
  each, the same way, still without a lock.

Beat prints its banner before any signal june could act on: ``june beat`` passes ``--quiet`` in json mode
(:mod:`june_worker.cli`); a plain ``celery beat`` needs ``-q`` for the same.

The rule a reader must not break: **in json mode nothing the worker writes to stdout or stderr is anything but one
JSON object per line**; a new way Celery writes text gets a hook here, and a line in the test that reads both.
"""

from __future__ import annotations

import logging
import os
import sys
from functools import partial
from typing import Any

import celery
from celery.signals import after_setup_logger, after_setup_task_logger, celeryd_after_setup, celeryd_init

from ..engine.secrets import ScrubFilter, scrub_handlers
from ..observe.logs import JsonFormatter, use_json_logs

__all__ = ["say"]


def _json_mode() -> bool:
    from .settings import WorkerSettings

    return WorkerSettings.from_env().log_format == "json"


def _configured_loggers(first: logging.Logger) -> list[logging.Logger]:
    """``first``, the root logger, and every other logger that has handlers of its own (``multiprocessing``...)."""
    found = [first, logging.getLogger()]
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger) and logger.handlers and logger not in found:
            found.append(logger)
    return found


@after_setup_logger.connect  # type: ignore[untyped-decorator]
@after_setup_task_logger.connect  # type: ignore[untyped-decorator]
def _log_format(logger: Any = None, **_: Any) -> None:
    """Every record the worker (or beat) writes is scrubbed of secrets, whoever logged it (Celery's own
    task-failure lines, billiard's, a library's); JUNE_LOG_FORMAT=json: each is one JSON object per line."""
    if logger is None:
        return
    _drop_early_handler()
    json_mode = _json_mode()
    for each in _configured_loggers(logger):
        scrub_handlers(each)
        if json_mode:
            use_json_logs(each)


# --- json mode: what the worker writes before or outside logging -------------------------------------------------


class _EarlyHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """JSON on stderr for what is logged before Celery sets logging up (removed once it has)."""


def _drop_early_handler() -> None:
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _EarlyHandler)]:
        root.removeHandler(handler)


@celeryd_init.connect  # type: ignore[untyped-decorator]
def _json_from_the_start(instance: Any = None, **_: Any) -> None:
    if instance is None or not _json_mode():
        return
    logging.captureWarnings(True)
    root = logging.getLogger()
    if not root.handlers:
        early = _EarlyHandler(sys.stderr)
        early.setFormatter(JsonFormatter())
        early.addFilter(ScrubFilter())
        root.addHandler(early)
    instance.emit_banner = partial(_log_banner, instance)  # Celery calls it unless --quiet
    from celery.apps import worker as program

    if hasattr(program, "safe_say"):
        program.safe_say = _say_as_json


@celeryd_after_setup.connect  # type: ignore[untyped-decorator]
def _early_handler_done(**_: Any) -> None:
    """Logging is set up by now, by Celery or by the application's own ``setup_logging`` receiver."""
    _drop_early_handler()


def _log_banner(worker: Any) -> None:
    banner = worker.startup_info(artlines=False) + (worker.extra_info() or "")
    logging.getLogger("celery.apps.worker").info("%s", banner.strip())


_FORMATTER = JsonFormatter()
_write = getattr(celery, "_original_os_write", os.write)  # os.write before an eventlet patch, as Celery keeps it


def _say_as_json(msg: str, f: Any = sys.__stderr__) -> None:
    """``celery.apps.worker.safe_say`` in json mode: the notice as one JSON record, written as Celery writes it (one
    ``os.write``, no lock: it runs in signal handlers), never raising."""
    record = logging.LogRecord("celery.apps.worker", logging.INFO, __file__, 0, "%s", (str(msg).strip(),), None)
    try:
        _write(f.fileno(), (_FORMATTER.format(record) + "\n").encode())
    except (OSError, AttributeError, ValueError):
        pass  # as Celery's: losing a notice must never abort a shutdown


def say(line: str, *, json_mode: bool, level: int = logging.WARNING) -> None:
    """One line of june's own to stderr (``june worker: ...``): as is, or in json mode as one JSON record. One
    ``os.write``, no lock, never raising: it also runs in signal handlers."""
    if json_mode:
        record = logging.LogRecord("june_worker.worker", level, __file__, 0, "%s", (line,), None)
        text = _FORMATTER.format(record)
    else:
        text = line
    try:
        _write(2, (text + "\n").encode())
    except OSError:
        pass
