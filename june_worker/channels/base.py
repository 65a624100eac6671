"""The channel seam: how people reach an agent (inbound) and how a turn reaches them (outbound).

A **channel** has two sides, used by different processes:

* **inbound**, in the process that receives the channel's request (the gateway): a request it
  verified becomes an :class:`InboundTurn` (start a turn: session, turn id derived from the
  request so a retry is the same turn, the normalised :class:`~june_worker.engine.types.InboundEvent`,
  the ``target`` to render to) or an :class:`InboundAnswer` (a click answering a parked turn,
  with the clicker's verified id). That process only verifies, enqueues and answers.
* **outbound**, in the worker that runs the turn: :meth:`Channel.renderer` gives a
  :class:`Renderer` for one run of a turn with a ``target``. The worker feeds it the turn's
  events while it runs (live, where the channel can), then calls :meth:`Renderer.finish` with the
  stored events, **at least once** (the turn's ``deliver_due`` mark, re-sent by the sweeper until
  it succeeds). ``finish`` must converge: it reads what earlier attempts did from the
  :class:`RenderState` (keyed by turn) and updates the same messages, so a worker killed
  mid-render leaves one complete reply, never two. :meth:`Channel.notify` tells one person a short
  note (a refused answer). A proactive turn is rendered the same way: its ``target`` names a place
  rather than a thread.

:class:`Channels` routes a target to its channel by ``target["channel"]`` and is what an agent
takes as its ``deliver`` hook (``Agent(deliver=Channels([...]))``); the worker recognises it and
renders live, with state in Postgres. The engine knows none of this: a channel is wired in through
the turn's ``target`` and the agent's ``deliver`` hook, which the engine already had.

A process that only receives (the gateway) builds the agents to learn their names and hooks, inside
:func:`receiving_only`: a channel built there need not hold what posting takes (a bot token), and
never renders.

The rule a reader must not break: **a renderer never raises into the turn**. Live rendering
failures are logged and left to ``finish``; ``finish`` raises only for a failure worth another
attempt (:class:`~june_worker.errors.ChannelError` with ``retryable``), which keeps the delivery due.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..engine.events import TurnEvent, TurnResult
from ..engine.types import InboundEvent, JsonValue
from ..errors import ConfigError

__all__ = [
    "Channel",
    "Channels",
    "InboundAnswer",
    "InboundTurn",
    "MemoryRenderState",
    "RenderContext",
    "RenderState",
    "Renderer",
    "is_receiving_only",
    "receiving_only",
]


_RECEIVING_ONLY: ContextVar[bool] = ContextVar("june_channels_receiving_only", default=False)


@contextmanager
def receiving_only() -> Iterator[None]:
    """Build agents for a process that only receives and enqueues (the gateway): their channels will not post."""
    token = _RECEIVING_ONLY.set(True)
    try:
        yield
    finally:
        _RECEIVING_ONLY.reset(token)


def is_receiving_only() -> bool:
    """Whether channels are being built inside :func:`receiving_only` (a missing bot token is then no error)."""
    return _RECEIVING_ONLY.get()


_MEMORY_TURNS = 10_000
"""Turns whose render state an in-process ``Channels`` hook keeps (the oldest are forgotten)."""

# --- inbound ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InboundTurn:
    """A verified request that starts a turn."""

    session: str
    turn_id: str
    """Derived from the request (a retried delivery is the same turn, which the worker runs once)."""
    text: str
    event: InboundEvent
    target: dict[str, JsonValue]
    """Where the worker renders the turn (``{"channel": "<name>", ...}``)."""
    replace: bool = False
    """Cancel the session's running turn in favour of this one (never a parked approval)."""


@dataclass(frozen=True)
class InboundAnswer:
    """A verified click (or reply) that answers a parked turn's input, by a verified identity."""

    session: str
    turn_id: str
    input_id: str
    value: JsonValue
    by: str
    reply_to: dict[str, JsonValue]
    """Where the worker tells the answerer, and only them, that the answer was refused."""


# --- outbound ---------------------------------------------------------------------------------------


class RenderState(Protocol):
    """What earlier attempts at rendering one turn left, by slot (``reply``, ``prompt:<id>``...)."""

    def get(self, slot: str) -> dict[str, JsonValue] | None: ...

    def put(self, slot: str, data: dict[str, JsonValue]) -> None:
        """Record ``data`` under ``slot`` at once (durably, where the host can): a crash right after keeps it."""
        ...


