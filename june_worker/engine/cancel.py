"""The CancelProbe: how a running turn learns it was cancelled.

Hosts implement it (the in-process session, the Celery worker host); the engine reads it at
checkpoint boundaries only. The rule: ``on_cancel`` callbacks run on the turn's event loop
thread, never from another thread directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["NO_CANCEL", "CancelProbe"]


class CancelProbe(Protocol):
    """How a running turn learns it was cancelled. Checked only at checkpoint boundaries."""

    def reason(self) -> str | None: ...

    def on_cancel(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` once if a cancel arrives while it is registered; ``None`` unregisters.

        The engine registers one while it waits on the model, so a cancel does not wait for
        the next delta. It must be called on the turn's event loop thread.
        """
        ...


class _NeverCancelled:
    def reason(self) -> str | None:
        return None

    def on_cancel(self, callback: Callable[[], None] | None) -> None:
        return None


NO_CANCEL: CancelProbe = _NeverCancelled()
