"""The turn runner's model steps: ``model:<n>`` (ask the model, commit its reply and the calls it asks for),
the compaction step ``compact:<n>`` (the agent's context policy, :mod:`.context`), and reading a model's stream
(deltas published as they come, scrubbed; a cancel interrupts the wait). Mixed into :class:`.loop.TurnRunner`.
"""

from __future__ import annotations

import asyncio
import contextlib

from june_wire.storable import storable_text

from ..errors import (
    ContextWindowExceededError,
    ModelStepError,
    ModelStreamError,
)
from ._runner_base import (
    RunnerBase,
    _Cancel,
    _model_step_data,
    _StepFailure,
    _storable_reply,
    log,
)
from .context import Compaction, Due, compaction_due, plan_compaction, refused_due, request_view
from .cutoff import CUT_OFF_FINISHES, without_cut_calls
from .events import (
    ActionRequested,
    Completed,
    ContextCompacted,
    MessageCompleted,
    MessageDelta,
    ReasoningDelta,
    TurnCompleted,
    TurnEvent,
    TurnResult,
)
from .failures import Failure, classify
from .model import Done, Model, ModelRequest, ReasoningChunk, TextChunk
from .secrets import StreamScrubber
from .store import (
    Commit,
    StepRecord,
)
from .types import (
    AssistantMessage,
    SummaryMessage,
    ToolCall,
    UserMessage,
)

__all__ = ["ModelSteps"]


class ModelSteps(RunnerBase):
    """The model and compaction steps of :class:`.loop.TurnRunner`."""

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
