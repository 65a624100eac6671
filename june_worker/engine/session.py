"""The in-process host: a :class:`Runtime` of agents over one store, and one :class:`AgentSession` per session.

Turns of a session run one at a time, in arrival order: ``start`` records the turn in the
store and a per-session drainer runs whatever is unfinished, oldest first, so a turn left
running by a crashed process is finished before the next one starts. Everything a caller
can ask (``result``, ``pending``, ``observe(replay=True)``) is answered from the store, so
it survives a restart.

Call it from asyncio::

    runtime = Runtime(agents=[agent], store=SQLiteStore("june.db"))
    session = runtime.session("ops", "s1")
    text = await session.turn("Order 3 widgets")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from june_wire.ids import new_turn_id
from june_wire.storable import unstorable_reason

from ..errors import (
    AgentDefinitionError,
    ConfigError,
    JuneError,
    PayloadError,
    ResetNotSupportedError,
    ResumeConflictError,
    TurnCancelledError,
    TurnError,
    TurnFailedError,
    TurnRejectedError,
    TurnSuspendedError,
)
from .agent import Agent, deliver_result
from .children import (
    ENDS_CHILDREN,
    announce_child_park,
    cancel_children,
    cancel_parked,
    child_answer,
    child_grant,
    child_input_id,
    children_of_park,
    parent_cancel,
    park_chain,
    refuse_reserved,
)
from .events import Cancelled, Completed, Failed, Rejected, Suspended, TurnResult
from .failures import DEFAULT_MAX_ATTEMPTS, RACE_STALL_S, Failure, backoff_s, classify
from .fanout import FanoutSink, Observer
from .ids import validate_session_id
from .loop import CrashHook, TurnRunner, reject_turn
from .resume import (
    RESUME_RACES,
    Grant,
    check_parked,
    grant_answer,
    race_tries,
    race_wait_s,
    reset_park_commit,
    resume_commit,
    still_open,
    timeout_commit,
)
from .secrets import scrubbed_logger
from .sink import EventSink
from .store import (
    ENDED_TURN_STATUSES,
    UNFINISHED_TURN_STATUSES,
    Commit,
    ResetResult,
    SessionRef,
    SessionStore,
    SuspendedCheckpoint,
    TurnPayload,
    TurnRecord,
)
from .types import InboundEvent, JsonValue, Principal, ProactiveTrigger

__all__ = ["PARK_REARM_FLOOR_S", "AgentSession", "Runtime", "parked_reason"]

PARK_REARM_FLOOR_S = 1.0
"""How soon a park's timeout is tried again after the store refused it as not due yet (the clocks differ)."""

log = scrubbed_logger("june_worker.session")


def parked_reason(ref: SessionRef, parked: SuspendedCheckpoint) -> str:
    return (
        f'session {ref.session} is suspended awaiting input "{parked.request.id}" '
        f"(turn {parked.turn_id}); resume or reset it first"
    )


