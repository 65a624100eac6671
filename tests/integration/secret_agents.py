"""Agents whose failing turns carry a credential in their exception's text, for the worker's log tests.

* ``leaky-tool``: its model calls ``leak``, which raises a FatalToolError naming :data:`TOOL_TOKEN` (a
  credential the tool holds and registers, as docs/anthropic.md asks of tools).
* ``leaky-model``: an :class:`AnthropicModel` on a look-alike client configured with :data:`MODEL_TOKEN`, whose
  every call raises a ``PermissionError`` naming it: an error the adapter passes through as it is.
* ``leaky-approval``: parks on an input answered by policy; its ``authorize_answer`` hook raises naming
  :data:`TOOL_TOKEN` (its directory refused the credential), so a resume is refused with ``error``.

Neither token is shaped like an Anthropic key: only registration can keep it out.
"""

from __future__ import annotations

from typing import Any

from june_worker import Agent, FatalToolError, ToolContext, tool
from june_worker.engine.agent import AnswerRequest
from june_worker.engine.secrets import register_secret
from june_worker.models import Reply, ScriptedModel
from june_worker.models.anthropic import AnthropicModel

__all__ = ["ALL", "MODEL_TOKEN", "TOOL_TOKEN"]

TOOL_TOKEN = "tooltoken-9d41c2e07b5a4f3e8c61"
MODEL_TOKEN = "proxytoken-5b2e8f1a9c7d4036be42"

register_secret(TOOL_TOKEN)


@tool
def leak(ctx: ToolContext) -> dict[str, Any]:
    """Call the upstream service, which refuses the credential."""
    raise FatalToolError(f"upstream refused credential {TOOL_TOKEN}")


class RefusingClient:
    """A look-alike SDK client: every request raises an error naming its key."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key
        self.messages = self

    def stream(self, **params: Any) -> Any:
        raise PermissionError(f"proxy refused api key {self.api_key}")


@tool
async def approve(ctx: ToolContext) -> dict[str, Any]:
    """Ask an operator to approve."""
    return {"ok": await ctx.request_input(id="approve", prompt="Approve?", answerers={"policy": "operator"})}


def _authorize(req: AnswerRequest) -> bool:
    raise RuntimeError(f"operator directory refused credential {TOOL_TOKEN}")


ALL = [
    Agent(
        name="leaky-tool",
        model=ScriptedModel([Reply("", calls=[{"id": "c1", "name": "leak", "input": {}}])]),
        tools=[leak],
    ),
    Agent(name="leaky-model", model=AnthropicModel(client=RefusingClient(MODEL_TOKEN))),
    Agent(
        name="leaky-approval",
        model=ScriptedModel([Reply("", calls=[{"id": "c1", "name": "approve", "input": {}}])]),
        tools=[approve],
        authorize_answer=_authorize,
    ),
]
