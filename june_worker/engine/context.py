"""The context policy: every model request of a session stays inside the model's context window.

A session that lives for months (a Slack thread, a support case) outgrows any context window. Before
each model step the turn runner estimates the request it is about to send: the tokens the last model
call reported (``usage`` on its :class:`~.types.AssistantMessage`: what the request took in, plus the
reply now in the transcript) and the characters of what was added since. Past ``compact_at`` of the
window, the turn first runs a **compaction step** (``compact:<n>``, checkpointed like a model step):
the model summarises the older part of the transcript, and the summary, a :class:`~.types.SummaryMessage`
appended to the transcript, stands in for it in every later request (:func:`request_view`). The
replaced messages stay in the store as they were; the summary says where the kept part starts. A
request the model still refuses as too long makes the runner compact once more, then fail the turn.

What is kept verbatim is the most recent part, about ``keep`` of the window, cut where a message that
is not a tool result begins: thinking blocks stay with their message, which the API wants back as it
sent it, and what the summary replaces loses its thinking (the API ignores that of earlier turns).

The rule a reader must not break: **a cut never separates a tool call from its result**: the kept part
starts at a message that is not a tool result, so every call before the cut has its results before it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import AgentDefinitionError
from .model import Model
from .types import AssistantMessage, Message, SummaryMessage, ToolMessage, TriggerMessage, UserMessage

__all__ = [
    "DEFAULT_SUMMARY_INSTRUCTIONS",
    "Compaction",
    "ContextPolicy",
    "Due",
    "compaction_due",
    "estimate_tokens",
    "plan_compaction",
    "refused_due",
    "request_view",
]

DEFAULT_SUMMARY_INSTRUCTIONS = (
    "You compact the history of a conversation between a user and an AI assistant that uses tools, so that "
    "the conversation can go on within a limited context window. The assistant will read your summary instead "
    "of the messages it replaces. Keep everything it may need later: who the user is and what they want, every "
    "request and decision, facts learned (names, ids, amounts, dates, results of tool calls, errors), what was "
    "done, what was promised and what is still open. Leave out pleasantries and repetition. Write compact notes "
    "in the conversation's language, not a reply to the user, and do not call any tool."
)
"""The system prompt of a compaction step, unless the policy gives its own."""

_PER_MESSAGE_CHARS = 12
"""Characters counted for a message's own framing (role, ids), whatever its content."""


@dataclass(frozen=True)
class ContextPolicy:
    """How an agent keeps its requests inside its model's context window (``Agent(context=...)``).

    ``window_tokens``: the model's context window; by default the model's own ``context_window_tokens``
    (``AnthropicModel`` has one), and without either the policy does nothing (a scripted model). A turn
    compacts before a request estimated past ``compact_at`` of the window, keeping the most recent
    ``keep`` of it verbatim. ``instructions``: the compaction step's system prompt; ``model``: who writes
    the summary (default: the agent's model). ``chars_per_token`` converts what no usage report counted
    (low: an estimate errs on the side of compacting early); ``message_chars`` cuts each message of the
    part being summarised, in the summariser's request, to that many characters.
    """

    window_tokens: int | None = None
    compact_at: float = 0.8
    keep: float = 0.25
    instructions: str = DEFAULT_SUMMARY_INSTRUCTIONS
    model: Model | None = None
    chars_per_token: float = 3.0
    message_chars: int = 8_000

    def __post_init__(self) -> None:
        if self.window_tokens is not None and self.window_tokens < 1:
            raise AgentDefinitionError(f"context window_tokens must be positive, got {self.window_tokens}")
        if not 0 < self.keep < self.compact_at <= 1:
            raise AgentDefinitionError(
                f"context policy needs 0 < keep < compact_at <= 1 (shares of the window), got keep={self.keep} "
                f"and compact_at={self.compact_at}"
            )
        if self.chars_per_token <= 0 or self.message_chars < 100:
            raise AgentDefinitionError("context policy: chars_per_token must be positive and message_chars >= 100")

    def window(self, model: Any) -> int | None:
        """The window in tokens: the policy's, else the model's ``context_window_tokens``, else None."""
        if self.window_tokens is not None:
            return self.window_tokens
        found = getattr(model, "context_window_tokens", None)
        return found if isinstance(found, int) and found > 0 else None


@dataclass(frozen=True)
class Compaction:
    """What a compaction step summarises: ``older`` (with the ``previous`` summary), keeping from ``kept_from``."""

    kept_from: int
    previous: SummaryMessage | None
    older: Sequence[Message]

    def request_text(self, *, message_chars: int, max_chars: int) -> str:
        """The summariser's user message: the previous summary and the older messages as plain text, in at most
        about ``max_chars`` characters (the oldest messages are left out first, then each is cut shorter)."""
        budget = max(max_chars - (len(self.previous.text) if self.previous else 0), 200)
        lines = [_line(m, min(message_chars, budget)) for m in self.older]
        left_out = 0
        while len(lines) > 1 and sum(len(x) + 2 for x in lines) > budget:
            lines.pop(0)  # too much for one request: the oldest go unsummarised rather than fail the step
            left_out += 1
        parts = ["Summarise this conversation so far, as your instructions say.", "<conversation>"]
        if self.previous is not None:
            parts.append(f"Summary of what came before:\n{self.previous.text}")
        if left_out:
            parts.append(f"[{left_out} older messages left out: too long to summarise in one request]")
        parts += [*lines, "</conversation>"]
        return "\n\n".join(parts)


