"""What a turn looks like to a person: its TurnEvents folded into one view per run, for every channel.

A turn runs once, or several times when it parks for a human and is resumed: each run opens with
``turn.started`` and is a :class:`Segment` here. The first run's reply goes under the key ``reply``;
a run that continues after an answer goes under ``resume:<input_id>`` (a channel renders it into
the prompt that asked). A segment holds the text of each model step (live deltas, replaced by the
step's committed ``message.completed``), the tool calls as a timeline, and how the run ended.

The fold is pure and deterministic: the live renderer (deltas and structural events as they come)
and the at-least-once finisher (the stored structural events) reach the same view for a run that
ended, which is what lets rendering converge: the finisher compares :meth:`Segment.digest` with
what the live renderer recorded and does nothing when they match.

The rule a reader must not break: **nothing here talks to a channel**; it only says what to show.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from ..engine.children import parse_child_input
from ..engine.events import (
    ActionCompleted,
    ActionRequested,
    InputRequested,
    MessageCompleted,
    MessageDelta,
    TurnCancelled,
    TurnCompleted,
    TurnEvent,
    TurnFailed,
    TurnStarted,
)
from ..engine.types import InputRequest

__all__ = ["FAILED_NOTE", "SUPERSEDED_NOTE", "STOPPED_NOTE", "Segment", "Task", "fold", "task_line"]

SUPERSEDED_NOTE = "_superseded by a newer message_"
STOPPED_NOTE = "_stopped_"
FAILED_NOTE = ":warning: Sorry, the turn failed. Try again, or ask someone to look at it."

Ending = Literal["completed", "failed", "cancelled", "parked"]


@dataclass
class Task:
    """One tool call on the timeline: ``in_progress``, then ``complete`` or ``error``."""

    id: str
    name: str
    status: Literal["in_progress", "complete", "error"] = "in_progress"
    error: str | None = None


@dataclass
class _Step:
    text: str = ""
    attempt: int | None = None
    committed: bool = False


@dataclass
class Segment:
    """One run of a turn, as far as the events seen so far tell."""

    key: str | None
    """``reply``, ``resume:<input_id>``, or None when the run's ``turn.started`` was not seen (a replay)."""
    resumed_input: str | None = None
    order: list[str | Task] = field(default_factory=list)
    """Model step ids and tool calls, in the order they appeared: the timeline."""
    steps: dict[str, _Step] = field(default_factory=dict)
    tasks: dict[str, Task] = field(default_factory=dict)
    ending: Ending | None = None
    cancel_reason: str | None = None
    prompt: InputRequest | None = None
    """The first request the run parked on; ``prompts`` has them all (calls run in parallel may each ask one)."""
    prompts: list[InputRequest] = field(default_factory=list)
    final_text: str = ""

    # --- folding ------------------------------------------------------------------------------

    def add(self, event: TurnEvent) -> None:
        if isinstance(event, MessageDelta):
            step = self._step(event.step)
            if step.committed:
                return
            if step.attempt is not None and event.attempt is not None and event.attempt > step.attempt:
                step.text = ""  # a retried step: its text starts again
            if step.attempt is None or event.attempt is None or event.attempt >= step.attempt:
                step.attempt = event.attempt
                step.text += event.text
        elif isinstance(event, MessageCompleted):
            step = self._step(event.step)
            step.text, step.committed = event.text, True
        elif isinstance(event, ActionRequested):
            if event.call.id not in self.tasks:
                task = Task(id=event.call.id, name=event.call.name)
                self.tasks[task.id] = task
                self.order.append(task)
        elif isinstance(event, ActionCompleted):
            done = self.tasks.get(event.call.id)
            if done is not None:  # a call made in an earlier run (the one that parked) is on that run's timeline
                done.status, done.error = ("error", event.error) if event.error is not None else ("complete", None)
        elif isinstance(event, InputRequested):
            self.ending = "parked"
            # a request of its child turn (ctx.delegate) is nobody's to answer here: no prompt, no buttons
            if parse_child_input(event.request.id) is None:
                self.prompts.append(event.request)
                self.prompt = self.prompt or event.request
        elif isinstance(event, TurnCompleted):
            self.ending, self.final_text = "completed", event.text
        elif isinstance(event, TurnFailed):
            self.ending = "failed"
        elif isinstance(event, TurnCancelled):
            self.ending, self.cancel_reason = "cancelled", event.reason

    def _step(self, step_id: str) -> _Step:
        found = self.steps.get(step_id)
        if found is None:
            found = self.steps[step_id] = _Step()
            self.order.append(step_id)
        return found

    # --- what to show -------------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """The run's words: each model step's text, in order (the final text when no step had any)."""
        texts = [self.steps[s].text.strip() for s in self.order if isinstance(s, str) and self.steps[s].text.strip()]
        if not texts and self.final_text.strip():
            return self.final_text.strip()
        return "\n\n".join(texts)

    @property
    def note(self) -> str | None:
        """The closing line of a run that did not simply complete (None when there is nothing to say)."""
        if self.ending == "failed":
            return FAILED_NOTE
        if self.ending == "cancelled" and self.text:
            return SUPERSEDED_NOTE if self.cancel_reason == "replaced" else STOPPED_NOTE
        return None

    @property
    def visible(self) -> bool:
        """Whether the run has anything to post: words or a failure. A tool-only or empty run has not."""
        return bool(self.text) or self.ending == "failed"

    @property
    def ended(self) -> bool:
        return self.ending is not None

    def stream_text(self) -> str:
        """The words as a stream shows them (tool calls go to the stream's timeline), note included."""
        return "\n\n".join(p for p in (self.text, self.note) if p)

    def body(self, *, committed: bool = False) -> str:
        """The whole run as one message: words and tool calls in the order they came, then the note.

        ``committed``: only what the store holds, without the note (a step's live text that never
        committed, as when the run failed or was cancelled mid-step, left out)."""
        parts: list[str] = []
        words = False
        for item in self.order:
            if isinstance(item, Task):
                parts.append(task_line(item))
            elif not committed or self.steps[item].committed:
                text = self.steps[item].text.strip()
                if text:
                    parts.append(text)
                    words = True
        if not words and self.final_text.strip():
            parts.append(self.final_text.strip())
            words = True
        if not words and self.ending != "failed":
            parts = []  # tool calls alone are not worth a message
        if self.note and not committed:
            parts.append(self.note)
        return "\n".join(parts)

    def digest(self) -> str:
        """What the finished run is, from its committed events only, as a short hash: the live renderer and
        the delivery compute the same one, so a run the live render showed is not shown again."""
        shown: dict[str, object] = {
            "body": self.body(committed=True),
            "ending": self.ending,
            "cancel_reason": self.cancel_reason,
            "prompt": self.prompt.id if self.prompt else None,
        }
        if len(self.prompts) > 1:  # only then: a run's digest stays what it was for one prompt
            shown["prompts"] = [p.id for p in self.prompts]
        return hashlib.sha256(json.dumps(shown, sort_keys=True).encode()).hexdigest()[:32]


def task_line(task: Task) -> str:
    if task.status == "error":
        return f":x: `{task.name}` failed: {(task.error or 'error')[:300]}"
    if task.status == "complete":
        return f":white_check_mark: `{task.name}`"
    return f":hourglass_flowing_sand: `{task.name}`"


def _key(event: TurnStarted) -> tuple[str, str | None]:
    trigger = event.trigger
    if trigger.kind == "resume":
        input_id = trigger.input_id or trigger.call_id
        return f"resume:{input_id}", input_id
    return "reply", None


def fold(events: Iterable[TurnEvent], segments: list[Segment] | None = None) -> list[Segment]:
    """Fold events (in order) into segments, extending ``segments`` when given; returns the list."""
    out = segments if segments is not None else []
    for event in events:
        if isinstance(event, TurnStarted):
            key, input_id = _key(event)
            out.append(Segment(key=key, resumed_input=input_id))
            continue
        if not out:
            out.append(Segment(key=None))
        out[-1].add(event)
    return out
