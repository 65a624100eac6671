"""Tools: how they are declared, classified, validated and given their context.

The declaration decides the delivery guarantee, so classification must be exact:

* a plain ``def`` is **local**: it runs inside the step's transaction and its writes
  through ``ctx.store`` commit with the checkpoint, exactly once;
* an ``async def`` (also behind ``functools.partial``, decorators that set
  ``__wrapped__``, or an object whose ``__call__`` is async) is **remote**: awaited, then
  committed, at least once.

A sync tool that *returns* an awaitable is refused: its work would run outside the
transaction and its result would be lost.
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from june_wire.storable import storable_text

from ..errors import ConfigError, FatalToolError
from .model import ToolSpec
from .secrets import scrub
from .store import SessionRef, StoreHandle
from .types import Answerers, InboundEvent, JsonValue, PolicyAnswerer, Principal, ToolCall, UserAnswerer

if TYPE_CHECKING:
    from .children import Delegator
    from .inputs import InputBroker

__all__ = [
    "ERROR_MAX_CHARS",
    "NoTransactionHandle",
    "TOOL_NAME_RULE",
    "SyncToolReturnedAwaitableError",
    "Tool",
    "ToolContext",
    "ToolInputError",
    "format_tool_error",
    "is_async_callable",
    "store_write",
    "tool",
    "tool_name_problem",
]

ERROR_MAX_CHARS = 2000
TOOL_NAME_RULE = r"^[a-zA-Z0-9_-]{1,64}$"
"""What model APIs accept as a tool name (Anthropic's rule; OpenAI's is the same)."""
_TOOL_NAME = re.compile(TOOL_NAME_RULE)


def tool_name_problem(name: object) -> str | None:
    """Why a model API would refuse ``name`` as a tool name, or None when it is fine."""
    if isinstance(name, str) and _TOOL_NAME.fullmatch(name):
        return None
    return (
        f"tool {name!r}: a tool name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-' "
        f"({TOOL_NAME_RULE}), or model APIs refuse every request that offers it"
    )


class ToolInputError(ValueError):
    """The model's input does not match the tool's schema; the model reads this and can retry."""


class SyncToolReturnedAwaitableError(FatalToolError):
    """A plain ``def`` tool returned a coroutine or other awaitable."""


def is_async_callable(fn: object) -> bool:
    """True when calling ``fn`` gives a coroutine by declaration, whatever wraps it."""
    seen: set[int] = set()
    obj: object = fn
    while id(obj) not in seen:
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            obj = obj.func
            continue
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
            continue
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None and (inspect.isfunction(obj) or inspect.ismethod(obj)):
            if inspect.iscoroutinefunction(obj):
                return True
            obj = wrapped
            continue
        if inspect.iscoroutinefunction(obj):
            return True
        if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isbuiltin(obj):
            return False
        call = vars(type(obj)).get("__call__") or next(
            (vars(k)["__call__"] for k in type(obj).__mro__ if "__call__" in vars(k)), None
        )
        if call is None or inspect.isbuiltin(call) or call is type.__call__:
            return False
        obj = call
    return False


def format_tool_error(exc: BaseException) -> str:
    """What the model reads for a tool that raised: the message, class-prefixed unless plain.

    Never a traceback, never a secret (:mod:`.secrets`); cut to :data:`ERROR_MAX_CHARS` characters.
    """
    try:
        message = storable_text(scrub(str(exc)))
    except Exception:  # an exception whose __str__ raises is named by its class
        message = ""
    name = type(exc).__name__
    if type(exc) is not Exception:
        message = f"{name}: {message}" if message else name
    elif not message:
        message = name
    return message[:ERROR_MAX_CHARS]


class NoTransactionHandle:
    """The handle given where writes cannot join a transaction (memory store, async tools)."""

    def __init__(self, why: str) -> None:
        self._why = why

    def execute(self, sql: str, *params: Any) -> int:
        raise FatalToolError(self._why)

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        raise FatalToolError(self._why)

    def unwrap(self) -> Any:
        raise FatalToolError(self._why)


@dataclass
class ToolContext:
    """What a running tool knows about its turn, and how it reaches the store or a human."""

    turn_id: str
    session: SessionRef
    call: ToolCall
    step: str
    principal: Principal | None = None
    initiator: Principal | None = None
    event: InboundEvent | None = None
    store: StoreHandle = field(default_factory=lambda: NoTransactionHandle("no store handle in this context"))
    runtime: Any = None
    """The in-process runtime, for tools that drive a child session (subagents)."""
    is_sync: bool = False
    _broker: InputBroker | None = None
    _delegator: Delegator | None = None

    @property
    def session_id(self) -> str:
        return self.session.session

    def request_input(
        self,
        *,
        id: str,
        prompt: str,
        schema: dict[str, JsonValue] | None = None,
        answerers: Answerers | dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> Awaitable[JsonValue]:
        """Park the turn until a human answers; resolves to the answer on the replay.

        Only an async tool can park. Everything before this call runs again on resume,
        so put side effects after it. Raises :class:`~june_worker.errors.InputTimeoutError`
        when ``timeout_s`` passed without an answer.
        """
        if self.is_sync:
            from .signals import SyncParkError

            raise SyncParkError(
                f"tool {self.call.name!r} runs sync (def); only an async tool can park with request_input"
            )
        if self._broker is None:
            raise FatalToolError("request_input is not available in this context")
        if isinstance(answerers, dict):
            answerers = (
                UserAnswerer.model_validate(answerers)
                if "user" in answerers
                else PolicyAnswerer.model_validate(answerers)
            )
        return self._broker.ask(self, id=id, prompt=prompt, schema=schema, answerers=answerers, timeout_s=timeout_s)

    def delegate(self, *, agent: str, text: str, wait: bool = True) -> Awaitable[dict[str, JsonValue]]:
        """Run a turn of ``agent`` in a child session and return its result.

        The child session is ``"<this session>:sub:<call id>.<12 hex digits of the child turn id>"``. The turn parks until the child turn ends (it holds no worker meanwhile), then this returns
        ``{"status": "completed", "text": ...}`` (or ``failed`` with ``error``, ``cancelled``/``rejected`` with
        ``reason``), plus the child's ``agent``, ``session`` and ``turn_id``. One child per call, however often
        the tool runs. ``wait=False`` starts the child and returns ``{"status": "started", ...}`` at once.
        Async tools only; raises :class:`~june_worker.errors.DelegationError` (the model reads it) past the
        agent's ``max_child_depth`` or ``max_children_per_turn``, or for an agent this host does not serve.
        """
        if self.is_sync:
            from .signals import SyncParkError

            raise SyncParkError(
                f"tool {self.call.name!r} runs sync (def); only an async tool can delegate to a child agent"
            )
        if self._delegator is None:
            raise FatalToolError("delegate is not available in this context (no host to run a child turn)")
        return self._delegator.delegate(self, agent=agent, text=text, wait=wait)


def store_write(ctx: ToolContext, sql: str, *params: Any) -> int:
    """Write through the step's own transaction, on SQLite and Postgres alike (``?`` placeholders).

    Refuses with :class:`FatalToolError` where there is no transaction to join (the memory
    store, an async tool): that is a deployment mistake the model cannot fix.
    """
    return ctx.store.execute(sql, *params)


RunFn = Callable[..., Any]


class Tool:
    """A tool the model can call.

    Build one with :func:`tool` from a typed function, or directly with a JSON schema and a
    ``run(input, ctx)`` function.
    """

    def __init__(
        self,
        name: str,
        run: RunFn,
        *,
        description: str = "",
        input_schema: dict[str, JsonValue] | None = None,
        input_model: type[BaseModel] | None = None,
        requires_principal: bool = False,
        call_style: str = "raw",
    ) -> None:
        problem = tool_name_problem(name)
        if problem is not None:
            raise ConfigError(problem)
        self.name = name
        self.run = run
        self.description = description
        self.input_model = input_model
        if input_schema is None:
            input_schema = input_model.model_json_schema() if input_model else {"type": "object", "properties": {}}
        self.input_schema = input_schema
        self.requires_principal = requires_principal
        self.is_async = is_async_callable(run)
        self._call_style = call_style
        # the parameter names a kwargs call passes, read once: pydantic's model_fields builds its answer per access
        self._params = tuple(input_model.model_fields) if input_model is not None else ()

    def __repr__(self) -> str:
        kind = "async" if self.is_async else "sync"
        return f"Tool({self.name!r}, {kind})"

    @property
    def spec(self) -> ToolSpec:
        return ToolSpec(name=self.name, description=self.description, input_schema=self.input_schema)

    def validate(self, raw_input: dict[str, JsonValue]) -> Any:
        """Check the model's input; raise :class:`ToolInputError` with a message the model can act on."""
        if self.input_model is None:
            if not isinstance(raw_input, dict):
                raise ToolInputError(f"input for {self.name} must be a JSON object")
            return raw_input
        try:
            return self.input_model.model_validate(raw_input)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'input'}: {err['msg']}" for err in exc.errors()
            )
            raise ToolInputError(f"invalid input for {self.name}: {problems}") from None

    def invoke(self, ctx: ToolContext, validated: Any) -> Any:
        """Call the tool; for an async tool this returns the coroutine to await."""
        if self._call_style == "kwargs":
            kwargs = {k: getattr(validated, k) for k in self._params}
            return self.run(ctx, **kwargs)
        return self.run(validated, ctx)


