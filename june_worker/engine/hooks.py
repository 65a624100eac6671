"""TurnHooks: how a host watches a turn run (metrics, traces, logs) without the engine knowing how.

The engine stays pure: it imports no metrics or tracing library. A host that wants to see a
turn passes a :class:`TurnHooks` to :class:`~june_worker.engine.loop.TurnRunner`; the runner
calls it at two places only:

* :meth:`TurnHooks.step` wraps each step it runs (a model call, a tool call, a compaction of the
  transcript) as a context manager: entered before the step, left after its commit (or when it
  raises, with the exception: a transient fault, a cancel, a failure). A compaction runs on its
  own before a model step, or inside one that the model refused as too long;
* :meth:`TurnHooks.committed` is called after every checkpoint the store accepted, with the
  commit itself: a turn's transitions (``turn_status``), its tool results
  (``action.completed`` events), its model usage (the model or compaction step's record) are all in it.

The rule a reader must not break: **a hook never changes what the turn does**. A hook that
raises is a bug of the host's; the runner does not catch it, so hosts keep their hooks
exception-free (the worker's catches and logs its own faults).
"""

from __future__ import annotations

import contextlib
from typing import Literal, Protocol

from .store import Commit

__all__ = ["NO_HOOKS", "StepKind", "TurnHooks"]

StepKind = Literal["model", "tool", "compact"]


class TurnHooks(Protocol):
    def step(self, kind: StepKind, step: str, tool: str | None = None) -> contextlib.AbstractContextManager[None]:
        """Around one step: ``kind`` model, tool or compact, ``step`` its id (``model:3``), ``tool`` the tool's name."""
        ...

    def committed(self, commit: Commit) -> None:
        """After the store accepted ``commit`` (before its events are published)."""
        ...


class _NoHooks:
    _NULL: contextlib.AbstractContextManager[None] = contextlib.nullcontext()

    def step(self, kind: StepKind, step: str, tool: str | None = None) -> contextlib.AbstractContextManager[None]:
        return self._NULL

    def committed(self, commit: Commit) -> None:
        return None


NO_HOOKS: TurnHooks = _NoHooks()
