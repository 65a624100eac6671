"""Model implementations: ``ScriptedModel`` (tests, demo) and ``AnthropicModel`` (the ``anthropic`` extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .scripted import Reply, ScriptedModel

if TYPE_CHECKING:
    from .anthropic import AnthropicModel

__all__ = ["AnthropicModel", "Reply", "ScriptedModel"]


def __getattr__(name: str) -> Any:
    if name == "AnthropicModel":
        from .anthropic import AnthropicModel

        return AnthropicModel
    raise AttributeError(name)
