"""The turn loop: model step, tool steps, until the model answers without a tool call.

Position is read off the transcript, never off memory: a redelivered turn finds its
opening message (and does not append it again), finds the calls still owed a result, and
continues at the first step with nothing stored. Every checkpoint is one
:meth:`SessionStore.commit`; structural events are published only after it returns.

The one rule a reader must not break: **nothing reaches the store outside a commit, and
nothing is published before its commit.**

This module owns :class:`TurnRunner`'s course through a turn: its attempts (transient retries, lost
races, poison), the opening, the loop itself and the endings (park, cancel, fail, complete). The steps
are :mod:`._model_steps` and :mod:`._tool_steps`; the state they share and the commit are
:mod:`._runner_base`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from june_wire.storable import storable_json

from ..errors import (
    LeaseLostError,
    PoisonTurnError,
    TurnEndedError,
)
from ._model_steps import ModelSteps
from ._runner_base import _Cancel, _Fresh, _Park, _StepFailure, log
from ._tool_steps import ToolSteps
from .cancel import NO_CANCEL, CancelProbe
from .children import child_session_id, parse_child_input
from .crash import CrashHook
from .endings import error_info, reject_turn
from .events import (
    Cancelled,
    Completed,
    Failed,
    InputRequested,
    Suspended,
    TurnCancelled,
    TurnCompleted,
    TurnFailed,
    TurnResult,
    TurnStarted,
)
from .failures import Failure, backoff_s, classify
from .races import winners_outcome
from .signals import CrashInjected
from .store import (
    ENDED_TURN_STATUSES,
    INITIATOR_STEP,
    Commit,
    OpenInput,
    StepRecord,
    SurfacePolicy,
    SuspendedCheckpoint,
    TurnPayload,
)
from .types import (
    AssistantMessage,
    InboundTrigger,
    InputRequest,
    JsonValue,
    Message,
    Principal,
    ProactiveTrigger,
    ToolCall,
    ToolMessage,
    Trigger,
    TriggerMessage,
    Usage,
    UserMessage,
)

__all__ = ["NO_CANCEL", "CancelProbe", "CrashHook", "TurnRunner", "error_info", "reject_turn"]


def opening_commit(turn_id: str, payload: TurnPayload, seat: Principal | None, *, at: int = 0) -> Commit:
    """The commit that opens a turn: its opening message at index ``at`` (the transcript's end; the worker's
    intake statement places it there itself), its ``turn.started`` event, the session and the turn running.
    ``seat``: the principal the session's initiator step goes to, in the same transaction, when the session has
    none yet.

    The runner makes it (:meth:`TurnRunner._open`); a worker sends the same to the database with its intake,
    so that a new turn is recorded, leased and opened in one statement (``june_intake``, Postgres migration 17)."""
    opening: Message
    if payload.trigger_by is not None:
        opening = TriggerMessage(turn_id=turn_id, text=payload.text, by=payload.trigger_by)
    else:
        opening = UserMessage(turn_id=turn_id, text=payload.text)
    trigger: Trigger = (
        InboundTrigger(event=payload.event.without_raw())
        if payload.event is not None
        else ProactiveTrigger(by=payload.trigger_by or "system")
    )
    steps = [StepRecord(step_id=INITIATOR_STEP, turn_id=turn_id, data=seat.model_dump())] if seat is not None else []
    return Commit(
        messages=[(at, opening)],
        steps=steps,
        events=[TurnStarted(turn_id=turn_id, trigger=trigger, parent=payload.parent)],
        status="running",
        turn_id=turn_id,
        turn_status="running",
    )


class TurnRunner(ModelSteps, ToolSteps):
    """Runs (or replays) one turn of one session to a result.

    A runner is used once. The host (in-process session, Celery worker) makes sure only one
    runner works on a session at a time, and passes the session's fencing token when it has
    one, so that a runner whose lease was taken over cannot commit.

    ``snapshot``: the session as the host read it once it held the session (the worker reads it
    with the lease, in the same statement); without one the runner loads it from the store.

    Failures follow :mod:`.failures`: a transient fault re-runs the step from a fresh read of
    the store (up to ``step_retries`` times, then :meth:`run` raises it and the host starts
    another attempt later); a turn started ``max_attempts`` times ends ``failed`` as poison;
    anything else that escapes a step ends the turn ``failed``. :meth:`run` raises only for a
    transient fault it could not outlast, a lost lease, and an injected crash.

    ``attempt``: which attempt at the turn this run is, stamped on its deltas; by default the
    turn record's ``attempts`` plus one. A transient retry within the run moves it on by one, so a
    reader can drop the failed try's text (it may then share its number with the next attempt's
    first try, which only costs a reader the chance to drop a dead try's text).

    ``hooks``: how the host watches the run (:mod:`.hooks`): each step is wrapped in
    ``hooks.step``, each accepted commit goes to ``hooks.committed``. Nothing else.

    ``race_stall_s``: a run whose commit was refused because another runner committed that step first (two
    in-process runtimes on one database) reports that runner's outcome; it waits this long for the turn to move
    before it takes the other for dead and runs the turn on (:mod:`.races`).

    ``counted``: the host counted this start in the statement that picked the turn (a worker does, so that
    a process that dies before the runner's first commit, however often, still uses up the turn's
    attempts); ``record.attempts`` is the count before it. The runner then writes no count of its own.

    ``blocking``, ``statements``: where the turn's blocking calls run (:mod:`.blocking`). ``statements`` takes
    the commits whose checkpoint is ready (one statement and its publish, no tool code inside), ``blocking``
    everything else (a sync tool inside its step's transaction, reads, a child's launch); by default both go
    to ``blocking``. Calls of one turn run one at a time, in the order asked, whichever of the two took them.
    """

    # --- entry point -----------------------------------------------------------------------------

    async def run(self) -> TurnResult:
        rec = self.record
        if rec.status in ENDED_TURN_STATUSES and rec.result is not None:
            return rec.result  # a redelivered turn that already ended reports its own result
        retry = 0
        while True:
            try:
                return await self._attempt()
            except (LeaseLostError, CrashInjected):
                raise
            except TurnEndedError:
                # Ended meanwhile by someone else (a reset, the sweeper giving it up): report that ending.
                ended = await self._blocking(lambda: self.store.get_turn(self.ref, self.turn_id))
                if ended is None or ended.result is None:
                    raise
                return ended.result
            except Exception as exc:
                kind = classify(exc, phase="store")
                if kind is Failure.LOST_RACE:
                    won = await self._lost_race(exc)
                    if won is not None:
                        return won
                    continue  # the winner stopped moving: run the turn on from what the store holds
                if kind is not Failure.TRANSIENT:
                    return await self._failed_outside_step(exc)
                if retry >= self.step_retries:
                    await self._note_error(exc)
                    raise
                delay = backoff_s(retry)
                retry += 1
                log.warning(
                    "turn %s of %s: transient fault at %s (%s: %s); running it again from the store in %.2fs",
                    self.turn_id,
                    self.ref,
                    self._at[1],
                    type(exc).__name__,
                    error_info(exc).message,
                    delay,
                )
                await asyncio.sleep(delay)
                self._snapshot = None  # a commit whose outcome is unknown may have landed: read it back
                self.attempt += 1  # the try's deltas are told apart from the failed one's

    async def _lost_race(self, exc: Exception) -> TurnResult | None:
        """Another runner committed this turn's step first: report its outcome (:mod:`.races`), writing nothing."""
        self.raced = True
        log.info("turn %s of %s: %s; another runner has it, waiting for its outcome", self.turn_id, self.ref, exc)
        won = await winners_outcome(
            self.store, self.ref, self.turn_id, stall_s=self.race_stall_s, blocking=self._blocking
        )
        if won is None:
            log.warning("turn %s of %s: the runner that won it stopped moving; running it on", self.turn_id, self.ref)
            self._snapshot = None
            self.attempt += 1
        return won

    async def _attempt(self) -> TurnResult:
        snap = self._snapshot if self._snapshot is not None else await self._blocking(lambda: self.store.load(self.ref))
        self._snapshot = None
        self.generation = snap.generation
        self.messages = list(snap.messages)
        self.compacted_at = self._summary_index(snap.compacted_at)
        self.steps.clear()
        self.steps.update(snap.steps)  # in place: the input broker reads this same mapping
        self.usage = Usage()
        self._at = (None, "turn:open")
        payload = self.record.payload
        event = payload.event
        self.policy = self.agent.policy_for(event)
        self.principal = event.principal if event else None
        if snap.suspended is not None and snap.suspended.turn_id == self.turn_id:
            # A parked turn delivered again: it stays parked and announces nothing new.
            parked = snap.suspended
            return Suspended(turn_id=self.turn_id, request=parked.request, more=[i.request for i in parked.more])
        initiator_step = self.steps.get(INITIATOR_STEP)
        self.initiator = Principal.model_validate(initiator_step.data) if initiator_step else None
        opening = self._opening_index()
        try:
            opened, self._opened = self._opened, None  # (once: a retry reads the opening back from the store)
            if opening is None and opened is not None:
                await self._opened_by_host(opened)
            elif opening is None:
                self._check_cancel()  # a turn cancelled before it opened never runs
                rejected = self._rejection(snap.suspended)
                if rejected is not None:
                    return await self._reject(rejected)
                if self.record.attempts >= self.max_attempts:  # each start died before it could open the turn
                    return await self._poisoned(self.record.attempts, at=(None, "turn:open"))
                self._hit("before-start", "turn:open")
                await self._open()
            else:
                self._restore_turn_state()
                poisoned = await self._count_attempt()
                if poisoned is not None:
                    return poisoned
            self.tools = self.agent.tools_for(self.policy, self.principal)
            return await self._loop()
        except _Cancel as c:
            return await self._cancelled(c.reason)
        except _StepFailure as f:
            return await self._failed(f.exc, f.phase, f.step)

    # --- attempts and poison -----------------------------------------------------------------------

    async def _count_attempt(self) -> Failed | None:
        """A replay is another attempt at the turn: count it, or give the turn up when it had ``max_attempts``.

        The opening commit counts a turn's first attempt; a resume starts the count again.
        """
        if self._counted:
            return None  # a transient retry within this attempt
        self._counted = True
        attempts = self.record.attempts
        if attempts >= self.max_attempts:
            return await self._poisoned(attempts)
        self._hit("before-start", "turn:open")
        # (counted where it was picked, the commit still says the turn runs again: a resumed one was queued)
        await self._commit(Commit(turn_id=self.turn_id, turn_status="running", count_attempt=not self._counted_by_host))
        return None

    async def _poisoned(self, attempts: int, *, at: tuple[str | None, str] | None = None) -> Failed:
        phase, step = at if at is not None else self._next_step()
        last = self.record.last_error
        why = (
            f"the last one ended with: {last}"
            if last
            else "each ended without a result (the process running it died, or lost the session)"
        )
        exc = PoisonTurnError(f"turn {self.turn_id} was given up after {attempts} attempts at {step}; {why}")
        return await self._failed(exc, phase, step)

    def _next_step(self) -> tuple[str, str]:
        """The phase and step this turn would run next, read off the transcript."""
        owed = self._owed_calls()
        if owed is not None:
            n, calls = owed
            return "tool", f"tool:{n}:{calls[0].id}"
        return "model", f"model:{len(self.messages)}"

    async def _note_error(self, exc: BaseException) -> None:
        """Record why this attempt ends without a result; best effort (the store may be the reason)."""
        info = error_info(exc)
        try:
            note = Commit(turn_id=self.turn_id, turn_error=f"{info.type}: {info.message}"[:2000])
            await self._blocking(lambda: self.store.commit(self.ref, note, fence=self.fence))
        except Exception:
            log.debug("could not record the last error of turn %s", self.turn_id, exc_info=True)

    async def _failed_outside_step(self, exc: Exception) -> Failed:
        """A fault no step handled (a commit the store refused, a bug): the turn fails, the session goes on."""
        phase, step = self._at
        return await self._failed(exc, phase, step)

    # --- opening ---------------------------------------------------------------------------------

    def _opening_index(self) -> int | None:
        i = len(self.messages) - 1
        found = None
        while i >= 0 and self.messages[i].turn_id == self.turn_id:
            found = i
            i -= 1
        return found

    def _rejection(self, suspended: SuspendedCheckpoint | None) -> str | None:
        if suspended is not None:
            return (
                f"session {self.ref.session} is suspended awaiting input {suspended.request.id!r} "
                f"(turn {suspended.turn_id}); resume or reset it first"
            )
        return None

    async def _open(self) -> None:
        seat = self.principal is not None and self.initiator is None  # the seat goes to the first resolved principal
        commit = opening_commit(
            self.turn_id, self.record.payload, self.principal if seat else None, at=len(self.messages)
        )
        commit.count_attempt = not self._counted_by_host
        await self._commit(commit, "turn:open", cancellable=True)  # a turn cancelled before it opened never opens
        if seat:
            self.initiator = self.principal
        self._counted = True

    async def _opened_by_host(self, opened: Commit) -> None:
        """The turn's opening, which the host committed with its intake (the same commit :meth:`_open` makes):
        publish its event and take it in, as :meth:`_commit` does after the store returns."""
        self._hit("before-start", "turn:open")
        self._hit("before-publish", "turn:open")
        # (not through _blocking: with many turns per process the turn's sink hands the publish to the turn's
        # thread and returns at once; with one turn per process nothing else runs on the loop)
        self.sink.publish(self.ref, opened.events)
        self._took_in(opened)
        if any(s.step_id == INITIATOR_STEP for s in opened.steps):
            self.initiator = self.principal
        self._counted = True

    def _restore_turn_state(self) -> None:
        """A replay: sum the usage of the model steps already done, keep the policy saved at park."""
        answers = f"input:{self.turn_id}:"
        for step in self.steps.values():
            if step.turn_id != self.turn_id or not isinstance(step.data, dict):
                continue
            if step.step_id.startswith(("model:", "compact:")) and step.data.get("usage"):
                self.usage = self.usage + Usage.model_validate(step.data["usage"])
            elif step.step_id.startswith(answers) and step.data.get("policy"):
                self.policy = SurfacePolicy.model_validate(step.data["policy"])

    async def _reject(self, reason: str) -> TurnResult:
        result = await self._blocking(
            lambda: reject_turn(self.store, self.sink, self.ref, self.turn_id, reason, fence=self.fence)
        )
        assert result is not None  # an unfinished turn is always rejected here
        return result

    # --- the loop ----------------------------------------------------------------------------------

    async def _loop(self) -> TurnResult:
        while True:
            owed = self._owed_calls()
            if owed is not None:
                n, calls = owed
                if await self._flush_settled(n):
                    continue  # results a crash left without their messages: in the transcript now
                reason = self.cancel.reason()
                if reason is not None:
                    return await self._cancelled(reason)
                parks = await self._tool_batch(n, calls)
                if parks:
                    return await self._park(parks)
                continue
            last = self.messages[-1]
            if isinstance(last, AssistantMessage) and last.turn_id == self.turn_id:
                # The final reply committed but the turn was not closed with it (older row); close now.
                return await self._complete_without_step(last.text)
            if await self._compact_if_due():
                continue  # the summary committed (a step of its own): come back for the model call
            with self.hooks.step("model", f"model:{len(self.messages)}"):
                result = await self._model_step()
            if result is not None:
                return result

    # --- endings ---------------------------------------------------------------------------------

    async def _park(self, parks: list[_Park]) -> Suspended:
        """Park the turn on the requests its calls left open (several when calls ran in parallel; one request
        per id: calls that asked the same id get the same answer)."""
        opened: dict[str, tuple[_Park, InputRequest]] = {}
        for park in parks:
            request = InputRequest.model_validate(storable_json(park.request.model_dump(by_alias=True)))
            opened.setdefault(request.id, (park, request))
        (first, request), *others = opened.values()
        event = self.record.payload.event
        checkpoint = SuspendedCheckpoint(
            turn_id=self.turn_id,
            request=request,
            call_id=first.call.id,
            opening_text=self.record.payload.text,
            policy=self.policy,
            event=event.without_raw() if event else None,
            principal=self.principal,
            more=[OpenInput(request=r, call_id=p.call.id) for p, r in others],
        )
        result = Suspended(turn_id=self.turn_id, request=request, more=[r for _, r in others])
        await self._commit(
            Commit(
                events=[self._input_requested(p, r) for p, r in opened.values()],
                status="suspended",
                suspended=checkpoint,
                turn_id=self.turn_id,
                turn_status="suspended",
                turn_result=result,
            ),
            "turn:end",
            cancellable=True,
        )
        return result

    def _input_requested(self, park: _Park, request: InputRequest) -> InputRequested:
        """The event of one request the turn parks on; a child turn's request names that child turn."""
        child = parse_child_input(request.id)
        if child is None:
            return InputRequested(turn_id=self.turn_id, step=park.step, request=request)
        agent, turn_id = child
        return InputRequested(
            turn_id=self.turn_id,
            step=park.step,
            request=request,
            child_agent=agent,
            child_session=child_session_id(self.ref.session, turn_id, park.call.id),
            child_turn_id=turn_id,
        )

    def _close_batch(self, result_for: Callable[[ToolCall], tuple[JsonValue, str | None]]) -> list[tuple[int, Message]]:
        """Tool messages for every call still owed one, so the transcript stays valid for the next turn."""
        owed = self._owed_calls()
        if owed is None:
            return []
        n, calls = owed
        out: list[tuple[int, Message]] = []
        at = len(self.messages)
        for call in calls:
            result, error = self._stored_result(n, call) or result_for(call)
            out.append(
                (
                    at,
                    ToolMessage(
                        turn_id=self.turn_id, call_id=call.id, name=call.name, result=result, is_error=error is not None
                    ),
                )
            )
            at += 1
        return out

    async def _cancelled(self, reason: str) -> Cancelled:
        result = Cancelled(turn_id=self.turn_id, reason=reason)

        def ending() -> Commit:
            return Commit(
                messages=self._close_batch(lambda call: ({"cancelled": True}, None)),
                events=[TurnCancelled(turn_id=self.turn_id, reason=reason)],
                status="done",
                turn_id=self.turn_id,
                turn_status="cancelled",
                turn_result=result,
            )

        await self._commit(_Fresh(ending), "turn:end")
        return result

    async def _failed(self, exc: BaseException, phase: str | None, step: str) -> Failed:
        if isinstance(exc, (LeaseLostError, CrashInjected)):
            raise exc
        info = error_info(exc)
        result = Failed(turn_id=self.turn_id, error=info, phase=phase, step=step)
        failing_call = step.split(":", 2)[2] if phase == "tool" and step.count(":") >= 2 else None

        def closing(call: ToolCall) -> tuple[JsonValue, str | None]:
            message = info.message if call.id == failing_call else "not run: the turn failed"
            return {"error": message}, message

        log.error(
            'agent "%s" turn %s failed at %s: %s: %s',
            self.agent.name,
            self.turn_id,
            step,
            info.type,
            info.message,
            exc_info=exc,
        )

        def ending() -> Commit:
            return Commit(
                messages=self._close_batch(closing),
                events=[TurnFailed(turn_id=self.turn_id, error=info, phase=phase, step=step)],
                status="done",
                turn_id=self.turn_id,
                turn_status="failed",
                turn_result=result,
            )

        await self._commit(_Fresh(ending), "turn:end")
        return result

    async def _complete_without_step(self, text: str) -> Completed:
        result = Completed(turn_id=self.turn_id, text=text, usage=self.usage)
        await self._commit(
            Commit(
                events=[TurnCompleted(turn_id=self.turn_id, text=text, usage=self.usage)],
                status="done",
                turn_id=self.turn_id,
                turn_status="completed",
                turn_result=result,
            ),
            "turn:end",
        )
        return result
