"""``request_input``: answer from the stored steps, or park the turn.

Answers are turn-scoped (``input:<turnId>:<id>``). With no ``answerers``, the default
answerer is the turn's speaker, and only when the channel attests that identity; a turn with
no inbound event (proactive, programmatic) keeps no restriction.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import FatalToolError, InputTimeoutError
from .signals import ParkSignal
from .store import StepRecord, input_step_id
from .types import Answerers, InputRequest, JsonValue, UserAnswerer

if TYPE_CHECKING:
    from .tools import ToolContext

__all__ = ["InputBroker"]


class InputBroker:
    """Answers ``request_input`` from the stored steps, or raises :class:`ParkSignal`."""

    def __init__(self, steps: Mapping[str, StepRecord]) -> None:
        self._steps = steps

    async def ask(
        self,
        ctx: ToolContext,
        *,
        id: str,
        prompt: str,
        schema: dict[str, JsonValue] | None,
        answerers: Answerers | None,
        timeout_s: float | None,
    ) -> JsonValue:
        stored = self._steps.get(input_step_id(ctx.turn_id, id))
        if stored is not None:
            data = stored.data or {}
            if data.get("timeout"):
                raise InputTimeoutError(id)
            return data.get("answer")
        event = ctx.event
        # An event that names no speaker (session.start in process: source "api") has no default answerer, like a
        # turn with no event at all; a speaker the channel does not attest cannot be one.
        if answerers is None and event is not None and event.user is not None:
            if event.user is not None and event.user.attested:
                answerers = UserAnswerer(user=event.user.id)
            else:
                raise FatalToolError(
                    f"input {id!r}: the speaker of this {event.source} turn is not attested, so it cannot be the "
                    "default answerer; pass answerers={'user': ...} or {'policy': ...} to request_input"
                )
        expires_at = time.time() + timeout_s if timeout_s is not None else None
        raise ParkSignal(
            InputRequest(
                id=id,
                prompt=prompt,
                schema=schema,
                answerers=answerers,
                call_id=ctx.call.id,
                timeout_s=timeout_s,
                expires_at=expires_at,
            )
        )
