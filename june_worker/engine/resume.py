"""Resuming a parked turn: who may answer, what a valid answer is, and the one commit that applies it.

The checks run against the session's suspended checkpoint, and the commit is conditional
on that checkpoint still being there (``Commit.expect_suspended``), so of two resumes that
race for one park exactly one is applied; the other gets a conflict.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

from ..errors import InvalidAnswerError, ResumeAuthorizationError, ResumeConflictError
from .agent import Agent, AnswerRequest
from .events import Cancelled, InputAnswered, Suspended, TurnCancelled, TurnStarted
from .failures import backoff_s
from .store import Commit, OpenInput, StepRecord, SuspendedCheckpoint, input_step_id
from .types import JsonValue, PolicyAnswerer, Principal, ResumeTrigger, UserAnswerer

__all__ = [
    "RESUME_RACES",
    "Grant",
    "race_tries",
    "race_wait_s",
    "check_parked",
    "grant_answer",
    "reset_park_commit",
    "resume_commit",
    "still_open",
    "timeout_commit",
]


@dataclass(frozen=True)
class Grant:
    """Proof that the agent's ``authorize_answer`` let ``by`` answer a ``{policy, scope}`` request."""

    policy: str
    scope: str | None
    by: str | None


def check_parked(
    parked: SuspendedCheckpoint | None, turn_id: str, input_id: str, *, reset_pending: bool = False
) -> SuspendedCheckpoint:
    """The checkpoint this resume answers, or a :class:`ResumeConflictError` saying why not."""
    if reset_pending:
        raise ResumeConflictError("a reset is pending on this session; the parked turn will be archived")
    if parked is None:
        raise ResumeConflictError(f"turn {turn_id} is not suspended: the session is not waiting for input")
    if parked.turn_id != turn_id:
        raise ResumeConflictError(f"turn {turn_id} is not suspended: the session is parked on turn {parked.turn_id}")
    answering = parked.answering(input_id)
    if answering is None:
        waiting = ", ".join(repr(i.request.id) for i in parked.inputs())
        raise ResumeConflictError(f"turn {turn_id} is waiting for input {waiting}, not {input_id!r}")
    return answering


async def grant_answer(
    agent: Agent, parked: SuspendedCheckpoint, *, session: str, by: str | None, principal: Principal | None
) -> Grant | None:
    """Ask the agent's ``authorize_answer`` hook about a ``{policy}`` request; None for other requests.

    Raises :class:`ResumeAuthorizationError` when the hook says no or the agent has none.
    An exception from the hook propagates: the answer is not applied and can be retried.
    """
    answerers = parked.request.answerers
    if not isinstance(answerers, PolicyAnswerer):
        return None
    if agent.authorize_answer is None:
        raise ResumeAuthorizationError(
            f"input {parked.request.id!r} is answered by policy {answerers.policy!r}, "
            f"but agent {agent.name} has no authorize_answer hook"
        )
    decision = agent.authorize_answer(
        AnswerRequest(
            policy=answerers.policy,
            scope=answerers.scope,
            by=by,
            principal=principal,
            turn_id=parked.turn_id,
            input_id=parked.request.id,
            session=session,
        )
    )
    if inspect.isawaitable(decision):
        decision = await decision
    if decision is not True:
        raise ResumeAuthorizationError(
            f"{by or 'an anonymous resumer'} is not authorized to answer input {parked.request.id!r} "
            f"(policy {answerers.policy!r}, scope {answerers.scope!r})"
        )
    return Grant(policy=answerers.policy, scope=answerers.scope, by=by)


def _authorize(parked: SuspendedCheckpoint, by: str | None, granted: Grant | None) -> None:
    answerers = parked.request.answerers
    if answerers is None:
        return  # proactive and programmatic turns: the app drives its own resume
    if isinstance(answerers, UserAnswerer):
        if by is None or by != answerers.user:
            who = f"{by!r}" if by is not None else "a resumer with no verified identity"
            raise ResumeAuthorizationError(f"{who} is not authorized to answer input {parked.request.id!r}")
        return
    if granted is None or granted.policy != answerers.policy or granted.scope != answerers.scope:
        raise ResumeAuthorizationError(
            f"input {parked.request.id!r} needs a grant for policy {answerers.policy!r} "
            f"scope {answerers.scope!r}; by alone never answers a policy"
        )


def _validate_answer(parked: SuspendedCheckpoint, value: JsonValue) -> None:
    schema = parked.request.json_schema
    if schema is None:
        return
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        # Says which rule of the schema failed, never the value: the reason ends up in task results and logs.
        where = "/".join(str(p)[:64] for p in exc.absolute_path) or "the answer"
        rule = json.dumps(exc.validator_value, default=str)
        rule = rule if len(rule) <= 120 else rule[:117] + "..."
        raise InvalidAnswerError(
            f"answer to {parked.request.id!r} rejected: {where} does not satisfy the schema's "
            f"{exc.validator!r} rule ({rule})"
        ) from None
    except jsonschema.SchemaError as exc:
        raise InvalidAnswerError(f"input {parked.request.id!r} has an invalid schema: {exc.message}") from None


