"""The turn engine: pure Python, no infrastructure imports. See :mod:`june_worker.engine.loop`."""

from june_wire.ids import new_turn_id

from .agent import Agent, AnswerRequest
from .crash import CrashAt
from .events import (
    Cancelled,
    Completed,
    Failed,
    Rejected,
    Suspended,
    TurnEvent,
    TurnEventAdapter,
    TurnResult,
    TurnResultAdapter,
)
from .loop import TurnRunner
from .model import Done, Model, ModelRequest, ReasoningChunk, TextChunk, ToolSpec
from .resume import Grant
from .session import AgentSession, Runtime
from .sink import EventSink
from .store import SessionRef, SessionStore
from .tools import Tool, ToolContext, store_write, tool

__all__ = [
    "Agent",
    "AgentSession",
    "AnswerRequest",
    "Cancelled",
    "Completed",
    "CrashAt",
    "Done",
    "EventSink",
    "Failed",
    "Grant",
    "Model",
    "ModelRequest",
    "ReasoningChunk",
    "Rejected",
    "Runtime",
    "SessionRef",
    "SessionStore",
    "Suspended",
    "TextChunk",
    "Tool",
    "ToolContext",
    "ToolSpec",
    "TurnEvent",
    "TurnEventAdapter",
    "TurnResult",
    "TurnResultAdapter",
    "TurnRunner",
    "new_turn_id",
    "store_write",
    "tool",
]
