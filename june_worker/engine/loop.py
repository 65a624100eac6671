"""The turn loop: model step, tool steps, until the model answers without a tool call.

Position is read off the transcript, never off memory: a redelivered turn finds its
opening message (and does not append it again), finds the calls still owed a result, and
continues at the first step with nothing stored. Every checkpoint is one
:meth:`SessionStore.commit`; structural events are published only after it returns.

The one rule a reader must not break: **nothing reaches the store outside a commit, and
nothing is published before its commit.**
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ..errors import (
    CancelRequestedError,
    ContextWindowExceededError,
    FatalToolError,
    LeaseLostError,
    ModelStepError,
    ModelStreamError,
    PoisonTurnError,
    TurnEndedError,
)
from .agent import Agent
from .blocking import Blocking, finish, inline
from .cancel import NO_CANCEL, CancelProbe
from .children import ChildLauncher, Delegator, child_session_id, parse_child_input
from .context import Compaction, Due, compaction_due, plan_compaction, refused_due, request_view
from .crash import CrashHook
from .cutoff import CUT_OFF_FINISHES, without_cut_calls
from .endings import error_info, reject_turn
from .events import (
    ActionCompleted,
    ActionRequested,
    Cancelled,
    Completed,
    ContextCompacted,
    Failed,
    InputRequested,
    MessageCompleted,
    MessageDelta,
    ReasoningDelta,
    Suspended,
    TurnCancelled,
    TurnCompleted,
    TurnEvent,
    TurnFailed,
    TurnResult,
    TurnStarted,
)
from .failures import DEFAULT_MAX_ATTEMPTS, RACE_STALL_S, STEP_RETRIES, Failure, backoff_s, classify
from .hooks import NO_HOOKS, TurnHooks
from .inputs import InputBroker
from .model import Done, Model, ModelRequest, ReasoningChunk, TextChunk
from .races import winners_outcome
from .secrets import StreamScrubber, scrub, scrub_json, scrubbed_logger
from .signals import CrashInjected, ParkSignal, SyncParkError
from .sink import EventSink
from .storable import storable_json, storable_text
from .store import (
    ENDED_TURN_STATUSES,
    INITIATOR_STEP,
    Commit,
    CommitBuilder,
    OpenInput,
    SessionRef,
    SessionSnapshot,
    SessionStore,
    StepRecord,
    StoreHandle,
    SurfacePolicy,
    SuspendedCheckpoint,
    TurnRecord,
)
from .tools import (
    SyncToolReturnedAwaitableError,
    Tool,
    ToolContext,
    ToolInputError,
    format_tool_error,
)
from .types import (
    AssistantMessage,
    Finish,
    InboundTrigger,
    InputRequest,
    JsonValue,
    Message,
    ModelReply,
    Principal,
    ProactiveTrigger,
    SummaryMessage,
    ToolCall,
    ToolMessage,
    Trigger,
    TriggerMessage,
    Usage,
    UserMessage,
)

__all__ = ["NO_CANCEL", "CancelProbe", "CrashHook", "TurnRunner", "error_info", "reject_turn"]

log = scrubbed_logger("june_worker.turn")


class _Cancel(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _StepFailure(Exception):
    """Carries the exception that failed a step, with where it happened."""

    def __init__(self, exc: BaseException, phase: str, step: str) -> None:
        super().__init__(str(exc))
        self.exc = exc
        self.phase = phase
        self.step = step


class _ToolRaised(BaseException):
    """Raised inside a sync tool's commit builder so the store rolls the tool's writes back."""

    def __init__(self, exc: Exception) -> None:
        super().__init__(exc)
        self.exc = exc


def _to_json(value: Any) -> JsonValue:
    """A tool result as plain, storable JSON with no secret in it (:mod:`.secrets`: what the model reads next, so
    it cannot repeat one); pydantic models are dumped, anything else must already be JSON."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    else:
        json.dumps(value, allow_nan=False)
    return scrub_json(storable_json(value))


