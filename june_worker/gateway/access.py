"""Who may use a session over HTTP: the owner rule, operators, prefixes, and the app's hook.

Every route that names a session decides, before anything else, whether the caller may use it
for one of six actions: ``start`` (a turn), ``follow`` (its events or a turn's status),
``pending``, ``resume``, ``cancel``, ``reset``. In this order:

1. an **operator** (``"role": "operator"`` in the token map) may use every session of its agents;
2. the app's hook ``authorize_session(principal, agent, session, action)``, when configured,
   decides when it answers True or False (None: no opinion, go on);
3. a principal confined to **session-id prefixes** (``"sessions": [...]``) may use no id outside them;
4. a session with an **owner** (the principal that opened it through a gateway) is its owner's;
   a **child session** (``ctx.delegate``: ``<parent session>:sub:...``, whose turn links to its parent)
   without one is its top parent's owner's, for every action but ``start`` (its turns come from its
   parent), so a person can follow and answer what their turn's subagents ask;
5. a session without one is usable by a principal with prefixes (it lies in its namespace);
   otherwise only ``start`` may use it, and only while it **does not exist**: that turn opens it,
   and the caller becomes its owner.

A refusal is the same 404 the route gives for a session that does not exist, word for word, and
costs the same lookups (the owner, the store and the sent set are always read), so the answer
says nothing about whether the session exists.

The rule a reader must not break: **decide before acting**; no route sends, reads or streams
anything of a session before :func:`allowed` said yes.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

from ..errors import JuneError
from .auth import Principal

__all__ = ["ACTIONS", "Action", "AuthorizeSession", "HookFailed", "SessionState", "allowed", "default_rule"]

log = logging.getLogger("june_worker.gateway")

Action: TypeAlias = Literal["start", "follow", "pending", "resume", "cancel", "reset"]
ACTIONS: tuple[Action, ...] = ("start", "follow", "pending", "resume", "cancel", "reset")

AuthorizeSession: TypeAlias = Callable[[Principal, str, str, str], "bool | None | Awaitable[bool | None]"]
"""``authorize_session(principal, agent, session, action)``: True allows, False refuses, None defers."""


class HookFailed(JuneError):
    """The app's ``authorize_session`` hook raised, or answered something other than True, False or None."""


@dataclass(frozen=True)
class SessionState:
    """What the gateway knows of a session: who opened it here (if a gateway did), and whether it exists.

    ``parent_owner``: for a child session (a subagent's), the owner of the nearest ancestor session that has one.
    """

    owner: str | None
    exists: bool
    parent_owner: str | None = None


def default_rule(principal: Principal, session: str, action: Action, state: SessionState) -> bool:
    """Steps 3-5 of the module docstring: prefixes, then the owner, then opening a new session."""
    if not principal.may_address(session):
        return False
    if state.owner is not None:
        return state.owner == principal.id
    if state.parent_owner is not None:  # a child session: its parent's owner's, but only its parent starts turns
        return action != "start" and state.parent_owner == principal.id
    if principal.session_prefixes is not None:
        return True
    return action == "start" and not state.exists


async def allowed(
    principal: Principal,
    agent: str,
    session: str,
    action: Action,
    state: SessionState,
    hook: AuthorizeSession | None,
    run_blocking: Callable[[Callable[[], object]], Awaitable[object]],
) -> bool:
    """Whether ``principal`` may ``action`` the session. A sync hook runs in a worker thread."""
    if principal.operator:
        return True
    if hook is not None:
        try:
            if inspect.iscoroutinefunction(hook):
                decision: object = await hook(principal, agent, session, action)
            else:
                decision = await run_blocking(lambda: hook(principal, agent, session, action))
                if inspect.isawaitable(decision):
                    decision = await decision
        except Exception as exc:
            log.error("authorize_session raised on %s of %s:%s for %s", action, agent, session, principal.id,
                      exc_info=True)  # fmt: skip
            raise HookFailed(f"authorize_session raised {type(exc).__name__}") from exc
        if decision is True or decision is False:
            return decision
        if decision is not None:
            log.error("authorize_session answered %s on %s of %s:%s", type(decision).__name__, action, agent, session)
            raise HookFailed(f"authorize_session answered {type(decision).__name__}; expected True, False or None")
    return default_rule(principal, session, action, state)
