"""ScriptedModel: a deterministic model for tests and the demo. No network, no key.

The reply for a call is chosen from the transcript it is given, never from how often it
was called, so a replayed turn gets the same reply it got the first time: by default the
``n``-th entry of the script answers a transcript holding ``n`` assistant messages (the last
entry repeats). Pass a function instead of a list to decide from the request yourself.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.model import Done, ModelDelta, ModelRequest, ReasoningChunk, TextChunk
from ..engine.types import AssistantMessage, Finish, ModelReply, ReasoningBlock, ToolCall, Usage

__all__ = ["Reply", "ScriptedModel"]


@dataclass(frozen=True)
class Reply:
    """One scripted model reply. ``cut``: ids of its calls to report as cut short (not written whole), as a
    provider does for the call it was writing when the reply hit ``max_tokens``; every other call is whole."""

    text: str = ""
    calls: Sequence[ToolCall | dict[str, Any]] = ()
    cut: Sequence[str] = ()
    finish: Finish | str | None = None
    reasoning: str | None = None
    usage: Usage | None = None

    def to_reply(self) -> ModelReply:
        calls = [c if isinstance(c, ToolCall) else ToolCall.model_validate(c) for c in self.calls]
        reasoning = [ReasoningBlock(text=self.reasoning)] if self.reasoning else []
        return ModelReply(text=self.text, tool_calls=calls, reasoning=reasoning)

    def to_finish(self) -> Finish | None:
        if isinstance(self.finish, str):
            return Finish(reason=self.finish, raw=self.finish)
        if self.finish is None:
            return Finish(reason="tool_calls" if self.calls else "stop", raw=None)
        return self.finish


ScriptEntry = Reply | str
Script = Sequence[ScriptEntry] | Callable[[ModelRequest], ScriptEntry]

_WORDS = re.compile(r"\S+\s*|\s+")


@dataclass
class ScriptedModel:
    """Replies from a script. ``delay_s`` paces the text deltas (one per word) like a real stream.

    ``context_window_tokens``: the window an agent's context policy assumes (none by default: never compacted).
    After a compaction a request holds fewer assistant messages (the summary stands in for the older ones),
    which is what a list script counts.
    """

    script: Script
    delay_s: float = 0.0
    record: bool = False
    context_window_tokens: int | None = None
    calls: int = field(default=0, init=False)
    requests: list[ModelRequest] = field(default_factory=list, init=False)

    def choose(self, request: ModelRequest) -> Reply:
        if callable(self.script):
            entry = self.script(request)
        else:
            if not self.script:
                raise ValueError("ScriptedModel needs at least one reply")
            count = sum(1 for m in request.messages if isinstance(m, AssistantMessage))
            entry = self.script[min(count, len(self.script) - 1)]
        return Reply(text=entry) if isinstance(entry, str) else entry

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        self.calls += 1
        if self.record:
            self.requests.append(
                ModelRequest(
                    system=request.system,
                    messages=list(request.messages),
                    tools=list(request.tools),
                    turn_id=request.turn_id,
                    step=request.step,
                )
            )
        reply = self.choose(request)
        if reply.reasoning:
            yield ReasoningChunk(text=reply.reasoning)
        if self.delay_s:
            for word in _WORDS.findall(reply.text):
                await asyncio.sleep(self.delay_s)
                yield TextChunk(text=word)
        elif reply.text:
            yield TextChunk(text=reply.text)
        message = reply.to_reply()
        whole = [c.id for c in message.tool_calls if c.id not in reply.cut]
        yield Done(reply=message, finish=reply.to_finish(), usage=reply.usage, complete_calls=whole)