class _TurnCancel:
    """The cancel probe of one in-process turn: a reason, and who to tell when it arrives."""

    def __init__(self, reason: str | None) -> None:
        self._reason = reason
        self._callback: Callable[[], None] | None = None

    def reason(self) -> str | None:
        return self._reason

    def on_cancel(self, callback: Callable[[], None] | None) -> None:
        self._callback = callback

    def set(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
            callback, self._callback = self._callback, None
            if callback is not None:
                callback()


class Runtime:
    """Agents, one store and one event fan-out, shared by every session of this process."""

    def __init__(
        self,
        agents: Iterable[Agent],
        store: SessionStore,
        *,
        sink: EventSink | None = None,
        crash: CrashHook | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        race_stall_s: float = RACE_STALL_S,
    ) -> None:
        """``max_attempts``: starts of one turn (each after a crash or a transient fault it could not outlast)
        before it is given up and ends ``failed`` (the failure policy, :mod:`~june_worker.engine.failures`).

        ``race_stall_s``: this runtime takes no lease, so another one on the same database may run a turn at the
        same time; the one whose commit is refused reports the other's outcome, and runs the turn on itself when
        the turn shows no progress for this long (the other died)."""
        self.agents = {a.name: a for a in agents}
        self.store = store
        self.fanout = FanoutSink(sink)
        self.crash = crash
        self.max_attempts = max_attempts
        self.race_stall_s = race_stall_s
        self._sessions: dict[SessionRef, AgentSession] = {}

    def agent(self, name: str) -> Agent:
        try:
            return self.agents[name]
        except KeyError:
            raise ConfigError(f"unknown agent {name!r}; this runtime serves {sorted(self.agents)}") from None

    def session(self, agent: str, session_id: str) -> AgentSession:
        """The session object for (agent, session id); the same object every time."""
        validate_session_id(session_id)
        ref = SessionRef(agent, session_id)
        found = self._sessions.get(ref)
        if found is None:
            found = self._sessions[ref] = AgentSession(self, self.agent(agent), ref)
        return found

    def launch(self, rec: TurnRecord) -> None:
        """Run a child turn a tool recorded (``ctx.delegate``): it is another session of this runtime."""
        self.session(rec.agent, rec.session)._kick()

    def cancel_children(self, ref: SessionRef, turn_ids: list[str]) -> list[str]:
        """Cancel the unfinished child turns of these turns (durably, all the way down) and signal them; the
        child turn ids marked (a child parked on a person is not: no parked turn is cancelled)."""
        return self._signal_children(cancel_children(self.store, ref, turn_ids, self.agents))

    def cancel_parked(self, ref: SessionRef, turn_id: str, reason: str) -> list[str]:
        """Cancel a parked turn through its running child turns (its own cancel stored first); the child turn ids
        marked, none when it waits on people only."""
        return self._signal_children(cancel_parked(self.store, ref, turn_id, reason, self.agents))

    def _signal_children(self, marked: list[tuple[SessionRef, list[str]]]) -> list[str]:
        out: list[str] = []
        for child_ref, ids in marked:
            out.extend(ids)
            child = self._sessions.get(child_ref)
            if child is not None:
                for t in ids:
                    child._signal_cancel(t, "parent")
        return out

    async def child_ended(self, rec: TurnRecord, result: TurnResult) -> None:
        """Answer the parent of a child turn that ended, through the parent session's resume.

        Refused quietly when the parent is not parked on it: not yet (the parent finds the child ended when it
        parks) or no longer (answered before, reset, expired). A child cancelled with its parent wakes the parent
        with its cancel, in the same commit (:func:`~.children.parent_cancel`).
        """
        link = rec.payload.parent
        if link is None:
            return
        if self.crash is not None:
            self.crash("before-parent-answer", rec.turn_id)
        try:
            parent = self.session(link.agent, link.session)
            await parent.resume(
                link.turn_id,
                child_input_id(SessionRef(rec.agent, rec.session), rec.turn_id),
                child_answer(rec, result),
                child_turn=rec.turn_id,
                cancel=parent_cancel(result),
            )
        except JuneError as exc:
            log.debug("child turn %s did not answer its parent %s: %s", rec.turn_id, link.turn_id, exc)
            return
        if self.crash is not None:
            self.crash("after-parent-answer", rec.turn_id)

    async def aclose(self) -> None:
        """Wait for every running turn of this runtime to reach a checkpoint-free state."""
        for s in list(self._sessions.values()):
            await s.idle()


class AgentSession:
    """One session's turns, in process. Create it with :meth:`Runtime.session`."""

    def __init__(self, runtime: Runtime, agent: Agent, ref: SessionRef) -> None:
        self.runtime = runtime
        self.agent = agent
        self.ref = ref
        self._cancels: dict[str, _TurnCancel] = {}
        self._waiters: dict[str, list[asyncio.Future[TurnResult]]] = {}
        self._drainer: asyncio.Task[None] | None = None
        self._reset_pending = False
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._looked = False
        self._wakers: set[asyncio.Task[None]] = set()

    @property
    def store(self) -> SessionStore:
        return self.runtime.store

    @property
    def session_id(self) -> str:
        return self.ref.session

    # --- starting and waiting -----------------------------------------------------------------

    async def start(
        self,
        text: str,
        *,
        turn_id: str | None = None,
        event: InboundEvent | dict[str, Any] | None = None,
        trigger: ProactiveTrigger | dict[str, Any] | None = None,
        replace: bool = False,
        target: dict[str, Any] | None = None,
    ) -> str:
        """Record a turn and return its id without waiting for it to run.

        Without ``event`` or ``trigger`` the turn is a person's message given to the API: its inbound
        event is ``{"source": "api", "kind": "message", "text": text}`` (no speaker, so its requests for
        input have no default answerer: anyone the app lets resume may answer).
        ``trigger={"kind": "proactive", "by": "cron:daily"}`` opens the turn with a
        ``trigger`` message instead of a user message. ``replace=True`` cancels every
        unfinished turn of the session first (never a parked one). ``target`` renders the
        finished turn there with the agent's ``deliver`` hook (an error if it has none). Raises
        :class:`TurnRejectedError` while the session is parked on another turn.
        """
        turn_id = turn_id or new_turn_id()
        if event is None and trigger is None:
            event = InboundEvent(source="api", kind="message", text=text)
        if target is not None and self.agent.deliver is None:
            raise AgentDefinitionError(f"agent {self.agent.name} has no deliver hook, so a target cannot be rendered")
        unstorable = unstorable_reason(
            {
                "turn_id": turn_id,
                "text": text,
                "event": event.model_dump(mode="python") if isinstance(event, InboundEvent) else event,
                "trigger": trigger.model_dump(mode="python") if isinstance(trigger, ProactiveTrigger) else trigger,
                "target": target,
            }
        )
        if unstorable is not None:
            raise PayloadError(f"turn {turn_id} cannot be stored: {unstorable}")
        parsed_event = InboundEvent.model_validate(event) if isinstance(event, dict) else event
        parsed_trigger = ProactiveTrigger.model_validate(trigger) if isinstance(trigger, dict) else trigger
        payload = TurnPayload(
            text=text,
            event=parsed_event,
            trigger_by=parsed_trigger.by if parsed_trigger is not None else None,
            replace=replace,
            target=target,
        )
        self._look()
        if self.store.get_turn(self.ref, turn_id) is None:
            parked = self.store.pending(self.ref)
            if parked is not None and self._expire_due(parked):
                # it expired unanswered: it goes on without an answer and this turn queues behind it, unless the
                # park has requests that expire later (then it is still parked on those)
                parked = self.store.pending(self.ref)
            if parked is not None and not self._reset_pending:  # a pending reset ends the park: S90, queue behind it
                reason = parked_reason(self.ref, parked)
                reject_turn(self.store, self.runtime.fanout, self.ref, turn_id, reason, payload=payload, new_only=True)
                raise TurnRejectedError(reason)
            if replace:
                self.cancel_all("replaced")
            self.store.enqueue_turn(self.ref, turn_id, payload)
        self._kick()
        return turn_id

    async def result(self, turn_id: str) -> TurnResult:
        """The turn's result, waiting while it is queued or running. ``suspended`` counts as a result."""
        self._look()
        rec = self.store.get_turn(self.ref, turn_id)
        if rec is None:
            raise TurnError(f"no turn {turn_id} in session {self.ref}")
        if rec.status not in UNFINISHED_TURN_STATUSES and rec.result is not None:
            return rec.result
        fut: asyncio.Future[TurnResult] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(turn_id, []).append(fut)
        self._kick()
        return await fut

    async def turn(self, text: str, **kwargs: Any) -> str:
        """Start a turn and return its final text. Non-interactive: raises if it parks, fails or is cancelled."""
        turn_id = await self.start(text, **kwargs)
        result = await self.result(turn_id)
        if isinstance(result, Completed):
            return result.text
        if isinstance(result, Suspended):
            raise TurnSuspendedError(
                f"turn {turn_id} parked awaiting input {result.request.id!r}; use start() and resume()"
            )
        if isinstance(result, Failed):
            raise TurnFailedError(result.error.message)
        if isinstance(result, Cancelled):
            raise TurnCancelledError(f"turn {turn_id} was cancelled ({result.reason})")
        assert isinstance(result, Rejected)
        raise TurnRejectedError(result.reason)

    def observe(self, callback: Observer, *, turn_id: str | None = None, replay: bool = False) -> Callable[[], None]:
        """Call ``callback`` with every event of the session (or of one turn); returns an unsubscribe function.

        With ``replay=True`` the structural events already committed are delivered first,
        from the store, then live ones, none twice.
        """
        after = 0
        if replay:
            for event in self.store.events(self.ref, turn_id=turn_id):
                callback(event)
                after = event.seq or after
        return self.runtime.fanout.subscribe(self.ref, callback, turn_id=turn_id, after_seq=after)

    def pending(self) -> SuspendedCheckpoint | None:
        """The parked turn's checkpoint (its request, call id, opening text), or None."""
        return self.store.pending(self.ref)

    def waiting_on(self) -> list[tuple[SessionRef, SuspendedCheckpoint]]:
        """The parked turn's request and, while it waits for a child turn (``ctx.delegate``), the child's park,
        all the way down: the last entry is the request a person can answer. Empty when not parked."""
        return park_chain(self.store, self.ref)

    # --- control ------------------------------------------------------------------------------

    async def cancel(self, turn_id: str) -> bool:
        """Ask a queued or running turn to stop at its next checkpoint boundary. False if there is none.

        A turn parked on child turns (``ctx.delegate``) is cancelled through them: True when one of them was
        marked (a child parked on a person is not: answer or reset it, or reset this session)."""
        marked, children = self._cancel("requested", turn_ids=[turn_id])
        return bool(marked or children)

    def cancel_all(self, reason: str = "requested", *, turn_ids: list[str] | None = None) -> list[str]:
        """Cancel every unfinished turn (or those named), durably; never a parked one. Usable from a tool.

        Their child turns, and those of a turn parked on its children, are cancelled too (reason ``parent``)."""
        return self._cancel(reason, turn_ids=turn_ids)[0]

    def _cancel(self, reason: str, *, turn_ids: list[str] | None) -> tuple[list[str], list[str]]:
        """:meth:`cancel_all`; returns the turns marked and the child turns marked."""
        marked = self.store.request_cancel(self.ref, reason, turn_ids=turn_ids)
        for t in marked:
            self._signal_cancel(t, reason)
        children = self.runtime.cancel_children(self.ref, marked) if marked else []
        parked = self.store.pending(self.ref)
        if parked is not None and (turn_ids is None or parked.turn_id in turn_ids):
            # parked on a running child: its cancel is stored, the child is cancelled, and the child's answer
            # wakes it to end cancelled
            children += self.runtime.cancel_parked(self.ref, parked.turn_id, reason)
        return marked, children

    async def resume(
        self,
        turn_id: str,
        input_id: str,
        value: JsonValue,
        *,
        by: str | None = None,
        principal: Principal | None = None,
        granted: Grant | None = None,
        child_turn: str | None = None,
        cancel: str | None = None,
    ) -> None:
        """Answer the parked turn and let it continue. ``by`` must be an identity you verified.

        ``child_turn`` is for the runtime only: the child turn whose end answers its reserved request
        (``child:...``, :mod:`~june_worker.engine.children`); such a request refuses every other answer.
        ``cancel``, also the runtime's: the parked turn's cancel that answer carries. A cancel stored with the park
        is carried by any answer: the turn then goes on, whatever else it waits for, and ends ``cancelled``.

        Raises :class:`~june_worker.errors.ResumeAuthorizationError` when ``by`` may not answer,
        :class:`~june_worker.errors.ResumeConflictError` when the session is not parked on
        exactly this turn and input (or a reset is pending), and
        :class:`~june_worker.errors.InvalidAnswerError` when the answer fails the request's schema.
        """
        refuse_reserved(input_id, child_turn)
        stored = self.store.get_turn(self.ref, turn_id)
        cancel = (stored.cancel_reason if stored is not None else None) or cancel
        attempt, tries = 0, RESUME_RACES
        while True:
            attempt += 1
            pending = self.store.pending(self.ref)
            if pending is not None and self._expire_due(pending):
                pending = still_open(self.store.pending(self.ref), pending, turn_id, input_id)
            parked = check_parked(pending, turn_id, input_id, reset_pending=self._reset_pending)
            tries = max(tries, race_tries(parked))
            grant = granted
            if child_turn is not None:
                grant = child_grant(child_turn)
            elif grant is None:
                grant = await grant_answer(self.agent, parked, session=self.ref.session, by=by, principal=principal)
            commit = resume_commit(parked, value, by=by, granted=grant, cancel=cancel)
            try:
                self._apply(commit)
                break
            except ResumeConflictError:
                if attempt >= tries:
                    raise
            # another request of the park was answered meanwhile: read it again (ours may still be open)
            await asyncio.sleep(race_wait_s(attempt))
        self._disarm(turn_id)
        if commit.suspended is not None:
            self._arm(turn_id)  # the park goes on with its other requests
        self._kick()

    def reset(self) -> asyncio.Task[ResetResult]:
        """Retire the session's history: cancel unfinished turns, archive, start generation + 1.

        Takes effect at once (a resume is refused from now on); await the returned task
        for ``{previous_session, generation}``.
        """
        if not callable(getattr(self.store, "reset", None)):
            raise ResetNotSupportedError(f"{type(self.store).__name__} does not implement reset")
        self._reset_pending = True
        self.cancel_all("reset")
        return asyncio.get_running_loop().create_task(self._reset())

    async def idle(self) -> None:
        while self._drainer is not None and not self._drainer.done():
            await asyncio.wait({self._drainer})

    # --- internals ----------------------------------------------------------------------------

    def _apply(self, commit: Commit) -> None:
        events = self.store.commit(self.ref, commit)
        self.runtime.fanout.publish(self.ref, events)

    def _signal_cancel(self, turn_id: str, reason: str) -> None:
        probe = self._cancels.get(turn_id)
        if probe is not None:
            probe.set(reason)

    async def _reset(self) -> ResetResult:
        try:
            await self.idle()
            parked = self.store.pending(self.ref)
            if parked is not None:
                # A stale park ends with the reset: archived, and its followers see it end.
                self._disarm(parked.turn_id)
                self._apply(reset_park_commit(parked))
                self._resolve(parked.turn_id, Cancelled(turn_id=parked.turn_id, reason="reset"))
            return self.store.reset(self.ref)
        finally:
            self._reset_pending = False
            self._kick()

    def _kick(self) -> None:
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        last: tuple[str, str] | None = None
        transient = 0
        while True:
            try:
                turns = self.store.unfinished_turns(self.ref)
            except Exception:
                log.exception("cannot list the turns of %s; drain stopped", self.ref)
                return
            if not turns:
                return
            rec = turns[0]
            if self._reset_pending and rec.cancel_reason is None:
                return  # queued after the reset was asked for: runs on the new generation
            if last == (rec.turn_id, rec.status) and rec.status == "queued" and not transient:
                log.error("turn %s of %s did not advance; drain stopped", rec.turn_id, self.ref)
                return
            last = (rec.turn_id, rec.status)
            probe = self._cancels[rec.turn_id] = _TurnCancel(rec.cancel_reason)
            runner = TurnRunner(
                self.agent,
                self.store,
                self.runtime.fanout,
                self.ref,
                rec,
                cancel=probe,
                crash=self.runtime.crash,
                runtime=self.runtime,
                max_attempts=self.runtime.max_attempts,
                children=self.runtime,
                race_stall_s=self.runtime.race_stall_s,
            )
            try:
                result = await runner.run()
            except Exception as exc:
                if classify(exc, phase="store") is not Failure.TRANSIENT:  # a bug: this host stops, the store keeps it
                    self._fail_waiters(rec.turn_id, exc)
                    log.exception("turn %s of %s stopped without a result", rec.turn_id, self.ref)
                    return
                # The store (or the model: a retryable provider error) failed for longer than one attempt's
                # retries: start another attempt later (it is counted, so a fault that never passes ends the
                # turn as poison), unless even counting fails as long.
                transient += 1
                if transient <= self.runtime.max_attempts:
                    log.warning(
                        "turn %s of %s: attempt ended on a transient fault (%s); trying again",
                        rec.turn_id,
                        self.ref,
                        exc,
                    )
                    await asyncio.sleep(backoff_s(transient, base_s=0.2, cap_s=5.0))
                    continue
                self._fail_waiters(rec.turn_id, exc)
                log.error("turn %s of %s: the transient fault did not pass; drain stopped", rec.turn_id, self.ref)
                return
            except BaseException as exc:  # an injected crash: this host stops here, the store keeps the turn
                self._fail_waiters(rec.turn_id, exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            finally:
                self._cancels.pop(rec.turn_id, None)
            transient = 0
            if rec.payload.target is not None and not isinstance(result, Rejected) and not runner.raced:
                # (a run that lost the race for the turn reports the winner's result; the winner delivers it)
                try:
                    events = self.store.events(self.ref, turn_id=rec.turn_id)
                    await deliver_result(
                        self.agent, target=rec.payload.target, result=result, events=events, session=self.ref.session
                    )
                except Exception:
                    log.exception("delivering turn %s of %s failed", rec.turn_id, self.ref)
            self._resolve(rec.turn_id, result)
            if isinstance(result, Suspended):
                self._arm(result.turn_id)
                last = None  # a park is progress: answered at once below, the turn is queued again, and runs on
                await self._wake_from_child()  # its children may have ended before it parked
                parked = self.store.pending(self.ref)
                if rec.payload.parent is not None and parked is not None and parked.turn_id == rec.turn_id:
                    for ref, events in announce_child_park(self.store, rec, parked):
                        self.runtime.fanout.publish(ref, events)
            if result.status in ENDS_CHILDREN:
                self.runtime.cancel_children(self.ref, [rec.turn_id])
            if rec.payload.parent is not None and result.status in ENDED_TURN_STATUSES:
                try:
                    await self.runtime.child_ended(rec, result)
                except BaseException as exc:  # an injected crash: this host stops here, like a dead process
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    log.warning("turn %s of %s ended but did not answer its parent: %r", rec.turn_id, self.ref, exc)
                    return

    def _fail_waiters(self, turn_id: str, exc: BaseException) -> None:
        """Hand an exception that ended a turn's run to that turn's own waiters, and no one else's."""
        for fut in self._waiters.pop(turn_id, []):
            if not fut.done():
                fut.set_exception(exc)

    def _resolve(self, turn_id: str, result: TurnResult) -> None:
        for fut in self._waiters.pop(turn_id, []):
            if not fut.done():
                fut.set_result(result)

    def _arm(self, turn_id: str, *, refused: bool = False) -> None:
        """Answer the park with a timeout when it expires (``request_input(timeout_s=...)``), by the store's stamp.

        ``refused``: the store just refused the timeout as not due by its own clock (this process's clock is
        ahead of it): try again no sooner than :data:`PARK_REARM_FLOOR_S`, not at once over and over.
        """
        parked = self.store.pending(self.ref)
        if parked is None or parked.turn_id != turn_id or parked.expires_at is None:
            return
        delay = max(PARK_REARM_FLOOR_S if refused else 0.01, parked.expires_at - time.time())
        loop = asyncio.get_running_loop()
        self._timers[turn_id] = loop.call_later(delay, lambda: loop.create_task(self._expire()))

    def _look(self) -> None:
        """This runtime's first look at the session: a park left by another process gets its expiry armed here
        (no timer of the process that parked survives it), answered at once if it expired meanwhile."""
        if self._looked:
            return
        self._looked = True
        parked = self.store.pending(self.ref)
        if parked is not None and parked.turn_id not in self._timers:
            self._arm(parked.turn_id)
        if parked is not None and children_of_park(self.ref, parked):
            # parked on a child by another process: answer it if the child ended, else make sure the child runs
            task = asyncio.get_running_loop().create_task(self._wake_from_child())
            self._wakers.add(task)
            task.add_done_callback(self._wakers.discard)

    async def _wake_from_child(self) -> None:
        """Answer each child request of the park whose child turn has ended with the child's result; see that
        the unfinished children run (the process that started them may have died)."""
        parked = self.store.pending(self.ref)
        for child_ref, child_turn in children_of_park(self.ref, parked) if parked is not None else []:
            rec = self.store.get_turn(child_ref, child_turn)
            if rec is None or child_ref.agent not in self.runtime.agents:
                continue
            if rec.status in ENDED_TURN_STATUSES and rec.result is not None:
                await self.runtime.child_ended(rec, rec.result)
            elif rec.status in UNFINISHED_TURN_STATUSES:
                self.runtime.session(child_ref.agent, child_ref.session)._kick()

    def _expire_due(self, parked: SuspendedCheckpoint) -> bool:
        """Answer ``parked`` with a timeout now if its (stored) expiry has passed; True if it did."""
        if parked.expires_at is None or parked.expires_at > time.time():
            return False
        commit = timeout_commit(parked)
        if commit is None:
            return False
        try:
            self._apply(commit)
        except ResumeConflictError:
            return False
        self._disarm(parked.turn_id)
        self._arm(parked.turn_id)  # requests that expire later keep the park
        self._kick()
        return True

    def _disarm(self, turn_id: str) -> None:
        timer = self._timers.pop(turn_id, None)
        if timer is not None:
            timer.cancel()

    async def _expire(self) -> None:
        parked = self.store.pending(self.ref)
        if parked is None:
            return
        commit = timeout_commit(parked)
        if commit is None:
            return
        self._timers.pop(parked.turn_id, None)
        try:
            self._apply(commit)
        except ResumeConflictError:  # answered just before the timer fired, or not expired by the store's stamp
            self._arm(parked.turn_id, refused=True)
            return
        self._arm(parked.turn_id)  # requests that expire later keep the park
        self._kick()
