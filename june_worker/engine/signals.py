"""Control-flow signals that travel through tool code and must never be swallowed by it.

They derive from ``BaseException``: a tool's ``except Exception:`` lets them through, so a
park or a crash injection always reaches the engine instead of becoming an ``{"error"}``
result the model would read.
"""

from __future__ import annotations

from .types import InputRequest

__all__ = ["CrashInjected", "ParkSignal", "SyncParkError"]


class ParkSignal(BaseException):
    """Raised by ``ctx.request_input`` when no answer is stored yet: the turn parks."""

    def __init__(self, request: InputRequest) -> None:
        super().__init__(request)
        self.request = request


class SyncParkError(BaseException):
    """``request_input`` was called from a sync tool: a programming mistake that fails the turn."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class CrashInjected(BaseException):
    """Raised at a crash point in tests, as if the process died right there."""

    def __init__(self, point: str, step: str) -> None:
        super().__init__(point, step)
        self.point = point
        self.step = step

    def __str__(self) -> str:
        return f"CRASH injected {self.point} at {self.step}"