def resume_commit(
    parked: SuspendedCheckpoint,
    value: JsonValue,
    *,
    by: str | None,
    granted: Grant | None = None,
    cancel: str | None = None,
) -> Commit:
    """Authorize and validate the answer, then build the commit that applies it and re-queues the turn.

    ``cancel``: the turn's cancel (stored with its park, or carried by a child turn cancelled with it): the commit
    stores it and re-queues the turn whatever requests are still open, so that it runs and ends ``cancelled``
    at once (its calls do not run again), instead of waiting on a park nobody needs any more.
    """
    _authorize(parked, by, granted)
    _validate_answer(parked, value)
    commit = _answer_commit(parked, [(parked.inputs()[0], {"answer": value, "by": by})], close=cancel is not None)
    if cancel is not None:
        commit.cancel_reason = cancel
    return commit


def timeout_commit(parked: SuspendedCheckpoint) -> Commit | None:
    """The commit that answers the park's first-expiring requests with a timeout once they expired, or None
    for a park without a timeout. The requests that expire later stay open.

    Whether it expired is the store's to say, by its own clock, when the commit applies
    (``Commit.expect_expired``): a process's clock is never compared with another's.
    """
    due = parked.due()
    if not due:
        return None
    commit = _answer_commit(parked, [(i, {"timeout": True}) for i in due])
    commit.expect_expired = True
    return commit


def _answer_commit(
    parked: SuspendedCheckpoint, answers: list[tuple[OpenInput, dict[str, JsonValue]]], *, close: bool = False
) -> Commit:
    """Answer some of the park's open requests: the turn re-queues when none is left open (or ``close``), else the
    park stays with the others (a new ``version`` of the checkpoint, its expiry still counted from the park)."""
    answered = {i.request.id for i, _ in answers}
    steps = []
    for open_input, data in answers:
        if parked.policy is not None:
            data["policy"] = parked.policy.model_dump()
        steps.append(
            StepRecord(step_id=input_step_id(parked.turn_id, open_input.request.id), turn_id=parked.turn_id, data=data)
        )
    first = answers[0][0]
    expect = (parked.turn_id, first.request.id)
    left = [i for i in parked.inputs() if i.request.id not in answered]
    if left and not close:
        rest = parked.model_copy(
            update={
                "request": left[0].request,
                "call_id": left[0].call_id,
                "more": left[1:],
                "version": parked.version + 1,
            }
        )
        return Commit(
            steps=steps,
            events=[InputAnswered(turn_id=parked.turn_id, input_id=i.request.id, open=len(left)) for i, _ in answers],
            suspended=rest,
            repark_from=parked.park_timeout(),
            # the turn's stored result lists what it still waits for (read where its events were lost)
            turn_id=parked.turn_id,
            turn_status="suspended",
            turn_result=Suspended(turn_id=parked.turn_id, request=left[0].request, more=[i.request for i in left[1:]]),
            expect_suspended=expect,
            expect_version=parked.version,
        )
    return Commit(
        steps=steps,
        events=[
            TurnStarted(turn_id=parked.turn_id, trigger=ResumeTrigger(call_id=first.call_id, input_id=first.request.id))
        ],
        status="running",
        clear_suspended=True,
        turn_id=parked.turn_id,
        turn_status="queued",
        turn_result=None,
        expect_suspended=expect,
        expect_version=parked.version,
    )


def reset_park_commit(parked: SuspendedCheckpoint) -> Commit:
    """A reset ends the parked turn: cancelled (reason ``reset``), so its followers see it end."""
    return Commit(
        events=[TurnCancelled(turn_id=parked.turn_id, reason="reset")],
        clear_suspended=True,
        turn_id=parked.turn_id,
        turn_status="cancelled",
        turn_result=Cancelled(turn_id=parked.turn_id, reason="reset"),
    )


RESUME_RACES = 5
"""Tries of one answer beyond one per other request of its park (:func:`race_tries`)."""


def race_tries(parked: SuspendedCheckpoint) -> int:
    """How many times an answer to ``parked`` is tried while its request stays open. It loses a race only to an
    answer (or an expiry) of *another* request of the park, which closes that request: so it can lose at most once
    per other request, and :data:`RESUME_RACES` more for whatever else moved the checkpoint on. Before each try it
    reads the park again, so once its own request was answered or expired it gets that conflict instead."""
    return len(parked.inputs()) + RESUME_RACES


def race_wait_s(attempt: int) -> float:
    """The pause after try ``attempt`` lost a race: full jitter, up to 20 ms, so that answers landing together
    (a parent's children ending at once) spread out instead of colliding again."""
    return backoff_s(attempt - 1, base_s=0.001, cap_s=0.02)


def still_open(
    now: SuspendedCheckpoint | None, before: SuspendedCheckpoint, turn_id: str, input_id: str
) -> SuspendedCheckpoint | None:
    """After expired requests were answered with a timeout: the park, if the request being answered is still
    open in it; else the conflict that says it expired."""
    if now is not None and now.turn_id == turn_id and now.answering(input_id) is not None:
        return now
    if before.turn_id == turn_id and any(i.request.id == input_id for i in before.due()):
        raise ResumeConflictError(
            f"input {input_id!r} of turn {before.turn_id} expired before this answer came; the turn went on without it"
        )
    return now
