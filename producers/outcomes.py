"""What the control tasks answer: ``june.resume`` and ``june.reset`` outcomes, parsed from the worker's dict.

The worker's tasks return small JSON summaries (DESIGN.md, "Celery tasks are thin shells"):

* ``june.resume``: ``{"status": "accepted" | "forbidden" | "conflict" | "invalid" | "error" | "rejected",
  "reason": str | null, "turn_id": str}``;
* ``june.cancel``: ``{"status": "cancel-requested" | "nothing-to-cancel" | ..., "turn_ids": [str, ...]}``
  (returned to the caller as the dict);
* ``june.reset``: ``{"status": "reset", "previous_session": "s1#g0", "generation": 0}`` or
  ``{"status": "rejected" | "pending", "reason": str}``.

A status this client does not know is an :class:`~producers.errors.UnexpectedResult`: the
worker and this client disagree about the contract, and guessing would hide it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

from .errors import UnexpectedResult

__all__ = [
    "ResetOutcome",
    "ResetStatus",
    "ResumeOutcome",
    "ResumeStatus",
    "parse_cancel",
    "parse_reset",
    "parse_resume",
]

ResumeStatus = Literal["accepted", "forbidden", "conflict", "invalid", "error", "rejected"]
ResetStatus = Literal["reset", "pending", "rejected"]


@dataclass(frozen=True, slots=True)
class ResumeOutcome:
    """How the worker took an answer to a parked turn. Only ``accepted`` resumes the turn."""

    status: ResumeStatus
    reason: str | None = None
    turn_id: str | None = None
    open: tuple[str, ...] = ()
    """Requests of the park still open after this answer (calls run in parallel may each have asked one): the
    turn goes on once none is."""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


@dataclass(frozen=True, slots=True)
class ResetOutcome:
    """How the worker took a reset: ``reset`` (done), ``pending`` (after the running turn), or ``rejected``."""

    status: ResetStatus
    reason: str | None = None
    previous_session: str | None = None
    """Where the retired history now lives, e.g. ``s1#g0``."""
    generation: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def done(self) -> bool:
        return self.status == "reset"


def _summary(task: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("status"), str):
        raise UnexpectedResult(f"{task} returned {_short(value)}; expected a JSON object with a string 'status'")
    return cast(dict[str, Any], value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _optional_str(task: str, data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is None or isinstance(value, str):
        return value
    raise UnexpectedResult(f"{task} returned {key}={_short(value)}; expected a string or null")


def parse_resume(value: Any) -> ResumeOutcome:
    data = _summary("june.resume", value)
    status = data["status"]
    if status not in get_args(ResumeStatus):
        raise UnexpectedResult(
            f"june.resume returned status {status!r}; expected one of {', '.join(get_args(ResumeStatus))}"
        )
    return ResumeOutcome(
        status=cast(ResumeStatus, status),
        reason=_optional_str("june.resume", data, "reason"),
        turn_id=_optional_str("june.resume", data, "turn_id"),
        open=tuple(str(i) for i in data.get("open") or ()),
        raw=data,
    )


def parse_reset(value: Any) -> ResetOutcome:
    data = _summary("june.reset", value)
    status = data["status"]
    if status not in get_args(ResetStatus):
        raise UnexpectedResult(
            f"june.reset returned status {status!r}; expected one of {', '.join(get_args(ResetStatus))}"
        )
    generation = data.get("generation")
    if generation is not None and (not isinstance(generation, int) or isinstance(generation, bool)):
        raise UnexpectedResult(f"june.reset returned generation={_short(generation)}; expected an integer or null")
    return ResetOutcome(
        status=cast(ResetStatus, status),
        reason=_optional_str("june.reset", data, "reason"),
        previous_session=_optional_str("june.reset", data, "previous_session"),
        generation=generation,
        raw=data,
    )


def parse_cancel(value: Any) -> dict[str, Any]:
    data = _summary("june.cancel", value)
    turn_ids = data.get("turn_ids", [])
    if not isinstance(turn_ids, list) or not all(isinstance(t, str) for t in turn_ids):
        raise UnexpectedResult(f"june.cancel returned turn_ids={_short(turn_ids)}; expected a list of turn ids")
    return data