_Fn = typing.TypeVar("_Fn", bound=Callable[..., Any])


def _input_model_for(fn: Callable[..., Any], name: str) -> tuple[type[BaseModel], bool]:
    """A pydantic model from the function's parameters (the leading context parameter excluded)."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:  # unresolved forward references
        raise ConfigError(f"tool {name}: cannot resolve type hints: {exc}") from exc
    params = list(sig.parameters.values())
    takes_ctx = bool(params) and (hints.get(params[0].name) is ToolContext or params[0].name in {"ctx", "context"})
    if takes_ctx:
        params = params[1:]
    fields: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ConfigError(f"tool {name}: *args/**kwargs cannot be described to a model")
        annotation = hints.get(p.name, Any)
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (annotation, default)
    model = create_model(f"{name}_input", __config__=ConfigDict(extra="forbid"), **fields)
    return model, takes_ctx


@overload
def tool(fn: _Fn, /) -> Tool: ...


@overload
def tool(*, name: str | None = None, requires_principal: bool = False) -> Callable[[_Fn], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None, /, *, name: str | None = None, requires_principal: bool = False
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a tool from a typed function: schema from the type hints, description from the docstring.

    The first parameter receives the :class:`ToolContext` when it is annotated so or named
    ``ctx``; the others are the tool's input, validated before the function runs::

        @tool
        def create_order(ctx: ToolContext, item: str, qty: int = 1) -> dict:
            \"\"\"Place an order for an item.\"\"\"
    """

    def build(f: Callable[..., Any]) -> Tool:
        tool_name = name if name is not None else getattr(f, "__name__", None) or type(f).__name__
        target: Callable[..., Any] = f
        if inspect.isfunction(f):
            target = inspect.unwrap(f)
        elif not inspect.ismethod(f):
            # a callable object is described by its bound __call__: the parameters after self
            target = getattr(f, "__call__")  # noqa: B004, B009 - the bound method itself is wanted
        model, takes_ctx = _input_model_for(target, tool_name)
        run: RunFn = f if takes_ctx else _drop_ctx(f)
        description = inspect.getdoc(f) or ""
        return Tool(
            tool_name,
            run,
            description=description,
            input_model=model,
            requires_principal=requires_principal,
            call_style="kwargs",
        )

    if fn is not None:
        return build(fn)
    return build


def _drop_ctx(f: Callable[..., Any]) -> RunFn:
    if is_async_callable(f):

        @functools.wraps(f)
        async def run_async(_ctx: ToolContext, /, **kwargs: Any) -> Any:
            return await f(**kwargs)

        return run_async

    @functools.wraps(f)
    def run(_ctx: ToolContext, /, **kwargs: Any) -> Any:
        return f(**kwargs)

    return run
