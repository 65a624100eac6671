"""Channels: how people reach an agent and how its turns reach them (see :mod:`.base` for the seam).

Slack (:mod:`.slack`, the ``slack`` extra) is the first; :mod:`.webhook` posts finished runs to a
URL and shows that a channel fits without touching the engine.
"""

from .base import (
    Channel,
    Channels,
    InboundAnswer,
    InboundTurn,
    MemoryRenderState,
    RenderContext,
    Renderer,
    RenderState,
    is_receiving_only,
    receiving_only,
)
from .view import Segment, fold

__all__ = [
    "Channel",
    "Channels",
    "InboundAnswer",
    "InboundTurn",
    "MemoryRenderState",
    "RenderContext",
    "RenderState",
    "Renderer",
    "Segment",
    "fold",
    "is_receiving_only",
    "receiving_only",
]
