"""An agent: instructions, tools, a model, and per-source turn policies.

A turn's inbound ``source`` (``slack``, ``web``...) picks a :class:`SurfacePolicy`: an
overlay appended to (or replacing) the system prompt, and tools denied to that source.
Denial is enforced in code: a denied tool is not offered to the model, and a call to it
fails as an unknown tool, so no prompt can talk the model into it.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import tomllib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AgentDefinitionError
from .context import ContextPolicy
from .ids import validate_session_id
from .model import Model
from .secrets import scrubbed_logger
from .store import SurfacePolicy
from .tools import Tool, tool_name_problem
from .types import InboundEvent, Principal

__all__ = ["Agent", "AnswerRequest", "AuthorizeAnswer", "Deliver", "deliver_result", "derive_policies"]

log = scrubbed_logger("june_worker.agent")


@dataclass(frozen=True)
class AnswerRequest:
    """What ``authorize_answer`` decides on: may ``by`` answer this ``{policy, scope}`` request?"""

    policy: str
    scope: str | None
    by: str | None
    principal: Principal | None
    turn_id: str
    input_id: str
    session: str


AuthorizeAnswer = Callable[[AnswerRequest], "bool | Awaitable[bool]"]
Deliver = Callable[..., Any]
"""``deliver(target=..., result=..., events=..., session=...)``: render a finished turn to a target."""


@dataclass
class Agent:
    """Everything needed to run an agent's turns, independent of where they run.

    ``context``: how the agent's requests stay inside its model's context window (:class:`ContextPolicy`):
    by default, compact the transcript past 80 % of the window the model declares (a model that declares
    none, like the scripted one, is never compacted); ``None`` turns it off.

    ``parallel_tools``: how many of one reply's **async** tool calls run at once. 1 (the default) runs
    every call in turn, as the June reference does; above 1, the async calls of a batch run
    concurrently, that many at a time, each committing its own result as it finishes; sync calls still
    run one at a time, each in its own transaction, and the model reads the results in call order.
    """

    name: str
    model: Model
    instructions: str = ""
    tools: list[Tool] = field(default_factory=list)
    policies: Mapping[str, SurfacePolicy | str] = field(default_factory=dict)
    authorize_answer: AuthorizeAnswer | None = None
    deliver: Deliver | None = None
    context: ContextPolicy | None = field(default_factory=ContextPolicy)
    parallel_tools: int = 1
    max_child_depth: int = 3
    """How deep ``ctx.delegate`` may nest: a child of a top-level turn is depth 1 (docs/subagents.md)."""
    max_children_per_turn: int = 16
    """How many child turns one turn of this agent may start (``ctx.delegate``)."""

    def __post_init__(self) -> None:
        for limit in ("max_child_depth", "max_children_per_turn"):
            value = getattr(self, limit)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise AgentDefinitionError(f"agent {self.name}: {limit} must be a whole number >= 0, not {value!r}")
        if isinstance(self.parallel_tools, bool) or not isinstance(self.parallel_tools, int) or self.parallel_tools < 1:
            raise AgentDefinitionError(
                f"agent {self.name}: parallel_tools must be a whole number of at least 1, not {self.parallel_tools!r}"
            )
        validate_session_id(self.name, what="agent name")
        if ":" in self.name:
            raise AgentDefinitionError(f"agent name {self.name!r} must not contain ':'")
        for t in self.tools:
            problem = tool_name_problem(t.name)
            if problem is not None:
                raise AgentDefinitionError(f"agent {self.name}: {problem}")
        names = [t.name for t in self.tools]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise AgentDefinitionError(f"agent {self.name}: duplicate tool names {dupes}")
        self._tools = {t.name: t for t in self.tools}

    # --- policy -------------------------------------------------------------------------------

    def policy_for(self, event: InboundEvent | None) -> SurfacePolicy | None:
        if event is None:
            return None
        entry = self.policies.get(event.source)
        if entry is None:
            return None
        if isinstance(entry, str):
            return SurfacePolicy(source=event.source, overlay=entry)
        return entry if entry.source else entry.model_copy(update={"source": event.source})

    def system_prompt(self, policy: SurfacePolicy | None) -> str:
        if policy is None or policy.overlay is None:
            return self.instructions
        if policy.mode == "replace":
            return policy.overlay
        return f"{self.instructions}\n\n{policy.overlay}" if self.instructions else policy.overlay

    def tools_for(self, policy: SurfacePolicy | None, principal: Principal | None) -> dict[str, Tool]:
        """The tools this turn may see and call: minus denied ones, minus principal-gated ones."""
        denied = set(policy.deny_tools) if policy else set()
        return {
            name: t
            for name, t in self._tools.items()
            if name not in denied and (principal is not None or not t.requires_principal)
        }

    # --- assembly from a directory ---------------------------------------------------------------

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        *,
        model: Model,
        tools: Iterable[Tool] | None = None,
        known_sources: Iterable[str] | None = None,
        authorize_answer: AuthorizeAnswer | None = None,
        deliver: Deliver | None = None,
    ) -> Agent:
        """Assemble an agent from ``instructions.md``, ``instructions.<source>.md`` and ``agent.toml``.

        ``agent.toml`` may set ``name``, ``[surfaces.<source>]`` tables with ``mode``
        (``append`` or ``replace``) and ``deny_tools``, and a ``[context]`` table with the
        :class:`ContextPolicy` numbers (``window_tokens``, ``compact_at``, ``keep``, ``chars_per_token``,
        ``message_chars``) or ``enabled = false``. Tools come from ``tools`` or, when
        not given, from the ``Tool`` objects defined in ``tools/*.py``.
        """
        root = Path(path)
        if not root.is_dir():
            raise AgentDefinitionError(f"agent directory {root} does not exist")
        config: dict[str, Any] = {}
        toml_path = root / "agent.toml"
        if toml_path.exists():
            try:
                config = tomllib.loads(toml_path.read_text())
            except tomllib.TOMLDecodeError as exc:
                raise AgentDefinitionError(f"{toml_path}: {exc}") from exc
        base = root / "instructions.md"
        instructions = base.read_text().strip() if base.exists() else ""
        variants = {
            p.name[len("instructions.") : -len(".md")]: p.read_text().strip()
            for p in sorted(root.glob("instructions.*.md"))
        }
        try:
            policies = derive_policies(
                variants=variants,
                surfaces=config.get("surfaces", {}),
                legacy=config.get("policies", {}),
                known_sources=known_sources,
            )
        except AgentDefinitionError as exc:
            raise AgentDefinitionError(f"agent directory {root}: {exc}") from None
        return cls(
            name=config.get("name", root.name),
            model=model,
            instructions=instructions,
            tools=list(tools) if tools is not None else _load_tools(root / "tools"),
            policies=policies,
            authorize_answer=authorize_answer,
            deliver=deliver,
            context=_context_policy(config.get("context", {}), toml_path),
        )


def derive_policies(
    *,
    variants: Mapping[str, str],
    surfaces: Mapping[str, Mapping[str, Any]] | None = None,
    legacy: Mapping[str, str] | None = None,
    known_sources: Iterable[str] | None = None,
) -> dict[str, SurfacePolicy | str]:
    """Per-source policies from variant files, ``surfaces`` settings and legacy string overlays.

    A source is given in one place only: a legacy ``[policies]`` entry for a source that also has
    an ``instructions.<source>.md`` variant or a ``[surfaces.<source>]`` table is an error naming
    both, never silently resolved.
    """
    surfaces = surfaces or {}
    legacy = legacy or {}
    for source in sorted(set(legacy) & (set(variants) | set(surfaces))):
        other = f"instructions.{source}.md" if source in variants else f"[surfaces.{source}] in agent.toml"
        raise AgentDefinitionError(
            f"the policy for source {source!r} is given twice: by {other} and by policies.{source} "
            f"([policies] in agent.toml); keep one of them"
        )
    policies: dict[str, SurfacePolicy | str] = dict(legacy)
    for source in sorted(set(variants) | set(surfaces)):
        settings = dict(surfaces.get(source, {}))
        mode = settings.pop("mode", None)
        deny = settings.pop("deny_tools", [])
        if settings:
            raise AgentDefinitionError(f"surfaces.{source}: unknown settings {sorted(settings)}")
        if mode not in (None, "append", "replace"):
            raise AgentDefinitionError(f"surfaces.{source}.mode must be 'append' or 'replace', not {mode!r}")
        if mode is not None and source not in variants:
            raise AgentDefinitionError(
                f"surfaces.{source} sets mode {mode!r} but instructions.{source}.md does not exist"
            )
        policies[source] = SurfacePolicy(
            source=source, overlay=variants.get(source), mode=mode or "append", deny_tools=list(deny)
        )
    if known_sources is not None:
        known = set(known_sources)
        for source in sorted(set(policies) - known):
            log.warning("policy for source %r: no channel emits that source, so it never applies", source)
    return policies


_CONTEXT_KEYS = frozenset({"window_tokens", "compact_at", "keep", "chars_per_token", "message_chars", "enabled"})


def _context_policy(table: Any, where: Path) -> ContextPolicy | None:
    """The ``[context]`` table of ``agent.toml`` as a policy (absent: the default one)."""
    if not isinstance(table, dict):
        raise AgentDefinitionError(f"{where}: [context] must be a table")
    unknown = sorted(set(table) - _CONTEXT_KEYS)
    if unknown:
        raise AgentDefinitionError(f"{where}: [context] has unknown settings {unknown}; known: {sorted(_CONTEXT_KEYS)}")
    settings = dict(table)
    if settings.pop("enabled", True) is False:
        return None
    try:
        return ContextPolicy(**settings)
    except TypeError as exc:
        raise AgentDefinitionError(f"{where}: [context]: {exc}") from None


def _load_tools(folder: Path) -> list[Tool]:
    if not folder.is_dir():
        return []
    found: list[Tool] = []
    for file in sorted(folder.glob("*.py")):
        if file.name.startswith("_"):
            continue
        mod_name = f"_june_agent_tools_{abs(hash(str(file)))}_{file.stem}"
        spec = importlib.util.spec_from_file_location(mod_name, file)
        if spec is None or spec.loader is None:
            raise AgentDefinitionError(f"cannot import tool module {file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
        found.extend(v for v in vars(module).values() if isinstance(v, Tool))
    return found


async def deliver_result(
    agent: Agent, *, target: Mapping[str, Any], result: Any, events: list[Any], session: str
) -> None:
    """Render a turn to its ``target`` with the agent's ``deliver`` hook. A missing hook is an error."""
    if agent.deliver is None:
        raise AgentDefinitionError(f"agent {agent.name} has no deliver hook, so a target cannot be rendered")
    out = agent.deliver(target=dict(target), result=result, events=events, session=session)
    if inspect.isawaitable(out):
        await out
