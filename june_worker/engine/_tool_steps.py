"""The turn runner's tool steps ``tool:<n>:<call id>``: a reply's calls run in turn or (``parallel_tools``)
concurrently, a sync tool inside its step's commit (its writes roll back with a failure), an async tool before
it (its outcome kept for the run, so a retried commit never calls it again), each result committed on its own.
Mixed into :class:`.loop.TurnRunner`.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from ..errors import (
    FatalToolError,
)
from ._runner_base import (
    RunnerBase,
    _Fresh,
    _Park,
    _StepFailure,
    _to_json,
    _ToolRaised,
)
from .events import (
    ActionCompleted,
)
from .failures import Failure, classify
from .secrets import scrub
from .signals import ParkSignal, SyncParkError
from .store import (
    Commit,
    StepRecord,
    StoreHandle,
)
from .tools import (
    SyncToolReturnedAwaitableError,
    Tool,
    ToolContext,
    ToolInputError,
    format_tool_error,
)
from .types import (
    JsonValue,
    ToolCall,
)

__all__ = ["ToolSteps"]


class ToolSteps(RunnerBase):
    """The tool steps of :class:`.loop.TurnRunner`."""

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
