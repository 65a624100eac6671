"""Crash injection, for tests only: die at a commit boundary as if the process was killed there.

Points: ``before-model-commit``, ``after-model-commit``, ``before-tool-commit``,
``after-tool-commit``, ``before-compact-commit``, ``after-compact-commit`` (a context policy's
compaction step, ``compact:<n>``) and ``before-publish`` (committed, events not yet published; its
step is ``turn:open`` for the opening commit and ``turn:end`` for a park, cancel or failure) and
``before-start`` (a start of the turn not yet written by the runner: its opening, or a replay's count; step
``turn:open``; after the check that gives up a poisoned turn, so that it can still end; for a turn a worker
opened with its intake, once the intake committed, before its ``turn.started`` is published). Nothing
here runs unless a host is handed a hook explicitly; production code paths pass ``None``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from .signals import CrashInjected

__all__ = ["CRASH_POINTS", "CrashAt", "CrashHook"]

CrashHook = Callable[[str, str], None]
"""Called at ``before-/after-model-commit`` and ``before-/after-tool-commit`` with the step id."""

CRASH_POINTS = frozenset(
    {
        "before-model-commit",
        "after-model-commit",
        "before-tool-commit",
        "after-tool-commit",
        "before-compact-commit",
        "after-compact-commit",
        "before-publish",
        "before-start",  # a start of the turn picked, not yet written by the runner (its opening, or a replay's count)
        "before-deliver",  # the worker host, after a turn with a target ended, with its turn id as the step
        "after-child-start",  # a tool's child turn recorded (ctx.delegate), its parent not parked yet; the call's step
        "before-parent-answer",  # a child turn ended, its parent not answered yet; the child's turn id
        "after-parent-answer",  # the parent answered (queued again), not yet sent to a worker; the child's turn id
        "before-intake",  # the worker, a june.turn message received and not yet recorded; its turn id as the step
    }
)


@dataclass
class CrashAt:
    """Crash once at ``point`` (optionally only at ``step``), by raising or by SIGKILL of this process."""

    point: str
    step: str | None = None
    kill: bool = False
    fired: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.point not in CRASH_POINTS:
            raise ValueError(f"unknown crash point {self.point!r}; expected one of {sorted(CRASH_POINTS)}")

    @classmethod
    def parse(cls, spec: str, *, kill: bool = False) -> CrashAt:
        """``"after-tool-commit"`` or ``"after-tool-commit@tool:1:c1"``."""
        point, _, step = spec.partition("@")
        return cls(point=point, step=step or None, kill=kill)

    def fires(self, point: str, step: str) -> bool:
        """True (once) when ``point`` at ``step`` is where to crash; for callers that die their own way."""
        if self.fired or point != self.point or (self.step is not None and step != self.step):
            return False
        self.fired = True
        return True

    def __call__(self, point: str, step: str) -> None:
        if not self.fires(point, step):
            return
        if self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        raise CrashInjected(point, step)
