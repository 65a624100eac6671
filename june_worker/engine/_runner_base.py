"""What every part of the turn runner shares: its state, where the turn stands, and the commit.

Owns :class:`RunnerBase` (the runner's state as ``TurnRunner`` is given it; reading the calls still owed a
result off the transcript; the cancel check; :meth:`RunnerBase._commit`, which writes one checkpoint, publishes
its events after it and mirrors it in memory) and the signals the steps raise to the loop (``_Cancel``,
``_StepFailure``, ``_ToolRaised``). The steps themselves are :mod:`._model_steps` and :mod:`._tool_steps`;
:mod:`.loop` runs them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from june_wire.storable import json_text, storable_json, storable_json_text

from ..errors import (
    CancelRequestedError,
)
from .agent import Agent
from .blocking import Blocking, finish, inline
from .cancel import NO_CANCEL, CancelProbe
from .children import ChildLauncher, Delegator
from .crash import CrashHook
from .failures import DEFAULT_MAX_ATTEMPTS, RACE_STALL_S, STEP_RETRIES
from .hooks import NO_HOOKS, TurnHooks
from .inputs import InputBroker
from .secrets import scrub, scrub_json, scrubbed_logger, secret_free_json_text
from .sink import EventSink
from .store import (
    Commit,
    CommitBuilder,
    SessionRef,
    SessionSnapshot,
    SessionStore,
    StepRecord,
    StoreHandle,
    SurfacePolicy,
    TurnRecord,
)
from .tools import (
    Tool,
)
from .types import (
    AssistantMessage,
    Finish,
    InputRequest,
    JsonValue,
    Message,
    ModelReply,
    Principal,
    SummaryMessage,
    ToolCall,
    ToolMessage,
    Usage,
)

__all__ = ["RunnerBase"]

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
    # one text for the three checks: JSON at all (raises), storable, and without a secret (the common case)
    text = json_text(value)
    if storable_json_text(text) and secret_free_json_text(text):
        return value
    return scrub_json(storable_json(value))


def _storable_reply(reply: ModelReply) -> ModelReply:
    """The model's reply with every string storable (text, tool calls, reasoning) and no secret in its text or its
    calls' input; usually the reply itself. Its reasoning and a call's provider_state are left as they came: a
    provider signs them, and takes them back only unchanged (the published reasoning deltas are scrubbed)."""
    try:  # the common case, judged from one text: nothing in the whole reply to replace
        text = reply.model_dump_json(by_alias=True)
    except ValueError:  # (a lone surrogate: pydantic's JSON refuses it)
        pass
    else:
        if storable_json_text(text) and secret_free_json_text(text):
            return reply
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


def _model_step_data(finish: Finish | None, usage: Usage | None) -> dict[str, JsonValue]:
    data: dict[str, JsonValue] = {}
    if finish is not None:
        data["finish"] = finish.model_dump()
    if usage is not None:
        data["usage"] = usage.model_dump()
    return data


class RunnerBase:
    """A turn runner's state and plumbing; see :class:`.loop.TurnRunner` for its arguments and rules."""

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
        opened: Commit | None = None,
        race_stall_s: float = RACE_STALL_S,
        blocking: Blocking = inline,
        statements: Blocking | None = None,
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
        self._statements = statements if statements is not None else blocking
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
        self._opened = opened
        self.race_stall_s = race_stall_s
        self.raced = False
        """This run lost a race for the turn (another runner committed a step first): its result is the winner's."""
        self._settled: dict[str, tuple[JsonValue, str | None]] = {}
        """Outcomes of async tool calls this run got but may not have committed (a transient fault)."""
        self._at: tuple[str | None, str] = (None, "turn:open")
        """The phase and step in flight, for a failure that escapes it."""

    # --- where the turn stands -------------------------------------------------------------------

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

    def _concurrent_ids(self, calls: list[ToolCall]) -> list[str]:
        """The ids of the calls that run concurrently (async, with ``parallel_tools`` > 1); empty when none do."""
        if self.agent.parallel_tools <= 1:
            return []
        ids = [c.id for c in calls if (t := self.tools.get(c.name)) is not None and t.is_async]
        return ids if len(ids) > 1 else []

    # --- plumbing --------------------------------------------------------------------------------

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
            if self._blocking is inline and self._statements is inline:  # nothing suspends: the plain call, no task
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
                await self._statements(lambda: commit_then_publish(ready))  # one statement, no tool code in it
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
        self._took_in(built)

    def _took_in(self, built: Commit) -> None:
        """A commit the store accepted: shown to the hooks, and mirrored in the runner's transcript and steps."""
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
