"""MemoryStore: the whole SessionStore contract in Python dicts, for tests and experiments.

It has **no rollback**: a sync tool cannot write through it (``ctx.store`` refuses with
:class:`~june_worker.errors.FatalToolError`), so exactly-once for tool writes holds only on
SQLite and Postgres. A commit itself is still all-or-nothing: it is checked in full
before anything is applied. Two sessions over one ``MemoryStore`` object model a restart.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.endings import rejection_event
from ..engine.events import Rejected, TurnEvent
from ..engine.store import (
    ENDED_TURN_STATUSES,
    UNFINISHED_TURN_STATUSES,
    Commit,
    CommitBuilder,
    ResetResult,
    SessionRef,
    SessionSnapshot,
    SessionStatus,
    StepRecord,
    SuspendedCheckpoint,
    TurnPayload,
    TurnRecord,
    park_expiry,
    parked_on,
)
from ..engine.tools import NoTransactionHandle
from ..engine.types import Message
from ..errors import (
    CancelRequestedError,
    LeaseLostError,
    MessageIndexTakenError,
    ResumeConflictError,
    StoreError,
    TurnEndedError,
)

__all__ = ["MemoryStore"]


@dataclass
class _Session:
    generation: int = 0
    status: SessionStatus = "new"
    suspended: SuspendedCheckpoint | None = None
    messages: list[Message] = field(default_factory=list)
    steps: dict[str, StepRecord] = field(default_factory=dict)
    events: list[TurnEvent] = field(default_factory=list)
    turns: dict[str, TurnRecord] = field(default_factory=dict)
    next_position: int = 1
    fence: int = 0
    park_expires_at: float | None = None
    compacted_at: int | None = None


class MemoryStore:
    """In-memory sessions. ``archives`` keeps reset generations for inspection."""

    supports_rollback = False

    def __init__(self) -> None:
        self._sessions: dict[SessionRef, _Session] = {}
        self._lock = threading.RLock()
        self.archives: list[dict[str, Any]] = []

    def _get(self, ref: SessionRef) -> _Session:
        s = self._sessions.get(ref)
        if s is None:
            s = self._sessions[ref] = _Session()
        return s

    def load(self, ref: SessionRef) -> SessionSnapshot:
        with self._lock:
            s = self._get(ref)
            return SessionSnapshot(
                ref_agent=ref.agent,
                ref_session=ref.session,
                generation=s.generation,
                status=s.status,
                suspended=s.suspended,
                messages=list(s.messages),
                steps=dict(s.steps),
                event_seq=len(s.events),
                compacted_at=s.compacted_at,
            )

    def commit(self, ref: SessionRef, commit: Commit | CommitBuilder, *, fence: int | None = None) -> list[TurnEvent]:
        with self._lock:
            s = self._get(ref)
            _check_fence(ref, s, fence)
            if not isinstance(commit, Commit):
                commit = commit(NoTransactionHandle("the memory store has no transaction for a tool to write in"))
            self._check(ref, s, commit)
            # Everything checked: apply.
            for _, message in commit.messages:
                if message.role == "summary":
                    s.compacted_at = len(s.messages)
                s.messages.append(message)
            for step in commit.steps:
                s.steps.setdefault(step.step_id, step)
            out = []
            for event in commit.events:
                stamped = event.model_copy(update={"seq": len(s.events) + 1})
                s.events.append(stamped)
                out.append(stamped)
            if commit.status is not None:
                s.status = commit.status
            if commit.clear_suspended:
                s.suspended, s.park_expires_at = None, None
            if commit.suspended is not None:
                s.park_expires_at = park_expiry(commit, time.time(), s.park_expires_at)
                s.suspended = commit.suspended.with_expiry(s.park_expires_at)
            rec = s.turns.get(commit.turn_id) if commit.turn_id is not None else None
            if rec is not None and commit.cancel_reason is not None and rec.status not in ENDED_TURN_STATUSES:
                if rec.cancel_reason is None:
                    rec = s.turns[rec.turn_id] = rec.model_copy(update={"cancel_reason": commit.cancel_reason})
            if rec is not None and commit.turn_status is not None:
                finished = commit.turn_status not in UNFINISHED_TURN_STATUSES
                rec = s.turns[rec.turn_id] = rec.model_copy(
                    update={
                        "status": commit.turn_status,
                        "result": commit.turn_result,
                        "attempts": _attempts(rec.attempts, commit.turn_status, commit.count_attempt),
                        "finished_at": time.time() if finished else None,
                    }
                )
            if rec is not None and commit.turn_error is not None:
                s.turns[rec.turn_id] = rec.model_copy(update={"last_error": commit.turn_error})
            return out

    def _check(self, ref: SessionRef, s: _Session, commit: Commit) -> None:
        rec = s.turns.get(commit.turn_id) if commit.turn_id is not None else None
        if rec is not None and commit.turn_status is not None and rec.status in ENDED_TURN_STATUSES:
            raise TurnEndedError(f"session {ref}: turn {rec.turn_id} has ended ({rec.status}); its status stays")
        if rec is not None and commit.expect_not_cancelled and rec.cancel_reason is not None:
            raise CancelRequestedError(rec.cancel_reason)
        if commit.expect_suspended is not None:
            turn_id, input_id = commit.expect_suspended
            if not parked_on(s.suspended, turn_id, input_id, commit.expect_version):
                raise ResumeConflictError(f"session {ref} is not parked on turn {turn_id} input {input_id!r}")
            if commit.expect_expired and (s.park_expires_at is None or s.park_expires_at > time.time()):
                raise ResumeConflictError(f"session {ref}: input {input_id!r} has not expired")
        expected = len(s.messages)
        for index, _ in commit.messages:
            if index < expected:
                raise MessageIndexTakenError(f"session {ref}: message index {index} is taken (next is {expected})")
            if index != expected:
                raise StoreError(
                    f"session {ref}: message index {index} is taken or out of order (next is {len(s.messages)})"
                )
            expected += 1

    def enqueue_turn(self, ref: SessionRef, turn_id: str, payload: TurnPayload) -> tuple[TurnRecord, bool]:
        with self._lock:
            s = self._get(ref)
            existing = s.turns.get(turn_id)
            if existing is not None:
                return existing, False
            rec = s.turns[turn_id] = _new_turn(ref, s, turn_id, payload)
            return rec, True

    def reject_turn(
        self,
        ref: SessionRef,
        turn_id: str,
        payload: TurnPayload,
        reason: str,
        *,
        fence: int | None = None,
        new_only: bool = False,
    ) -> tuple[TurnRecord, list[TurnEvent]]:
        with self._lock:
            s = self._get(ref)
            _check_fence(ref, s, fence)
            rec = s.turns.get(turn_id)
            if rec is not None and (new_only or rec.status not in UNFINISHED_TURN_STATUSES):
                return rec, []
            if rec is None:
                rec = _new_turn(ref, s, turn_id, payload)
            event = rejection_event(turn_id, reason).model_copy(update={"seq": len(s.events) + 1})
            s.events.append(event)
            rec = s.turns[turn_id] = rec.model_copy(
                update={
                    "status": "rejected",
                    "result": Rejected(turn_id=turn_id, reason=reason),
                    "finished_at": time.time(),
                }
            )
            return rec, [event]

    def get_turn(self, ref: SessionRef, turn_id: str) -> TurnRecord | None:
        with self._lock:
            return self._get(ref).turns.get(turn_id)

    def pending(self, ref: SessionRef) -> SuspendedCheckpoint | None:
        with self._lock:
            return self._get(ref).suspended

    def unfinished_turns(self, ref: SessionRef) -> list[TurnRecord]:
        with self._lock:
            turns = [t for t in self._get(ref).turns.values() if t.status in UNFINISHED_TURN_STATUSES]
            return sorted(turns, key=lambda t: t.position)

    def child_turns(self, parent: SessionRef, parent_turn_id: str, agents: Collection[str]) -> list[TurnRecord]:
        prefix = f"{parent.session}:sub:"
        with self._lock:
            return [
                t
                for r, s in self._sessions.items()
                if r.agent in agents and r.session.startswith(prefix)
                for t in s.turns.values()
                if t.payload.parent is not None
                and t.payload.parent.turn_id == parent_turn_id
                and (t.payload.parent.agent, t.payload.parent.session) == (parent.agent, parent.session)
            ]

    def request_cancel(self, ref: SessionRef, reason: str, *, turn_ids: Sequence[str] | None = None) -> list[str]:
        with self._lock:
            s = self._get(ref)
            marked = []
            for t in list(s.turns.values()):
                if t.status not in UNFINISHED_TURN_STATUSES or (turn_ids is not None and t.turn_id not in turn_ids):
                    continue
                if t.cancel_reason is None:
                    s.turns[t.turn_id] = t.model_copy(update={"cancel_reason": reason})
                marked.append(t.turn_id)
            return marked

    def events(self, ref: SessionRef, *, turn_id: str | None = None, after_seq: int = 0) -> list[TurnEvent]:
        with self._lock:
            return [
                e
                for e in self._get(ref).events
                if (e.seq or 0) > after_seq and (turn_id is None or e.turn_id == turn_id)
            ]

    def reset(self, ref: SessionRef, *, fence: int | None = None) -> ResetResult:
        with self._lock:
            s = self._get(ref)
            _check_fence(ref, s, fence)
            generation = s.generation
            self.archives.append(
                {
                    "session": ref.key,
                    "generation": generation,
                    "messages": copy.deepcopy(s.messages),
                    "steps": copy.deepcopy(s.steps),
                }
            )
            s.messages = []
            s.compacted_at = None
            s.steps = {}
            s.suspended, s.park_expires_at = None, None
            s.status = "new"
            s.generation = generation + 1
            return ResetResult(previous_session=f"{ref.session}#g{generation}", generation=generation)

    # --- leases, for hosts that coordinate several runners (tests of the worker logic) -------------

    def acquire_fence(self, ref: SessionRef) -> int:
        with self._lock:
            s = self._get(ref)
            s.fence += 1
            return s.fence

    def close(self) -> None:
        return None


def _attempts(attempts: int, status: str, count: bool = True) -> int:
    """A turn's attempt count after a commit sets ``status``: a start counts one (unless counted already:
    ``count``), a resume (queued again) starts over."""
    if status == "running":
        return attempts + 1 if count else attempts
    return 0 if status == "queued" else attempts


def _check_fence(ref: SessionRef, s: _Session, fence: int | None) -> None:
    if fence is not None and fence != s.fence:
        raise LeaseLostError(f"session {ref} is leased under fence {s.fence}, not {fence}")


def _new_turn(ref: SessionRef, s: _Session, turn_id: str, payload: TurnPayload) -> TurnRecord:
    """A turn recorded at the session's next position (the caller stores it)."""
    rec = TurnRecord(
        turn_id=turn_id,
        agent=ref.agent,
        session=ref.session,
        position=s.next_position,
        payload=payload,
        generation=s.generation,
        created_at=time.time(),
    )
    s.next_position += 1
    return rec
