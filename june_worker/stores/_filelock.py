"""One open store per SQLite file: an exclusive ``flock`` on a sidecar file, ``<db>.lock``.

The in-process runtime takes no lease: two runtimes on one file would both run the same queued
turn (an async tool twice, and a ``StoreError`` for the one whose commit lost). So a
:class:`~june_worker.stores.SQLiteStore` on a file holds this lock from its constructor until
``close()`` (or until the store is garbage-collected, or its process ends: the kernel drops a
dead process's ``flock``, so a crash never leaves a stale lock behind). A second store on the same
file waits up to its ``lock_timeout_s`` for the first to close, then raises
:class:`~june_worker.errors.StoreLockedError`; inside one process it raises at once, since the
holder is an object of this very process that nobody will close while we wait.

The rule a reader must not break: **never delete the lock file**; a waiter may hold an open
descriptor of it, and a new file would be a second, independent lock. It is a few bytes holding
the pid of the last holder (for error messages only).

``flock`` is POSIX; on Windows no lock is taken (run one process per file there).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from ..engine.secrets import scrubbed_logger
from ..errors import StoreLockedError

__all__ = ["FileLock"]

log = scrubbed_logger("june_worker.stores.sqlite")

if sys.platform != "win32":
    import fcntl

_HELD: set[str] = set()
"""Lock files a store of this process holds (``flock`` would conflict with ourselves: fail at once)."""
_HELD_GUARD = threading.Lock()
_POLL_S = 0.05


class FileLock:
    """The exclusive lock of one SQLite file, taken by :meth:`acquire` and let go by :meth:`release`."""

    def __init__(self, path: str, fd: int | None) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, db_path: str, *, timeout_s: float) -> FileLock:
        """Take the lock of ``db_path`` (waiting up to ``timeout_s`` for another process to let it go)."""
        path = os.path.realpath(db_path) + ".lock"
        if sys.platform == "win32":
            return cls(path, None)
        with _HELD_GUARD:
            if path in _HELD:
                raise StoreLockedError(
                    f"SQLite file {db_path} is already open in this process (another SQLiteStore on it is not "
                    "closed); one store serves a file at a time: close() the other first"
                )
            _HELD.add(path)
        try:
            return cls(path, _take(path, db_path, timeout_s))
        except BaseException:
            with _HELD_GUARD:
                _HELD.discard(path)
            raise

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Let the lock go (idempotent). The kernel does the same when the process ends."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if sys.platform != "win32":
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        with _HELD_GUARD:
            _HELD.discard(self.path)


def _take(path: str, db_path: str, timeout_s: float) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + max(0.0, timeout_s)
    waited = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(fd)
                if time.monotonic() >= deadline:
                    raise StoreLockedError(
                        f"SQLite file {db_path} is in use by process {holder} (lock {path}); one process at a time "
                        f"serves a SQLite file, and it was not closed within {timeout_s:g}s. Stop that process, or "
                        "use PostgresStore with workers to run turns from many processes"
                    ) from None
                if not waited:
                    log.warning(
                        "SQLite file %s is in use by process %s; waiting up to %gs for it to be closed",
                        db_path,
                        holder,
                        timeout_s,
                    )
                    waited = True
                time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    if waited:
        log.info("SQLite file %s: the other process closed it; this one serves it now", db_path)
    return fd


def _holder(fd: int) -> str:
    """The pid the holder wrote into the lock file, or ``unknown`` (it is only for messages)."""
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"