def _storable_reply(reply: ModelReply) -> ModelReply:
    """The model's reply with every string storable (text, tool calls, reasoning) and no secret in its text or its
    calls' input; usually the reply itself. Its reasoning and a call's provider_state are left as they came: a
    provider signs them, and takes them back only unchanged (the published reasoning deltas are scrubbed)."""
    data = reply.model_dump(by_alias=True)
    clean = storable_json(data)
    text = scrub(clean["text"])
    inputs = [scrub_json(call["input"]) for call in clean["tool_calls"]]  # (a call's provider_state is opaque too)
    if text is not clean["text"] or any(a is not c["input"] for a, c in zip(inputs, clean["tool_calls"], strict=True)):
        calls = [{**c, "input": a} for a, c in zip(inputs, clean["tool_calls"], strict=True)]
        clean = {**clean, "text": text, "tool_calls": calls}
    return reply if clean is data else ModelReply.model_validate(clean)


@dataclass(frozen=True)
class _Fresh:
    """A commit to make from the runner's state once the turn's earlier commits are mirrored (see ``_commit``)."""

    make: Callable[[], Commit]


@dataclass
class _Park:
    request: InputRequest
    step: str
    call: ToolCall


class TurnRunner:
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
    """

    def __init__(
        self,
        agent: Agent,
        store: SessionStore,
        sink: EventSink,
        ref: SessionRef,
        record: TurnRecord,
        *,
        fence: int | None = None,
        cancel: CancelProbe = NO_CANCEL,
        crash: CrashHook | None = None,
        runtime: Any = None,
        snapshot: SessionSnapshot | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        step_retries: int = STEP_RETRIES,
        attempt: int | None = None,
        hooks: TurnHooks = NO_HOOKS,
        children: ChildLauncher | None = None,
        counted: bool = False,
        race_stall_s: float = RACE_STALL_S,
        blocking: Blocking = inline,
    ) -> None:
        self.agent = agent
        self.store = store
        self.sink = sink
        self.ref = ref
        self.record = record
        self.turn_id = record.turn_id
        self.fence = fence
        self.cancel = cancel
        self._crash = crash
        self.runtime = runtime
        self._snapshot = snapshot
        self.max_attempts = max_attempts
        self.step_retries = step_retries
        self.attempt = attempt if attempt is not None else record.attempts + 1
        self.hooks = hooks
        self._blocking = blocking
        self._commits = asyncio.Lock()
        """One commit of this turn at a time, made from the runner's state as it is then (calls run in parallel
        each commit their own result)."""
        self.messages: list[Message] = []
        """The transcript as committed: what was read, then each message once its commit returned."""
        self.generation: int | None = None
        """The generation of the session ``messages`` belong to; None until the session was read."""
        self.compacted_at: int | None = None
        """Index of the latest summary in ``messages`` (a context policy's compaction); None: none."""
        self._compacted_on_refusal = False
        self.steps: dict[str, StepRecord] = {}
        self.usage = Usage()
        self.policy: SurfacePolicy | None = None
        self.principal: Principal | None = None
        self.initiator: Principal | None = None
        self.tools: dict[str, Tool] = {}
        self._broker = InputBroker(self.steps)
        self._delegator = (
            Delegator(
                agent=agent,
                store=store,
                launcher=children,
                ref=ref,
                record=record,
                steps=self.steps,
                broker=self._broker,
                crash=crash,
                blocking=blocking,
            )
            if children is not None
            else None
        )
        self._counted = False
        self._counted_by_host = counted
        self.race_stall_s = race_stall_s
        self.raced = False
        """This run lost a race for the turn (another runner committed a step first): its result is the winner's."""
        self._settled: dict[str, tuple[JsonValue, str | None]] = {}
        """Outcomes of async tool calls this run got but may not have committed (a transient fault)."""
        self._at: tuple[str | None, str] = (None, "turn:open")
        """The phase and step in flight, for a failure that escapes it."""

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
            if opening is None:
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

    def _trigger(self) -> Trigger:
        payload = self.record.payload
        if payload.event is not None:
            return InboundTrigger(event=payload.event.without_raw())
        return ProactiveTrigger(by=payload.trigger_by or "system")

    async def _open(self) -> None:
        payload = self.record.payload
        opening: Message
        if payload.trigger_by is not None:
            opening = TriggerMessage(turn_id=self.turn_id, text=payload.text, by=payload.trigger_by)
        else:
            opening = UserMessage(turn_id=self.turn_id, text=payload.text)
        steps: list[StepRecord] = []
        if self.principal is not None and self.initiator is None:
            # The seat goes to the first resolved principal, in the same transaction as the opening.
            steps.append(StepRecord(step_id=INITIATOR_STEP, turn_id=self.turn_id, data=self.principal.model_dump()))
            self.initiator = self.principal
        commit = Commit(
            messages=[(len(self.messages), opening)],
            steps=steps,
            events=[TurnStarted(turn_id=self.turn_id, trigger=self._trigger(), parent=payload.parent)],
            status="running",
            turn_id=self.turn_id,
            turn_status="running",
            count_attempt=not self._counted_by_host,
        )
        await self._commit(commit, "turn:open", cancellable=True)  # a turn cancelled before it opened never opens
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

    def _owed_calls(self) -> tuple[int, list[ToolCall]] | None:
        """The calls of this turn's last assistant message that have no tool result yet."""
        answered: set[str] = set()
        i = len(self.messages) - 1
        while i >= 0:
            m = self.messages[i]
            if isinstance(m, ToolMessage):
                answered.add(m.call_id)
                i -= 1
                continue
            if isinstance(m, AssistantMessage) and m.turn_id == self.turn_id and m.tool_calls:
                owed = [c for c in m.tool_calls if c.id not in answered]
                return (i, owed) if owed else None
            return None
        return None

    def _stored_result(self, n: int, call: ToolCall) -> tuple[JsonValue, str | None] | None:
        """The result a call's own step committed, when its message is not in the transcript yet (a batch
        run in parallel commits each result as it finishes, and the messages in call order)."""
        stored = self.steps.get(f"tool:{n}:{call.id}")
        if stored is None or stored.turn_id != self.turn_id or not isinstance(stored.data, dict):
            return None
        if "result" not in stored.data:
            return None
        error = stored.data.get("error")
        return stored.data["result"], error if isinstance(error, str) else None

    async def _flush_settled(self, n: int) -> bool:
        """Commit the messages of owed calls whose results are stored already, from the first one on; True if any."""
        owed = self._owed_calls()
        if owed is None or self._stored_result(n, owed[1][0]) is None:
            return False
        await self._commit(_Fresh(lambda: Commit(messages=self._ready_messages(n, None))), f"tool:{n}:{owed[1][0].id}")
        return True

    def _ready_messages(
        self, n: int, settling: tuple[ToolCall, JsonValue, str | None] | None
    ) -> list[tuple[int, Message]]:
        """The tool messages that can join the transcript now, in call order: the owed calls from the first
        one on, as long as each has its result (stored, or ``settling``: the one this commit adds)."""
        owed = self._owed_calls()
        if owed is None:
            return []
        out: list[tuple[int, Message]] = []
        at = len(self.messages)
        for call in owed[1]:
            if settling is not None and call.id == settling[0].id:
                result, error = settling[1], settling[2]
            else:
                stored = self._stored_result(n, call)
                if stored is None:
                    break
                result, error = stored
            message = ToolMessage(
                turn_id=self.turn_id, call_id=call.id, name=call.name, result=result, is_error=error is not None
            )
            out.append((at, message))
            at += 1
        return out

    def _check_cancel(self) -> None:
        reason = self.cancel.reason()
        if reason is not None:
            raise _Cancel(reason)

    # --- model step --------------------------------------------------------------------------------

    async def _model_step(self) -> TurnResult | None:
        n = len(self.messages)
        step = f"model:{n}"
        self._at = ("model", step)
        self._check_cancel()
        request = ModelRequest(
            system=self.agent.system_prompt(self.policy),
            messages=request_view(self.messages, self.compacted_at),
            tools=[t.spec for t in self.tools.values()],
            turn_id=self.turn_id,
            step=step,
        )
        try:
            done = await self._stream(request, step)
        except _StepFailure as failure:
            if not isinstance(failure.exc, ContextWindowExceededError):
                raise
            if await self._compact_after_refusal():
                return None  # shorter now: the loop asks again
            raise _StepFailure(
                ContextWindowExceededError(
                    "the request is longer than the model's context window, and compacting the transcript "
                    f"{'did not make it short enough' if self._compacted_on_refusal else 'is not configured'} "
                    f"(agent {self.agent.name}: Agent(context=ContextPolicy(...))); the provider said: {failure.exc}"
                ),
                "model",
                step,
            ) from failure.exc
        # A cancel can land while the stream closes (its cleanup runs in aclose): recheck.
        self._check_cancel()
        reply, finish = _storable_reply(done.reply), done.finish
        if finish is not None and finish.abnormal:
            provider = f" (provider: {finish.raw})" if finish.raw and finish.raw != finish.reason else ""
            stopped = f"model stopped abnormally — {finish.reason}{provider}"
            cut: list[ToolCall] = []
            if reply.tool_calls and finish.reason in CUT_OFF_FINISHES:
                # A call's input may be cut short yet parse (a qty of 1 for 12): only whole calls stay (.cutoff).
                reply, cut = without_cut_calls(reply, done.complete_calls, self.tools)
            names = ", ".join(dict.fromkeys(c.name for c in cut))
            if reply.empty and cut:
                why = f"{stopped} while writing a tool call ({names}); its input was cut off, so nothing was run"
                raise _StepFailure(ModelStepError(why), "model", step)
            if reply.empty:
                raise _StepFailure(ModelStepError(f"{stopped} — and returned an empty reply"), "model", step)
            if cut:
                log.warning(
                    "turn %s at %s: %s; dropped the call(s) it was writing (%s)", self.turn_id, step, stopped, names
                )
        usage = done.usage
        if usage is not None:
            self.usage = self.usage + usage
        message = AssistantMessage(
            turn_id=self.turn_id,
            text=reply.text,
            tool_calls=reply.tool_calls,
            reasoning=reply.reasoning,
            usage=usage,
            window_tokens=done.window_tokens if usage is not None else None,
        )
        events: list[TurnEvent] = []
        if reply.text:
            events.append(MessageCompleted(turn_id=self.turn_id, step=step, text=reply.text))
        batch = self._concurrent_ids(reply.tool_calls)
        limit = self.agent.parallel_tools if batch else None
        for call in reply.tool_calls:
            together, at_once = (batch, limit) if call.id in batch else (None, None)
            step_id = f"tool:{n}:{call.id}"
            events.append(
                ActionRequested(turn_id=self.turn_id, step=step_id, call=call, batch=together, batch_limit=at_once)
            )
        step_rec = StepRecord(step_id=step, turn_id=self.turn_id, data=_model_step_data(finish, usage))
        commit = Commit(messages=[(n, message)], steps=[step_rec], events=events)
        result: TurnResult | None = None
        if not reply.tool_calls:
            result = Completed(turn_id=self.turn_id, text=reply.text, usage=self.usage)
            events.append(TurnCompleted(turn_id=self.turn_id, text=reply.text, usage=self.usage))
            commit.status, commit.turn_id, commit.turn_status, commit.turn_result = (
                "done",
                self.turn_id,
                "completed",
                result,
            )
        self._hit("before-model-commit", step)
        await self._commit(commit, step, cancellable=True)
        self._hit("after-model-commit", step)
        return result

    # --- compaction step (the agent's context policy, see .context) --------------------------------------

    def _summary_index(self, reported: int | None) -> int | None:
        """The store's ``compacted_at``, if it does point at a summary (else the transcript is sent whole)."""
        if reported is None:
            return None
        if 0 <= reported < len(self.messages) and isinstance(self.messages[reported], SummaryMessage):
            return reported
        log.error("session %s: compacted_at=%s is not a summary's index; ignoring it", self.ref, reported)
        return None

    async def _compact_if_due(self) -> bool:
        """Compact first when the request about to be sent is estimated past the policy's share of the window."""
        system = self.agent.system_prompt(self.policy)
        due = compaction_due(self.agent.context, self.agent.model, self.messages, self.compacted_at, system=system)
        return due is not None and await self._compact(due)

    async def _compact_after_refusal(self) -> bool:
        """The model refused the request as too long: compact (once per run) so that the step can ask again."""
        if self.agent.context is None or self._compacted_on_refusal:
            return False
        self._compacted_on_refusal = True
        system = self.agent.system_prompt(self.policy)
        return await self._compact(
            refused_due(self.agent.context, self.agent.model, self.messages, self.compacted_at, system=system)
        )

    async def _compact(self, due: Due) -> bool:
        """The compaction step ``compact:<n>``: the model summarises the transcript before a cut, and the summary
        commits as message ``n`` (checkpointed like a model reply: a replay finds it and never summarises again).
        False when there is nothing to cut: the request goes as it is."""
        policy, n = due.policy, len(self.messages)
        step = f"compact:{n}"
        keep = max(int(policy.keep * due.window), 1)
        plan = plan_compaction(
            self.messages, self.compacted_at, keep_tokens=keep, chars_per_token=policy.chars_per_token
        )
        if plan is None:
            log.warning("turn %s of %s: ~%d tokens, and nothing to compact", self.turn_id, self.ref, due.tokens)
            return False
        with self.hooks.step("compact", step):
            await self._summarise(due, plan, step, n)
        return True

    async def _summarise(self, due: Due, plan: Compaction, step: str, n: int) -> None:
        """The compaction step's model call, and the commit of its summary as message ``n``."""
        policy = due.policy
        self._at = ("model", step)
        self._check_cancel()
        # What it is sent stays clear of the window with room for its instructions and its answer.
        room = int((1 - policy.keep) * due.window * policy.chars_per_token) - len(policy.instructions)
        text = plan.request_text(message_chars=policy.message_chars, max_chars=room)
        request = ModelRequest(
            system=policy.instructions,
            messages=[UserMessage(turn_id=self.turn_id, text=text)],
            turn_id=self.turn_id,
            step=step,
        )
        try:
            done = await self._stream(request, step, model=policy.model, live=False)  # a summary is no reply: no deltas
        except _StepFailure as refused:
            if isinstance(refused.exc, ContextWindowExceededError):
                why = f"the compaction step's own request was too long for the model: {refused.exc}"
                raise _StepFailure(ContextWindowExceededError(why), "model", step) from refused.exc
            raise
        self._check_cancel()
        reply, finish = _storable_reply(done.reply), done.finish
        if not reply.text.strip() or (finish is not None and finish.reason in ("refusal", "content_filter")):
            stopped = f" (it stopped: {finish.reason})" if finish is not None else ""
            failure = ModelStepError(f"the model wrote no usable summary when compacting the transcript{stopped}")
            raise _StepFailure(failure, "model", step)
        if done.usage is not None:
            self.usage = self.usage + done.usage
        summary = SummaryMessage(turn_id=self.turn_id, text=reply.text.strip(), kept_from=plan.kept_from)
        event = ContextCompacted(
            turn_id=self.turn_id,
            step=step,
            at=n,
            kept_from=plan.kept_from,
            summarized=len(plan.older),
            tokens_before=due.tokens,
            reason=due.reason,
        )
        data = {**_model_step_data(finish, done.usage), "kept_from": plan.kept_from, "tokens_before": due.tokens}
        record = StepRecord(step_id=step, turn_id=self.turn_id, data=data)
        self._hit("before-compact-commit", step)
        await self._commit(Commit(messages=[(n, summary)], steps=[record], events=[event]), step, cancellable=True)
        self._hit("after-compact-commit", step)
        log.info(
            "turn %s of %s: compacted ~%d tokens (%s): messages before %d summarised as message %d",
            self.turn_id,
            self.ref,
            due.tokens,
            due.reason,
            plan.kept_from,
            n,
        )

    # --- reading a model's stream ------------------------------------------------------------------

    async def _stream(self, request: ModelRequest, step: str, *, model: Model | None = None, live: bool = True) -> Done:
        """Read the model's stream; a cancel that arrives while we wait on it interrupts the wait.

        ``model``: another model than the agent's; ``live=False``: its deltas are not published."""
        task = asyncio.current_task()
        assert task is not None
        interrupted = False

        def interrupt() -> None:
            nonlocal interrupted
            if asyncio.current_task() is task:
                return  # raised from inside this turn: the next boundary check sees it
            interrupted = True
            task.cancel()

        self.cancel.on_cancel(interrupt)
        try:
            done = await self._consume(request, step, model or self.agent.model, live)
            if interrupted:
                await asyncio.sleep(0)  # a cancellation still pending on the task is delivered here
            return done
        except asyncio.CancelledError:
            if not interrupted:
                raise
            task.uncancel()
            raise _Cancel(self.cancel.reason() or "requested") from None
        finally:
            self.cancel.on_cancel(None)

    async def _consume(self, request: ModelRequest, step: str, model: Model, live: bool) -> Done:
        try:
            stream = model.stream(request)
        except Exception as exc:
            raise self._model_failure(exc, step) from exc
        done: Done | None = None
        # deltas are scrubbed as they stream: a secret split over two of them is held back until it is whole
        said, thought = StreamScrubber(), StreamScrubber()

        def publish(kind: type[MessageDelta] | type[ReasoningDelta], text: str) -> None:
            if text:
                self.sink.publish_delta(
                    self.ref, kind(turn_id=self.turn_id, step=step, text=text, attempt=self.attempt)
                )

        try:
            async for delta in stream:
                self._check_cancel()
                if not live and not isinstance(delta, Done):
                    continue
                if isinstance(delta, TextChunk):
                    if delta.text:
                        publish(MessageDelta, said.feed(storable_text(delta.text)))
                elif isinstance(delta, ReasoningChunk):
                    if delta.text:
                        publish(ReasoningDelta, thought.feed(storable_text(delta.text)))
                elif isinstance(delta, Done):
                    publish(ReasoningDelta, thought.flush())
                    publish(MessageDelta, said.flush())
                    done = delta
                    break
                else:
                    raise ModelStreamError(f"model yielded {type(delta).__name__}, not a model delta")
        except (_Cancel, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise self._model_failure(exc, step) from exc
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                # Whatever the stream does after its final reply is ignored, errors included.
                with contextlib.suppress(Exception):
                    await aclose()
        if done is None:
            raise _StepFailure(ModelStreamError("model stream ended without a final reply"), "model", step)
        return done

    @staticmethod
    def _model_failure(exc: Exception, step: str) -> Exception:
        """What a model error becomes: itself when transient (the step runs again), else the step's failure."""
        if classify(exc, phase="model") is Failure.TRANSIENT:
            return exc
        return _StepFailure(exc, "model", step)

    # --- tool step ---------------------------------------------------------------------------------

    def _concurrent_ids(self, calls: list[ToolCall]) -> list[str]:
        """The ids of the calls that run concurrently (async, with ``parallel_tools`` > 1); empty when none do."""
        if self.agent.parallel_tools <= 1:
            return []
        ids = [c.id for c in calls if (t := self.tools.get(c.name)) is not None and t.is_async]
        return ids if len(ids) > 1 else []

    async def _tool_batch(self, n: int, calls: list[ToolCall]) -> list[_Park]:
        """Run the calls a reply still owes a result: in turn, or (``Agent.parallel_tools`` > 1) the async ones
        concurrently. Each commits its own result as it finishes. Returns the parks, in call order: in turn,
        the first one stops the batch; in parallel, every call that asked for input parks the turn with it."""
        runnable = [c for c in calls if self._stored_result(n, c) is None]
        together = set(self._concurrent_ids(runnable))
        concurrent = [c for c in runnable if c.id in together]
        if not concurrent:
            for call in runnable:
                parked = await self._call_in_turn(n, call)
                if parked is not None:
                    return [parked]
            return []
        gate = asyncio.Semaphore(self.agent.parallel_tools)

        async def one(call: ToolCall) -> _Park | None:
            async with gate:
                if self.cancel.reason() is not None:
                    return None  # not started: the loop ends the turn cancelled
                return await self._hooked_step(n, call)

        tasks = {c.id: asyncio.ensure_future(one(c)) for c in concurrent}
        parks: dict[str, _Park] = {}
        failed: str | None = None  # the step of the call whose exception leaves the batch
        try:
            # The sync calls (and unknown tools) in turn, each once the async ones had a chance to run: an async
            # call starts and runs to its first wait before the next sync call holds the loop with its transaction.
            for call in runnable:
                if call.id in tasks:
                    continue
                await asyncio.sleep(0)
                failed = f"tool:{n}:{call.id}"
                parked = await self._call_in_turn(n, call)
                failed = None
                if parked is not None:  # a sync tool cannot park; kept for symmetry with the serial path
                    parks[call.id] = parked
            await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
            for call_id, t in tasks.items():  # the first failure, in call order
                if t.done() and not t.cancelled() and (failure := t.exception()) is not None:
                    failed = f"tool:{n}:{call_id}"
                    raise failure
            parks.update((call_id, found) for call_id, t in tasks.items() if (found := t.result()) is not None)
        finally:
            pending = [t for t in tasks.values() if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
            if failed is not None:
                # ``_at`` is shared by the calls running together: name the one that failed, not the last to start
                self._at = ("tool", failed)
        return [parks[c.id] for c in runnable if c.id in parks]

    async def _call_in_turn(self, n: int, call: ToolCall) -> _Park | None:
        """One call run in turn: never started once a cancel came (the turn ends cancelled)."""
        self._check_cancel()
        return await self._hooked_step(n, call)

    async def _hooked_step(self, n: int, call: ToolCall) -> _Park | None:
        with self.hooks.step("tool", f"tool:{n}:{call.id}", call.name):
            return await self._tool_step(n, call)

    async def _tool_step(self, n: int, call: ToolCall) -> _Park | None:
        step = f"tool:{n}:{call.id}"
        self._at = ("tool", step)
        tool = self.tools.get(call.name)
        if tool is None:
            await self._commit_tool_result(
                step, call, {"error": f"unknown tool {call.name}"}, error=f"unknown tool {call.name}"
            )
            return None
        try:
            validated = tool.validate(call.input)
        except ToolInputError as exc:
            # the model's own input can be quoted back (a validator's message): scrubbed like any tool error
            message = scrub(str(exc))
            await self._commit_tool_result(step, call, {"error": message}, error=message)
            return None
        if tool.is_async:
            return await self._async_tool_step(tool, step, call, validated)
        await self._sync_tool_step(tool, step, call, validated)
        return None

    def _context(self, call: ToolCall, step: str, *, store: StoreHandle | None, is_sync: bool) -> ToolContext:
        ctx = ToolContext(
            turn_id=self.turn_id,
            session=self.ref,
            call=call,
            step=step,
            principal=self.principal,
            initiator=self.initiator,
            event=self.record.payload.event,
            runtime=self.runtime,
            is_sync=is_sync,
            _broker=self._broker,
            _delegator=self._delegator,
        )
        if store is not None:
            ctx.store = store
        return ctx

    async def _sync_tool_step(self, tool: Tool, step: str, call: ToolCall, validated: Any) -> None:
        def build(handle: StoreHandle) -> Commit:
            ctx = self._context(call, step, store=handle, is_sync=True)
            try:
                out = tool.invoke(ctx, validated)
                if inspect.isawaitable(out):
                    if inspect.iscoroutine(out):
                        out.close()
                    raise SyncToolReturnedAwaitableError(
                        f"tool {tool.name!r} is declared with def but returned an awaitable; declare it "
                        "'async def' so it is awaited (at-least-once) instead of committing a lost result"
                    )
                result = _to_json(out)
            except (FatalToolError, ParkSignal, SyncParkError):
                raise
            except Exception as exc:
                raise _ToolRaised(exc) from exc
            self._hit("before-tool-commit", step)
            return self._tool_commit(step, call, result, error=None)

        try:
            await self._commit(build, step)
        except _ToolRaised as raised:
            # The store rolled back whatever the tool wrote; the error becomes the call's result,
            # unless it is the store's own (the step's transaction lost its connection): run it again.
            if classify(raised.exc, phase="tool") is Failure.TRANSIENT:
                raise raised.exc from None
            message = format_tool_error(raised.exc)
            await self._commit_tool_result(step, call, {"error": message}, error=message)
            return
        except (FatalToolError, SyncParkError) as exc:
            raise _StepFailure(exc, "tool", step) from exc
        except ParkSignal as exc:  # cannot happen through request_input; a hand-raised signal
            raise _StepFailure(
                SyncParkError(f"tool {tool.name!r} runs sync; only an async tool can park"), "tool", step
            ) from exc
        self._hit("after-tool-commit", step)

    async def _async_tool_step(self, tool: Tool, step: str, call: ToolCall, validated: Any) -> _Park | None:
        settled = self._settled.get(step)
        if settled is None:
            ctx = self._context(call, step, store=None, is_sync=False)
            try:
                out = await tool.invoke(ctx, validated)
                settled = (_to_json(out), None)
            except ParkSignal as park:
                return _Park(request=park.request, step=step, call=call)
            except FatalToolError as exc:
                raise _StepFailure(exc, "tool", step) from exc
            except SyncParkError as exc:
                raise _StepFailure(exc, "tool", step) from exc
            except Exception as exc:
                if classify(exc, phase="tool") is Failure.TRANSIENT:
                    raise
                message = format_tool_error(exc)
                settled = ({"error": message}, message)
            # Kept for this run: if the commit below meets a transient fault, the retry commits this outcome
            # instead of calling the tool again (its side effects happened; only a new process re-runs it).
            self._settled[step] = settled
        result, error = settled
        await self._commit_tool_result(step, call, result, error=error)
        return None

    def _tool_commit(self, step: str, call: ToolCall, result: JsonValue, *, error: str | None) -> Commit:
        n = int(step.split(":", 2)[1])
        child = self._delegator.started.get(call.id) if self._delegator is not None else None
        completed = ActionCompleted(
            turn_id=self.turn_id,
            step=step,
            call=call,
            result=result,
            error=error,
            child_agent=child[0].agent if child is not None else None,
            child_session=child[0].session if child is not None else None,
            child_turn_id=child[1] if child is not None else None,
        )
        return Commit(
            messages=self._ready_messages(n, (call, result, error)),
            steps=[StepRecord(step_id=step, turn_id=self.turn_id, data={"result": result, "error": error})],
            events=[completed],
        )

    async def _commit_tool_result(self, step: str, call: ToolCall, result: JsonValue, *, error: str | None) -> None:
        self._hit("before-tool-commit", step)
        await self._commit(_Fresh(lambda: self._tool_commit(step, call, result, error=error)), step)
        self._hit("after-tool-commit", step)

    # --- endings -----------------------------------------------------------------------------------

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

    # --- plumbing ------------------------------------------------------------------------------------

    async def _commit(
        self, commit: Commit | CommitBuilder | _Fresh, step: str | None = None, *, cancellable: bool = False
    ) -> None:
        """Write one checkpoint and publish its events (never before it), then mirror it in memory.

        ``cancellable`` (the opening, a model reply, a park): the commit applies only if no cancel is
        stored for the turn, else the turn is cancelled here. The store is the record of a cancel;
        its signal only makes a waiting step stop sooner, so a lost signal never lets a cancelled
        turn open, take another model reply or park. A tool's result is not guarded: a tool that
        ran keeps its result (what committed stays committed; the cancel takes effect between calls).

        Commits of one turn run one at a time (calls running in parallel each commit their result); a
        :class:`_Fresh` commit is made once the ones before it are mirrored. Where the store call may wait
        (:mod:`.blocking`), a cancel of the waiting task is delivered once the commit is mirrored.
        """
        async with self._commits:
            if self._blocking is inline:  # nothing suspends in between: the plain call, no task for it
                await self._commit_now(commit, step, cancellable)
            else:
                await finish(self._commit_now(commit, step, cancellable))

    async def _commit_now(self, commit: Commit | CommitBuilder | _Fresh, step: str | None, cancellable: bool) -> None:
        built: Commit | None = None

        def guarded(c: Commit) -> Commit:
            if cancellable:
                c.turn_id, c.expect_not_cancelled = self.turn_id, True
            return c

        if isinstance(commit, _Fresh):
            commit = commit.make()

        def commit_then_publish(what: Commit | CommitBuilder) -> None:
            # One blocking call for both: the publish follows its commit at once, in the same place, never before it
            events = self.store.commit(self.ref, what, fence=self.fence)
            if step is not None:
                self._hit("before-publish", step)
            if events:
                self.sink.publish(self.ref, events)

        try:
            if isinstance(commit, Commit):
                ready = built = guarded(commit)
                await self._blocking(lambda: commit_then_publish(ready))
            else:
                builder = commit

                def capture(handle: StoreHandle) -> Commit:
                    nonlocal built
                    built = guarded(builder(handle))
                    return built

                await self._blocking(lambda: commit_then_publish(capture))
        except CancelRequestedError as exc:
            raise _Cancel(exc.reason) from None
        assert built is not None
        self.hooks.committed(built)
        for index, message in built.messages:
            self.messages.append(message)
            if isinstance(message, SummaryMessage):
                self.compacted_at = index
        for s in built.steps:
            self.steps[s.step_id] = s

    def _hit(self, point: str, step: str) -> None:
        if self._crash is not None:
            self._crash(point, step)


def _model_step_data(finish: Finish | None, usage: Usage | None) -> dict[str, JsonValue]:
    data: dict[str, JsonValue] = {}
    if finish is not None:
        data["finish"] = finish.model_dump()
    if usage is not None:
        data["usage"] = usage.model_dump()
    return data
