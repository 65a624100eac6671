"""Subagents as child turns: a tool starts a turn on another agent and its turn parks until that turn ends.

``await ctx.delegate(agent="researcher", text="...")`` records a child turn in the session
``"<parent session>:sub:<call id>.<digits of the child turn id>"`` and parks the parent turn on a reserved request,
``child:<agent>:<child turn id>``, that no human can answer. Whoever ends the child turn (the
in-process runtime, a worker, or the sweeper when that worker died) answers the request with
the child's result through the ordinary resume path, and the parent turn goes on.

The rule a reader must not break: **one child per call, whatever crashes**. The child's turn id
is derived from (parent session, parent turn, call id), and recording it is the store's
idempotent ``enqueue_turn``: a tool that runs again (async tools are at least once) finds the
child its earlier run started.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Protocol

from june_wire.storable import unstorable_reason

from ..errors import DelegationError, ResumeAuthorizationError, ResumeConflictError
from .blocking import Blocking, inline
from .events import Cancelled, ChildInputRequested, TurnEvent, TurnResult
from .ids import validate_session_id
from .resume import Grant
from .signals import SyncParkError
from .store import (
    ENDED_TURN_STATUSES,
    UNFINISHED_TURN_STATUSES,
    Commit,
    SessionRef,
    SessionStore,
    SuspendedCheckpoint,
    TurnPayload,
    TurnRecord,
    input_step_id,
)
from .types import JsonValue, ParentLink, PolicyAnswerer

if TYPE_CHECKING:
    from .agent import Agent
    from .inputs import InputBroker
    from .tools import ToolContext

__all__ = [
    "CHILD_INPUT_PREFIX",
    "CHILD_POLICY",
    "ENDS_CHILDREN",
    "ChildLauncher",
    "announce_child_park",
    "Delegator",
    "cancel_children",
    "cancel_parked",
    "child_answer",
    "child_grant",
    "child_input_id",
    "children_of_park",
    "child_session_id",
    "child_turn_id",
    "park_chain",
    "parent_cancel",
    "parse_child_input",
    "refuse_reserved",
]

CHILD_INPUT_PREFIX = "child:"
"""Input ids under this prefix are reserved: answered by the child turn they name, never by a person."""
CHILD_POLICY = "june:child-turn"
"""The answerer policy of a child request; only :func:`child_grant` satisfies it (no ``authorize_answer`` is asked)."""


def child_session_id(parent_session: str, child_turn: str, call_id: str) -> str:
    """The session of a call's child turn: ``"<parent session>:sub:<call id>.<12 hex digits>"``, the digits from the
    child turn id (:func:`child_turn_id`: derived from the parent turn), so two turns of one session that reuse a
    call id (a scripted model, a provider that numbers calls per reply) get two child sessions, not one."""
    return f"{parent_session}:sub:{call_id}.{child_turn[3:15]}"


def child_turn_id(parent: SessionRef, parent_turn_id: str, call_id: str) -> str:
    """The child turn of one call, the same in every run of the call (and in every process)."""
    digest = hashlib.sha256(f"{parent.agent}\x1f{parent.session}\x1f{parent_turn_id}\x1f{call_id}".encode()).hexdigest()
    return f"t_c{digest[:40]}"


def child_input_id(child: SessionRef, turn_id: str) -> str:
    return f"{CHILD_INPUT_PREFIX}{child.agent}:{turn_id}"


def parse_child_input(input_id: str) -> tuple[str, str] | None:
    """(child agent, child turn id) of a reserved request id, or None for any other id."""
    if not input_id.startswith(CHILD_INPUT_PREFIX):
        return None
    agent, sep, turn_id = input_id[len(CHILD_INPUT_PREFIX) :].partition(":")
    return (agent, turn_id) if sep and agent and turn_id else None


def children_of_park(ref: SessionRef, parked: SuspendedCheckpoint) -> list[tuple[SessionRef, str]]:
    """The child sessions and turns a parked turn waits for (one per open ``child:`` request), in call order."""
    out: list[tuple[SessionRef, str]] = []
    for open_input in parked.inputs():
        found = parse_child_input(open_input.request.id)
        if found is not None:
            agent, turn_id = found
            out.append((SessionRef(agent, child_session_id(ref.session, turn_id, open_input.call_id)), turn_id))
    return out


def park_chain(
    store: SessionStore, ref: SessionRef, *, limit: int = 32
) -> list[tuple[SessionRef, SuspendedCheckpoint]]:
    """The session's park and, for each child turn it waits for, the child session's park, all the way down
    (breadth first): every request of the tree, the ones a person answers among them."""
    out: list[tuple[SessionRef, SuspendedCheckpoint]] = []
    todo = [ref]
    while todo and len(out) < limit:
        at = todo.pop(0)
        parked = store.pending(at)
        if parked is None:
            continue
        out.append((at, parked))
        todo.extend(child for child, _ in children_of_park(at, parked))
    return out


def refuse_reserved(input_id: str, child_turn: str | None) -> None:
    """Refuse a person's answer to a child request, and a child's answer to anything but its own request."""
    found = parse_child_input(input_id)
    if child_turn is None:
        if found is not None:
            raise ResumeAuthorizationError(
                f"input {input_id!r} is answered by its child turn {found[1]} (agent {found[0]}) when that turn "
                "ends; nobody can answer it. Cancel or reset the session to stop waiting"
            )
        return
    if found is None or found[1] != child_turn:
        raise ResumeConflictError(f"input {input_id!r} is not the request of child turn {child_turn}")


def child_grant(child_turn: str) -> Grant:
    """The grant a child turn's own answer carries (it satisfies the reserved request's policy)."""
    return Grant(policy=CHILD_POLICY, scope=child_turn, by=None)


def child_answer(rec: TurnRecord, result: TurnResult) -> dict[str, JsonValue]:
    """What the parent's tool gets back: the child's status and its text, error or reason."""
    out: dict[str, JsonValue] = {
        "status": result.status,
        "agent": rec.agent,
        "session": rec.session,
        "turn_id": rec.turn_id,
    }
    if result.status == "completed":
        out["text"] = result.text
    elif result.status == "failed":
        out["error"] = result.error.message
    elif result.status in ("cancelled", "rejected"):
        out["reason"] = result.reason
    return out


def announce_child_park(
    store: SessionStore, rec: TurnRecord, parked: SuspendedCheckpoint, *, max_depth: int = 32
) -> list[tuple[SessionRef, list[TurnEvent]]]:
    """Tell the parent session (and its parents, up to the top) that the child turn ``rec`` parked on a request a
    person answers: a ``child.input_requested`` event on each ancestor's stream. Returns the committed events
    for the caller to publish. Written after the child's park commit: a crash in between leaves it untold
    (the park itself is durable, and :func:`park_chain` finds it)."""
    asked = [i.request for i in parked.inputs() if parse_child_input(i.request.id) is None]
    if not asked:
        return []  # parked on its own children only: they tell
    out: list[tuple[SessionRef, list[TurnEvent]]] = []
    link = rec.payload.parent
    while link is not None and len(out) < max_depth:
        ref = SessionRef(link.agent, link.session)
        events: list[TurnEvent] = [
            ChildInputRequested(
                turn_id=link.turn_id,
                child_agent=rec.agent,
                child_session=rec.session,
                child_turn_id=rec.turn_id,
                request=request,
            )
            for request in asked
        ]
        out.append((ref, store.commit(ref, Commit(events=events))))
        above = store.get_turn(ref, link.turn_id)
        link = above.payload.parent if above is not None else None
    return out


class ChildLauncher(Protocol):
    """How a host runs a child turn once it is recorded: the in-process runtime kicks the session, a worker
    sends ``june.turn`` (any worker may run it)."""

    @property
    def agents(self) -> Collection[str]:
        """The agents a child may be started on."""
        ...

    def launch(self, rec: TurnRecord) -> None: ...


def cancel_children(
    store: SessionStore, parent: SessionRef, parent_turn_ids: Collection[str], agents: Collection[str]
) -> list[tuple[SessionRef, list[str]]]:
    """Durably ask the unfinished child turns (and theirs, all the way down) of these turns to stop.

    Returns what was marked, per child session, for the caller to signal. A child parked on children of its own
    that are still running is cancelled through them (:func:`cancel_parked`). A child parked on a person only
    stays parked (the store never cancels a parked turn); its parent no longer waits for it once cancelled.
    """
    marked: list[tuple[SessionRef, list[str]]] = []
    for turn_id in parent_turn_ids:
        marked.extend(_mark(store, _reached(store, parent, turn_id, agents)))
    return marked


def cancel_parked(
    store: SessionStore, ref: SessionRef, turn_id: str, reason: str, agents: Collection[str]
) -> list[tuple[SessionRef, list[str]]]:
    """Cancel the parked turn ``turn_id`` through its child turns: when a cancel reaches an unfinished turn under
    it, the parked turn's own cancel is stored first (:attr:`Commit.cancel_reason`: it ends ``cancelled`` when it
    next runs, and the answer that wakes it closes its whole park), then the turns under it are marked.

    Returns the child turns marked, per session; empty when the turn waits on people only (nothing is marked
    then: a parked turn is never cancelled).
    """
    below = _reached(store, ref, turn_id, agents)
    if not below:
        return []
    store.commit(ref, Commit(turn_id=turn_id, cancel_reason=reason))
    return _mark(store, below)


def _reached(
    store: SessionStore, ref: SessionRef, turn_id: str, agents: Collection[str], depth: int = 0
) -> list[tuple[SessionRef, TurnRecord]]:
    """The child turns under ``turn_id`` a cancel reaches, each before the turns under it: the unfinished ones, and
    the parked ones with an unfinished turn under them."""
    out: list[tuple[SessionRef, TurnRecord]] = []
    if depth >= 32:
        return out
    for child in store.child_turns(ref, turn_id, agents):
        if child.status not in UNFINISHED_TURN_STATUSES and child.status != "suspended":
            continue
        child_ref = SessionRef(child.agent, child.session)
        below = _reached(store, child_ref, child.turn_id, agents, depth + 1)
        if child.status in UNFINISHED_TURN_STATUSES or below:
            out.append((child_ref, child))
            out.extend(below)
    return out


def _mark(store: SessionStore, reached: list[tuple[SessionRef, TurnRecord]]) -> list[tuple[SessionRef, list[str]]]:
    marked: list[tuple[SessionRef, list[str]]] = []
    for child_ref, child in reached:
        if child.status == "suspended":  # parked on its own children: its cancel is stored with the park
            store.commit(child_ref, Commit(turn_id=child.turn_id, cancel_reason="parent"))
            ids = [child.turn_id]
        else:
            ids = store.request_cancel(child_ref, "parent", turn_ids=[child.turn_id])
        if ids:
            marked.append((child_ref, ids))
    return marked


ENDS_CHILDREN: frozenset[str] = frozenset({"failed", "cancelled", "rejected"})
"""A turn that ends so cancels its unfinished child turns (reason ``parent``): nobody reads their results any
more. A completed turn leaves them be (a child started with ``wait=False`` outlives its parent)."""


def parent_cancel(result: TurnResult) -> str | None:
    """The cancel a child turn's answer carries to its parked parent: a child cancelled because its parent was
    (reason ``parent``) wakes the parent to end cancelled too, whatever else its park still waits for."""
    return "requested" if isinstance(result, Cancelled) and result.reason == "parent" else None


class Delegator:
    """``ctx.delegate`` for the tools of one turn run."""

    def __init__(
        self,
        *,
        agent: Agent,
        store: SessionStore,
        launcher: ChildLauncher,
        ref: SessionRef,
        record: TurnRecord,
        steps: Collection[str],
        broker: InputBroker,
        crash: Callable[[str, str], None] | None,
        blocking: Blocking = inline,
    ) -> None:
        self._agent = agent
        self._blocking = blocking
        self._store = store
        self._launcher = launcher
        self._ref = ref
        self._record = record
        self._steps = steps
        self._broker = broker
        self._crash = crash
        self.started: dict[str, tuple[SessionRef, str]] = {}
        """The child session and turn each call delegated to in this run, by call id (for its events)."""

    async def delegate(self, ctx: ToolContext, *, agent: str, text: str, wait: bool) -> dict[str, JsonValue]:
        if ctx.is_sync:
            raise SyncParkError(
                f"tool {ctx.call.name!r} runs sync (def); only an async tool can delegate to a child agent"
            )
        if agent not in self._launcher.agents:
            raise DelegationError(
                f"cannot delegate to agent {agent!r}: this host serves {sorted(self._launcher.agents)}"
            )
        if not isinstance(text, str) or not text:
            raise DelegationError("delegate needs the child's text (a non-empty string)")
        parent_link = self._record.payload.parent
        depth = (parent_link.depth if parent_link is not None else 0) + 1
        limit = self._agent.max_child_depth
        if depth > limit:
            raise DelegationError(
                f"cannot delegate to {agent!r}: the child would be at depth {depth}, and agent {self._agent.name} "
                f"allows {limit} (max_child_depth)"
            )
        unstorable = unstorable_reason({"text": text})
        if unstorable is not None:
            raise DelegationError(f"cannot delegate to {agent!r}: the text cannot be stored ({unstorable})")
        turn_id = child_turn_id(self._ref, ctx.turn_id, ctx.call.id)
        child = SessionRef(agent, child_session_id(self._ref.session, turn_id, ctx.call.id))
        try:
            validate_session_id(child.session)
        except ValueError as exc:
            raise DelegationError(f"cannot delegate to {agent!r}: the child session id is not usable ({exc})") from None
        input_id = child_input_id(child, turn_id)
        request = PolicyAnswerer(policy=CHILD_POLICY, scope=turn_id)
        prompt = f"waiting for child turn {turn_id} of {agent} (session {child.session})"
        if wait and input_step_id(ctx.turn_id, input_id) in self._steps:
            self.started[ctx.call.id] = (child, turn_id)
            return dict(await self._ask(ctx, input_id, prompt, request))  # answered: the replay after the resume
        found = await self._blocking(lambda: self._store.get_turn(child, turn_id))
        if found is None:
            started = await self._blocking(
                lambda: self._store.child_turns(self._ref, ctx.turn_id, self._launcher.agents)
            )
            cap = self._agent.max_children_per_turn
            if len({t.turn_id for t in started} - {turn_id}) >= cap:
                raise DelegationError(
                    f"cannot delegate to {agent!r}: this turn started {len(started)} child turns, and agent "
                    f"{self._agent.name} allows {cap} per turn (max_children_per_turn)"
                )
            link = ParentLink(
                agent=self._ref.agent, session=self._ref.session, turn_id=ctx.turn_id, call_id=ctx.call.id, depth=depth
            )
            # the parent's queue: its workers serve this host's agents, the child's among them
            payload = TurnPayload(
                text=text, parent=link, trace=self._record.payload.trace, queue=self._record.payload.queue
            )
            recorded, created = await self._blocking(lambda: self._store.enqueue_turn(child, turn_id, payload))
            if created and self._crash is not None:
                self._crash("after-child-start", ctx.step)
            found = recorded
        rec = found
        self.started[ctx.call.id] = (child, turn_id)
        if rec.status in UNFINISHED_TURN_STATUSES:
            await self._blocking(lambda: self._launcher.launch(rec))  # a broker publish, on a worker
        if not wait:
            return {"status": "started", "agent": agent, "session": child.session, "turn_id": turn_id}
        if rec.status in ENDED_TURN_STATUSES and rec.result is not None:
            return child_answer(rec, rec.result)  # it ended before we parked: no need to
        return dict(await self._ask(ctx, input_id, prompt, request))

    async def _ask(
        self, ctx: ToolContext, input_id: str, prompt: str, answerers: PolicyAnswerer
    ) -> dict[str, JsonValue]:
        answer = await self._broker.ask(
            ctx, id=input_id, prompt=prompt, schema=None, answerers=answerers, timeout_s=None
        )
        if not isinstance(answer, dict):
            raise DelegationError(f"child request {input_id!r} was answered with {type(answer).__name__}, not a result")
        return answer
