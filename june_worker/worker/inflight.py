"""Many turns in flight in one worker process: one event loop runs them all, each turn's blocking calls run on its own thread.

``june worker --turns-per-process N`` runs Celery's threads pool (``-P threads -c N``): each message
in flight has a pool thread, which holds the message (``acks_late``) and does the turn's intake and
lease statements, as a prefork process does. The turn itself runs as a task on the process's one
event loop (:class:`EventLoopThread`), where a turn that waits on its model or an async tool costs a
coroutine, not a process. What would hold that loop up goes to a thread (:class:`TurnThread`): a
sync tool inside its step's transaction, the turn's reads, a child's launch go back to the turn's
pool thread; its ready commits (one statement and its publish, no tool code in them) and its other
event publishes go to its *lane*, one of a few threads shared by every turn of the process, one per
connection of the store's pool (:class:`StoreLanes`). Either way a turn's calls run one at a time,
first asked, first run. Neither Postgres nor Redis is ever waited on by the loop.

Why lanes: a pool thread woken for each statement of its turn made the process switch threads about
120 times per turn (a prefork pool process: 7), which cost it a fifth of its CPU
(docs/benchmarks.md); a lane that is busy takes its next statement without sleeping in between.

:class:`LoopWatch` reports whatever holds the loop anyway (a blocking call inside an async tool):
the tool, its turn and for how long. Nothing of a turn's safety needs the loop: leases, liveness
and cancel marks are kept by the host's heartbeat thread, cancel signals land on the control
listener's thread.

The rule a reader must not break: **nothing blocking runs on the loop**. Give it to the turn's
thread (:meth:`TurnThread.blocking`, :meth:`TurnThread.submit`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import itertools
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from ..engine.events import TurnEvent
from ..engine.hooks import StepKind, TurnHooks
from ..engine.secrets import scrubbed_logger
from ..engine.sink import EventSink
from ..engine.store import Commit, SessionRef

__all__ = ["EventLoopThread", "LoopWatch", "QueuedSink", "StoreLanes", "TurnThread", "WatchedHooks"]

log = scrubbed_logger("june_worker.worker")

T = TypeVar("T")

_DONE = object()


class EventLoopThread:
    """The process's event loop, run by a thread of its own from the first turn until :meth:`close`."""

    def __init__(self, name: str = "june-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it here (a control task's short coroutine: an authorize hook)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self, timeout_s: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


class StoreLanes:
    """A few threads that run the ready commits and the publishes of every turn in flight; each turn is given one
    lane for its run (:class:`TurnThread`), whose calls then run in the order they were handed over."""

    def __init__(self, lanes: int) -> None:
        self._queues: list[queue.SimpleQueue[Callable[[], None] | object]] = [
            queue.SimpleQueue() for _ in range(max(lanes, 1))
        ]
        self._threads = [
            threading.Thread(target=self._serve, args=(q,), name=f"june-lane-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        self._idents: set[int] = set()
        self._started = threading.Barrier(len(self._threads) + 1)
        self._next = itertools.count()
        for thread in self._threads:
            thread.start()
        self._started.wait()

    def _serve(self, jobs: queue.SimpleQueue[Callable[[], None] | object]) -> None:
        self._idents.add(threading.get_ident())
        self._started.wait()
        while (job := jobs.get()) is not _DONE:
            try:
                job()  # type: ignore[operator]
            except BaseException:  # (TurnThread's jobs hand their call's error to the turn): a lane outlives anything
                log.exception("a call on a store lane raised past its turn; the lane serves on")

    def pick(self) -> int:
        """A lane for a new run, in turn."""
        return next(self._next) % len(self._queues)

    def put(self, lane: int, job: Callable[[], None]) -> None:
        self._queues[lane].put(job)

    def on_a_lane(self) -> bool:
        """True on a lane's own thread."""
        return threading.get_ident() in self._idents

    def close(self, timeout_s: float = 5.0) -> None:
        for jobs in self._queues:
            jobs.put(_DONE)
        for thread in self._threads:
            thread.join(timeout_s)


class TurnThread:
    """The pool thread a turn's message came on: it waits for the turn and, meanwhile, runs its blocking calls;
    with ``lanes``, the turn's ready commits and publishes run on one lane of them instead (see the module).

    One per run of a turn (:meth:`run` once). Calls run one at a time in the order they were handed over,
    so a publish handed over after a commit goes out after it: a call on the turn's own thread first waits for
    what the turn handed to its lane before, and the run ends only once the lane has done the turn's calls.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, lanes: StoreLanes | None = None) -> None:
        self._loop = loop
        self._lanes = lanes
        self._lane = lanes.pick() if lanes is not None else 0
        self._on_lane: threading.Event | None = None
        """Set once the lane has run the last call this turn handed it (None: none handed)."""
        self._jobs: queue.SimpleQueue[Callable[[], None] | object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._ident: int | None = None

    @property
    def lane(self) -> int:
        """Which of the lanes this run's calls go to (0 without lanes)."""
        return self._lane

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` as a task on the loop (in this thread's context: its trace span is the turn's parent) and
        serve its blocking calls here until it ends; return its result or raise its exception."""
        self._ident = threading.get_ident()
        context = contextvars.copy_context()
        outcome: concurrent.futures.Future[T] = concurrent.futures.Future()

        def start() -> None:
            task = self._loop.create_task(coro, context=context)
            task.add_done_callback(lambda t: self._ended(t, outcome))

        self._loop.call_soon_threadsafe(start)
        try:
            while (job := self._jobs.get()) is not _DONE:
                job()  # type: ignore[operator]
            self._lane_done()  # (the turn's last publishes): the session's next run publishes after them
            return outcome.result()
        finally:
            with self._lock:
                self._closed = True
            while not self._jobs.empty():  # (none in practice: the turn's task ended before _DONE was queued)
                late = self._jobs.get_nowait()
                if late is not _DONE:
                    late()  # type: ignore[operator]

    def _ended(self, task: asyncio.Task[T], outcome: concurrent.futures.Future[T]) -> None:
        if task.cancelled():
            outcome.cancel()
        elif (exc := task.exception()) is not None:
            outcome.set_exception(exc)
        else:
            outcome.set_result(task.result())
        self._put(_DONE)

    def _put(self, job: Callable[[], None] | object) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._jobs.put(job)
            return True

    async def blocking(self, fn: Callable[[], T], /) -> T:
        """:class:`~june_worker.engine.blocking.Blocking`: ``fn`` on this thread; the loop goes on meanwhile."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def job() -> None:
            self._lane_done()
            _run_into(fn, loop, future)

        if not self._put(job):
            return fn()  # the run is over (a task of the turn outlived it): nothing else waits for this thread
        return await future

    async def statement(self, fn: Callable[[], T], /) -> T:
        """:class:`~june_worker.engine.blocking.Blocking` for a ready commit: ``fn`` on the turn's lane (on this
        thread without lanes)."""
        if self._lanes is None:
            return await self.blocking(fn)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._to_lane(lambda: _run_into(fn, loop, future))
        return await future

    def _to_lane(self, job: Callable[[], None]) -> None:
        assert self._lanes is not None
        done = self._on_lane = threading.Event()

        def laned() -> None:
            try:
                job()
            finally:
                done.set()

        self._lanes.put(self._lane, laned)

    def _lane_done(self) -> None:
        """Wait until the lane has run what this turn handed it (the turn's calls run in the order asked)."""
        if self._on_lane is not None:
            self._on_lane.wait()

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on this thread after what was handed over before it, without waiting for it; it never raises.
        Asked from this thread itself (a commit's publish, inside the commit's call), it runs at once."""

        def job() -> None:
            try:
                fn()
            except Exception:
                log.exception("a turn's background call failed")

        if threading.get_ident() == self._ident or (self._lanes is not None and self._lanes.on_a_lane()):
            job()  # inside one of the turn's calls (a lane runs one call at a time: this turn's, now)
        elif self._lanes is not None:
            self._to_lane(job)
        elif not self._put(job):
            job()


def _run_into(fn: Callable[[], T], loop: asyncio.AbstractEventLoop, future: asyncio.Future[T]) -> None:
    """Call ``fn`` here and settle the loop's ``future`` with what it returned or raised."""
    try:
        value = fn()
    except BaseException as exc:  # (a sync tool's rollback marker is one): the awaiting step decides
        loop.call_soon_threadsafe(_settle, future, None, exc)
    else:
        loop.call_soon_threadsafe(_settle, future, value, None)


def _settle(future: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


class QueuedSink:
    """The turn's sink as its coroutine sees it: each publish is handed to the turn's lane (or its thread), in order,
    and returns at once. The engine publishes only after a commit returned, so an event still never goes out before
    its commit."""

    def __init__(self, inner: EventSink, thread: TurnThread) -> None:
        self.inner = inner
        self.thread = thread

    def publish(self, ref: SessionRef, events: Sequence[TurnEvent]) -> None:
        batch = list(events)
        self.thread.submit(lambda: self.inner.publish(ref, batch))

    def publish_delta(self, ref: SessionRef, event: TurnEvent) -> None:
        self.thread.submit(lambda: self.inner.publish_delta(ref, event))


class LoopWatch:
    """Says when something holds the event loop longer than ``threshold_s``, and what: the tool, its turn, how long.

    The loop stamps the time every ``tick_s``; a thread of the watch's own reads the stamp. A stamp older than
    the threshold means the loop is held: the watch names the step running then (registered by
    :class:`WatchedHooks`, else the task's coroutine) and, once the loop is free again, logs how long it was held
    (and calls ``on_blocked(seconds, culprit)``, for metrics). Something still holding it is logged every
    ``repeat_s`` meanwhile.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        threshold_s: float = 0.5,
        tick_s: float = 0.05,
        repeat_s: float = 10.0,
        on_blocked: Callable[[float, str], None] | None = None,
    ) -> None:
        self.loop = loop
        self.threshold_s = threshold_s
        self.tick_s = min(tick_s, threshold_s / 4)
        self.repeat_s = repeat_s
        self.on_blocked = on_blocked
        self._stamp = time.monotonic()
        self._steps: dict[asyncio.Task[Any], str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        loop.call_soon_threadsafe(self._tick)
        self._thread = threading.Thread(target=self._watch, name="june-loop-watch", daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        self._stamp = time.monotonic()
        if not self._stop.is_set():
            self.loop.call_later(self.tick_s, self._tick)

    @contextmanager
    def running(self, what: str) -> Iterator[None]:
        """Register the current task as running ``what`` (on the loop, around a step)."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        with self._lock:
            outer = self._steps.get(task)
            self._steps[task] = what
        try:
            yield
        finally:
            with self._lock:
                if outer is None:
                    self._steps.pop(task, None)
                else:
                    self._steps[task] = outer

    def culprit(self) -> str:
        """What the loop runs now, read from another thread."""
        task = asyncio.current_task(self.loop)
        if task is None:
            return "a callback of the event loop (no task)"
        with self._lock:
            what = self._steps.get(task)
        if what is not None:
            return what
        coro = task.get_coro()
        name = getattr(coro, "__qualname__", None) or repr(coro)
        return f"task {task.get_name()} ({name})"

    def _watch(self) -> None:
        held_since: float | None = None
        culprit = ""
        told = 0.0
        while not self._stop.wait(self.tick_s):
            stamp, now = self._stamp, time.monotonic()
            if held_since is not None and stamp > held_since:  # free again
                held = stamp - held_since
                log.warning("the event loop was held for %.2fs by %s: run blocking calls in a thread "
                            "(asyncio.to_thread), or declare the tool with def", held, culprit)  # fmt: skip
                if self.on_blocked is not None:
                    try:
                        self.on_blocked(held, culprit)
                    except Exception:
                        log.debug("on_blocked failed", exc_info=True)
                held_since = None
                continue
            if held_since is None and now - stamp > self.threshold_s:
                held_since, culprit, told = stamp, self.culprit(), now
                log.warning("the event loop has been held for %.2fs by %s; other turns wait", now - stamp, culprit)
            elif held_since is not None and now - told >= self.repeat_s:
                told = now
                log.warning("the event loop is still held, for %.0fs now, by %s", now - held_since, culprit)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


class WatchedHooks:
    """A turn's hooks, with each step registered with the :class:`LoopWatch` while it runs (so a step that holds
    the loop is named)."""

    def __init__(self, inner: TurnHooks, watch: LoopWatch, turn_id: str, ref: SessionRef) -> None:
        self.inner = inner
        self.watch = watch
        self.turn_id = turn_id
        self.ref = ref

    @contextmanager
    def step(self, kind: StepKind, step: str, tool: str | None = None) -> Iterator[None]:
        what = f'tool "{tool}"' if tool else f"the {kind} step"
        with (
            self.watch.running(f"{what} of turn {self.turn_id} ({self.ref}), step {step}"),
            self.inner.step(kind, step, tool),
        ):
            yield

    def committed(self, commit: Commit) -> None:
        self.inner.committed(commit)