class MemoryRenderState:
    """Render state in a dict: the in-process runtime and tests (a restart forgets it)."""

    def __init__(self, slots: Mapping[str, dict[str, JsonValue]] | None = None) -> None:
        self.slots: dict[str, dict[str, JsonValue]] = dict(slots or {})
        self._lock = threading.Lock()

    def get(self, slot: str) -> dict[str, JsonValue] | None:
        with self._lock:
            found = self.slots.get(slot)
            return dict(found) if found is not None else None

    def put(self, slot: str, data: dict[str, JsonValue]) -> None:
        with self._lock:
            self.slots[slot] = dict(data)


@dataclass
class RenderContext:
    """One run of one turn, as its renderer sees it."""

    agent: str
    session: str
    turn_id: str
    state: RenderState
    history: list[TurnEvent] = field(default_factory=list)
    """The turn's structural events committed before this run's renderer was made (a replay, a resume)."""


class Renderer(Protocol):
    """Renders one run of a turn to one target. Called from one thread at a time."""

    live: bool
    """Whether :meth:`feed` / :meth:`push` do anything (False: the channel posts once, in :meth:`finish`)."""

    interval_s: float
    """Push at most this often while a run streams (a run's end is pushed at once)."""

    def feed(self, event: TurnEvent) -> None:
        """Take one event of the running turn (deltas included), in order."""
        ...

    def push(self) -> None:
        """Bring the channel up to what was fed. Never raises."""
        ...

    def abort(self) -> None:
        """Make no channel call from now on, from any thread (a call in flight ends as it would): the live render
        overran its time and the delivery takes over. ``finish`` on another renderer is not affected."""
        ...

    def finish(self, events: Sequence[TurnEvent], result: TurnResult) -> None:
        """Converge the channel on the stored events of the turn (every run). At least once: idempotent."""
        ...


@runtime_checkable
class Channel(Protocol):
    """One way to reach people: its ``name`` is the target's ``channel`` and the inbound ``source``."""

    name: str

    def renderer(self, target: Mapping[str, JsonValue], ctx: RenderContext) -> Renderer: ...

    def notify(self, target: Mapping[str, JsonValue], text: str) -> None:
        """Tell the person ``target`` names (only them, where the channel can) a short note."""
        ...


class Channels:
    """The channels an agent is reached through; an agent's ``deliver`` hook.

    Called as a plain ``deliver`` hook (the in-process runtime), it renders post-once with state
    kept in memory; a worker instead asks it for a :meth:`renderer` with state in Postgres.
    """

    def __init__(self, channels: Iterable[Channel]) -> None:
        self.channels: dict[str, Channel] = {}
        for channel in channels:
            if channel.name in self.channels:
                raise ConfigError(f"two channels are named {channel.name!r}")
            self.channels[channel.name] = channel
        self._memory: OrderedDict[tuple[str, str], MemoryRenderState] = OrderedDict()

    def channel(self, target: Mapping[str, JsonValue]) -> Channel:
        name = target.get("channel")
        found = self.channels.get(name) if isinstance(name, str) else None
        if found is None:
            raise ConfigError(
                f"target names channel {name!r}, but this agent is reached through {sorted(self.channels)}; "
                'a target looks like {"channel": "<name>", ...}'
            )
        return found

    def renderer(self, target: Mapping[str, JsonValue], ctx: RenderContext) -> Renderer:
        return self.channel(target).renderer(target, ctx)

    def notify(self, target: Mapping[str, JsonValue], text: str) -> None:
        self.channel(target).notify(target, text)

    def __call__(self, *, target: Mapping[str, JsonValue], result: TurnResult, events: list[Any], session: str) -> None:
        """The plain ``deliver`` hook: converge the turn on ``target``, state in this process's memory."""
        key = (session, result.turn_id)
        state = self._memory.pop(key, None) or MemoryRenderState()
        self._memory[key] = state
        while len(self._memory) > _MEMORY_TURNS:
            self._memory.popitem(last=False)
        ctx = RenderContext(agent="", session=session, turn_id=result.turn_id, state=state)
        self.renderer(target, ctx).finish(events, result)