@dataclass(frozen=True)
class Due:
    """A compaction to run: ``tokens`` estimated for the request, ``window`` the window to keep a share of."""

    policy: ContextPolicy
    window: int
    tokens: int
    reason: Literal["threshold", "refused"]


def compaction_due(
    policy: ContextPolicy | None, model: Any, messages: Sequence[Message], compacted_at: int | None, *, system: str
) -> Due | None:
    """The compaction due before the next request, if its estimate passes ``compact_at`` of the window.

    Never right after a compaction (the request it shortened has not been sent yet), nor without a window.
    """
    if policy is None or not messages or isinstance(messages[-1], SummaryMessage):
        return None
    window = policy.window(model)
    if window is None:
        return None
    tokens = estimate_tokens(messages, compacted_at, system=system, chars_per_token=policy.chars_per_token)
    return Due(policy, window, tokens, "threshold") if tokens > policy.compact_at * window else None


def refused_due(
    policy: ContextPolicy, model: Any, messages: Sequence[Message], compacted_at: int | None, *, system: str
) -> Due:
    """The compaction to run after the model refused a request as too long. Without a known window, the share
    kept is of the refused request's estimate (it was too low, or the request would not have gone out)."""
    tokens = estimate_tokens(messages, compacted_at, system=system, chars_per_token=policy.chars_per_token)
    return Due(policy, policy.window(model) or tokens, tokens, "refused")


def request_view(messages: Sequence[Message], compacted_at: int | None) -> list[Message]:
    """What a model request carries: the latest summary and the messages it keeps, or the whole transcript."""
    if compacted_at is None:
        return messages if isinstance(messages, list) else list(messages)
    summary = messages[compacted_at]
    assert isinstance(summary, SummaryMessage)
    return [summary, *(m for m in messages[summary.kept_from :] if not isinstance(m, SummaryMessage))]


def estimate_tokens(
    messages: Sequence[Message], compacted_at: int | None, *, system: str, chars_per_token: float
) -> int:
    """The tokens the next request would take: the last call's report plus what came since, else a count.

    Only a call made after the latest compaction counts: an older one reported the transcript it replaced.
    A reply made of several requests says how full the window is apart from its summed usage
    (``window_tokens``): the sum counts the transcript once per request.
    """
    start = compacted_at + 1 if compacted_at is not None else 0
    for i in range(len(messages) - 1, start - 1, -1):
        m = messages[i]
        if isinstance(m, AssistantMessage) and m.usage is not None:
            since = sum(_chars(x) for x in messages[i + 1 :])
            filled = m.window_tokens if m.window_tokens is not None else m.usage.context_tokens + m.usage.output_tokens
            return filled + math.ceil(since / chars_per_token)
    counted = len(system) + sum(_chars(x) for x in request_view(messages, compacted_at))
    return math.ceil(counted / chars_per_token)


def plan_compaction(
    messages: Sequence[Message], compacted_at: int | None, *, keep_tokens: int, chars_per_token: float
) -> Compaction | None:
    """Where to cut so that about ``keep_tokens`` of the most recent messages stay; None if nothing can be cut.

    The cut is the earliest index after the previous one whose messages from there on fit ``keep_tokens``
    and start with a message that is not a tool result; when even the last such index keeps more, that
    one (the least that can be kept).
    """
    previous = messages[compacted_at] if compacted_at is not None else None
    assert previous is None or isinstance(previous, SummaryMessage)
    lo = previous.kept_from if previous is not None else 0
    budget = keep_tokens * chars_per_token
    kept, best, latest = 0, None, None
    for i in range(len(messages) - 1, lo, -1):
        m = messages[i]
        if isinstance(m, SummaryMessage):
            continue
        kept += _chars(m)
        if isinstance(m, ToolMessage):
            continue  # a cut here would leave this result without its call
        latest = latest if latest is not None else i
        if kept > budget:
            break
        best = i
    cut = best if best is not None else latest
    if cut is None:
        return None
    older = [m for m in messages[lo:cut] if not isinstance(m, SummaryMessage)]
    if not older:
        return None
    return Compaction(kept_from=cut, previous=previous, older=older)


def _chars(m: Message) -> int:
    """About how much of a request a message is, in characters."""
    if isinstance(m, AssistantMessage):
        calls = sum(len(c.name) + len(_json(c.input)) for c in m.tool_calls)
        thinking = sum(len(r.text) + len(r.signature or "") + len(r.redacted or "") for r in m.reasoning)
        return _PER_MESSAGE_CHARS + len(m.text) + calls + thinking
    if isinstance(m, ToolMessage):
        return _PER_MESSAGE_CHARS + len(m.call_id) + len(_json(m.result))
    return _PER_MESSAGE_CHARS + len(m.text)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]} [... {len(text) - limit} more characters cut]"


def _line(m: Message, limit: int) -> str:
    if isinstance(m, UserMessage):
        return f"User: {_clip(m.text, limit)}"
    if isinstance(m, TriggerMessage):
        return f"Automated message from {m.by}: {_clip(m.text, limit)}"
    if isinstance(m, AssistantMessage):
        said = [f"Assistant: {_clip(m.text, limit)}"] if m.text.strip() else []
        said += [f"Assistant called {c.name} with {_clip(_json(c.input), limit)}" for c in m.tool_calls]
        return "\n".join(said) or "Assistant: (no text)"
    if isinstance(m, ToolMessage):
        failed = " (an error)" if m.is_error else ""
        return f"Result of {m.name}{failed}: {_clip(_json(m.result), limit)}"
    return f"Summary: {_clip(m.text, limit)}"
