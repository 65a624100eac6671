"""june-worker: AI-agent turns as durable processes, on Celery, Postgres and Redis.

The public names for building agents and running them in process. The Celery app lives in
:mod:`june_worker.worker` (``celery -A june_worker.worker ...``).
"""

from .engine import (
    Agent,
    AgentSession,
    Runtime,
    Tool,
    ToolContext,
    store_write,
    tool,
)
from .engine.context import ContextPolicy
from .errors import FatalToolError
from .schedules import schedule

__all__ = [
    "Agent",
    "AgentSession",
    "ContextPolicy",
    "FatalToolError",
    "Runtime",
    "Tool",
    "ToolContext",
    "schedule",
    "store_write",
    "tool",
]
__version__ = "0.1.0"
