"""The failure policy: what a fault inside a turn leads to, decided in one place.

Every exception that reaches the turn runner (a tool's, the model's, the store's) is mapped to
one of five classes by :func:`classify`; the runner, the in-process runtime and the worker
host act on the class, never on their own reading of the exception:

==============  ==================================================  ==========================================
class           examples                                            what happens
==============  ==================================================  ==========================================
``transient``   the store's connection lost, a serialization        the same step runs again from what the
                failure or deadlock (:class:`StoreUnavailableError`  store holds (same step id), after a backoff;
                and every ``TransientError``), a provider error     after :data:`STEP_RETRIES` tries the attempt
                marked ``retryable`` (by a model that does not      ends and the host starts another one; never
                retry its calls itself)                             recorded as a tool's result
``tool``        any exception a tool raises; a statement it         committed as the call's ``{"error": ...}``
                caught (rolled back to its savepoint)               result; the model reads it
``fatal``       :class:`FatalToolError`, a sync tool that parks or  the turn ends ``failed`` with its phase and
                returns an awaitable, an abnormal empty model       step; the session serves its next turn
                stop, any other model error, a value the store      (a request too long for the context window:
                refused, a request the model refuses as longer      the runner first compacts the transcript
                than its context window                             and asks once more, see :mod:`.context`)
``poison``      the same turn started ``max_attempts`` times        the turn ends ``failed``
                without ending (its process was killed, or each     (:class:`PoisonTurnError`, with the step it
                attempt ended on a transient fault)                 was at and the last error), its terminal
                                                                    event is published, the session moves on
``lost_race``   a commit refused because another runner of the      not a failure of the turn: this run writes
                session committed that step first                   nothing more, waits for the turn to end and
                (:class:`MessageIndexTakenError`: two in-process    reports that ending (the winner's); a turn
                runtimes on one database take no lease)             that shows no progress for
                                                                    :data:`RACE_STALL_S` (its runner died) is
                                                                    run on from what the store holds
==============  ==================================================  ==========================================

A model call's retries are the model's: the Anthropic adapter retries an overloaded or failed request within
one budget of its own and raises a non-retryable error once it is spent (docs/anthropic.md), so the step's
retries and the host's attempts do not multiply its requests. A retryable provider error is one that no retry
budget covered yet (a model without a policy of its own).

Strings that cannot be stored (NUL, lone surrogates, an ``__str__`` that raises) are made
storable before they reach a commit (:mod:`.storable`), so they never become a failure.

The rule a reader must not break: **a caller that catches an exception from a step hands it
to** :func:`classify` **and acts on the answer**; nothing else decides whether to retry.
"""

from __future__ import annotations

import enum
import random
from typing import Literal

from ..errors import (
    ContextWindowExceededError,
    FatalToolError,
    MessageIndexTakenError,
    PoisonTurnError,
    StoreUnavailableError,
    TransientError,
)

__all__ = ["DEFAULT_MAX_ATTEMPTS", "RACE_STALL_S", "STEP_RETRIES", "Failure", "backoff_s", "classify"]

DEFAULT_MAX_ATTEMPTS = 5
"""Attempts of one turn (each start of a worker or runtime on it) before it is given up as poison."""

STEP_RETRIES = 3
"""Transient faults a step survives within one attempt before the attempt ends."""

RACE_STALL_S = 60.0
"""How long a runner that lost a race for a turn waits for the turn to move (a commit, an event) before it runs the
turn on itself, taking the other runner for dead. Too short costs duplicate work (a model call, an async tool run
again), never a wrong result: each step still commits once."""


class Failure(enum.Enum):
    TRANSIENT = "transient"
    TOOL = "tool"
    FATAL = "fatal"
    POISON = "poison"
    LOST_RACE = "lost_race"


def classify(exc: BaseException, *, phase: Literal["model", "tool", "store", "channel"]) -> Failure:
    """The failure class of ``exc``, raised in ``phase``: inside a tool, by the model stream, the store or a channel.

    A tool's exception is the tool's own unless it is the store's (the step's transaction
    lost its connection under the tool): a network error a tool meets calling some API is
    for the model to read, not a reason to retry the step.
    """
    if isinstance(exc, PoisonTurnError):
        return Failure.POISON
    if isinstance(exc, (FatalToolError, ContextWindowExceededError)):
        return Failure.FATAL  # the same request would be refused again, however often it is sent
    if isinstance(exc, StoreUnavailableError):
        return Failure.TRANSIENT
    if phase == "tool":
        return Failure.TOOL
    if isinstance(exc, MessageIndexTakenError):
        return Failure.LOST_RACE  # someone else runs this session's turn: theirs is the outcome
    if isinstance(exc, TransientError) or getattr(exc, "retryable", False) is True:
        return Failure.TRANSIENT
    return Failure.FATAL


def backoff_s(retry: int, *, base_s: float = 0.05, cap_s: float = 2.0) -> float:
    """Exponential backoff with full jitter before try ``retry + 1`` (0-based)."""
    return random.uniform(0, min(cap_s, base_s * 2**retry))
