"""AnthropicModel: the Model seam on the official ``anthropic`` SDK (the ``anthropic`` extra).

One model call is one streamed Messages API request, or a few when the API pauses a long
server-tool run (``pause_turn``): the paused content is sent back and the model goes on, at most
``max_pause_continuations`` times. Text and thinking deltas are forwarded as they arrive; the
SDK's final assembled message(s) are the authoritative reply, yielded once as ``Done``, so the
engine still commits one checkpoint per model step. The transcript mapping lives in
:mod:`._anthropic_mapping`.

Retries happen before the engine commits anything, and never yield ``Done`` twice. A model call has
one retry budget (:mod:`._anthropic_retries`; the SDK's own retries are off): a request that failed
before any delta was forwarded (overloaded 529, rate limit 429, 5xx, a connection error, an SSE
``error`` event such as ``overloaded_error``, the connection dropping mid-body) is sent again at most
``max_retries`` times, after the server's ``retry-after`` or an exponential backoff. Once the budget
is spent the error is raised as not retryable, so that neither the engine's step retries nor the
host's attempts send the request again. An error after a delta was forwarded is not retried here (a
delta shown is never shown twice): it is raised as the provider's error says, and the engine may run
the step again, its deltas then carrying the next attempt number.

Anything else raises :class:`ModelProviderError` with the provider's own message, or
:class:`~june_worker.errors.ModelStreamError` for a stream that broke the protocol.

The one rule a reader must not break: **the API key never leaves the client** — not in a
log line, an exception message, or ``repr()``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..engine.model import Done, ModelDelta, ModelRequest, ReasoningChunk, TextChunk
from ..engine.secrets import register_secret, scrub, scrubbed_logger
from ..errors import ConfigError, ContextWindowExceededError, ModelProviderError, ModelStreamError
from ._anthropic_mapping import (
    DEFAULT_TRIGGER_NOTE,
    complete_call_ids,
    continuation_param,
    finish_for,
    reply_from,
    system_param,
    tools_param,
    transcript_param,
    usage_from,
)
from ._anthropic_retries import RETRYABLE_STREAM_ERRORS, RetryBudget, transport_errors, worth_retrying

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic

__all__ = ["DEFAULT_MODEL", "INSTALL_HINT", "AnthropicModel", "ModelProviderError"]

log = scrubbed_logger("june_worker.models.anthropic")

DEFAULT_MODEL = "claude-sonnet-4-6"
INSTALL_HINT = (
    "install the anthropic extra from a june-worker checkout or its wheel: pip install './june-worker[anthropic]'"
)

_TOO_LONG = ("prompt is too long", "exceed context limit")
"""How the API's 400 ``invalid_request_error`` says a request is longer than the model's context window."""

_MIN_THINKING_BUDGET = 1024


def _sdk() -> ModuleType:
    try:
        import anthropic
    except ImportError as exc:
        raise ConfigError(f"AnthropicModel needs the Anthropic SDK, which is not installed: {INSTALL_HINT}") from exc
    return anthropic


def _register_credentials(client: Any) -> None:
    """Keep the client's credentials out of every scrubbed string: its API key (``x-api-key``) and its bearer
    token (``auth_token``, ``ANTHROPIC_AUTH_TOKEN``: what a gateway in front of the API may take instead)."""
    register_secret(getattr(client, "api_key", None))
    register_secret(getattr(client, "auth_token", None))


def _chunk(event: Any) -> TextChunk | ReasoningChunk | None:
    """The live delta in one raw stream event, if any (signature and tool-input deltas are not shown)."""
    if getattr(event, "type", None) != "content_block_delta":
        return None
    delta = event.delta
    kind = getattr(delta, "type", None)
    if kind == "text_delta" and delta.text:
        return TextChunk(text=delta.text)
    if kind == "thinking_delta" and delta.thinking:
        return ReasoningChunk(text=delta.thinking)
    return None


def _collect_input(event: Any, streamed: dict[int, str]) -> None:
    """Add a raw ``input_json_delta``'s text to its block's (what tells a whole call from a cut one)."""
    if getattr(event, "type", None) != "content_block_delta":
        return
    delta = event.delta
    if getattr(delta, "type", None) == "input_json_delta":
        streamed[event.index] = streamed.get(event.index, "") + (delta.partial_json or "")


def _not_retryable(error: Exception, spent: str | None) -> Exception:
    """``error`` marked not retryable (its retries were this call's), saying why the retries ended if they did."""
    if not isinstance(error, ModelProviderError) or (not error.retryable and spent is None):
        return error
    message = error.message if spent is None else scrub(f"{error.message}; {spent}")
    return type(error)(message, error.status_code, error.error_type, error.request_id, False)


class AnthropicModel:
    """The Model seam on Anthropic's Messages API.

    ``thinking``: ``False`` (default) sends no thinking configuration; ``True`` asks for
    adaptive thinking; an int asks for extended thinking with that token budget (at least
    1024 and below ``max_tokens``). Thinking blocks are stored on the assistant message and
    echoed back on replay.

    ``cache``: put cache breakpoints on the system prompt, the tool definitions and the last
    block of the transcript, so each step of a turn reads the previous step's prefix from cache.

    ``trigger_note``: how a ``trigger`` message (a proactive turn) is attributed; formatted with
    ``{by}`` and sent as a text block before the trigger's text. ``None`` sends the text alone.

    ``temperature``: sent only when set. The Messages API version that SDK 2.x sends
    (``2026-10-21``) rejects every sampling parameter, so set it only for an older API version
    or a compatible gateway.

    ``client``: an ``AsyncAnthropic`` (or a look-alike) to use as is; otherwise one is made per
    event loop from ``api_key`` / ``base_url`` (the SDK reads ``ANTHROPIC_API_KEY`` when no key
    is given; :meth:`from_env` reads it explicitly). The SDK's own retries are turned off, an injected client's
    too (``with_options(max_retries=0)``), so that one budget governs a call's requests.

    ``max_retries``: how often one model call sends a failed request again (every cause before any output:
    HTTP 408/409/429/5xx/529, connection errors, in-stream errors), after the server's ``retry-after`` or a
    backoff from ``retry_delay_s`` doubling up to 8 s. A ``retry-after`` over ``max_retry_wait_s`` ends the
    retries at once. Spent, the error is raised not retryable: the turn fails in its model step. So a call
    against an overloaded API makes at most ``max_retries + 1`` requests over at most ``max_retries`` waits.

    ``max_pause_continuations``: a reply that stops on ``pause_turn`` (the API paused a long
    server-tool run) is continued by sending its content back, at most this many times within one
    model step; the deltas of every request are forwarded and one ``Done`` carries the whole reply.
    Past the bound the reply so far is returned with its ``pause_turn`` finish (``other``).

    ``context_window_tokens``: the model's context window, which an agent's context policy keeps its
    requests inside (200,000 for the Claude models; more where a 1M-token window is enabled). A request
    the API refuses as too long raises :class:`~june_worker.errors.ContextWindowExceededError`.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        max_tokens: int = 8192,
        temperature: float | None = None,
        thinking: bool | int = False,
        cache: bool = True,
        trigger_note: str | None = DEFAULT_TRIGGER_NOTE,
        client: AsyncAnthropic | Any | None = None,
        api_key: str | None = None,
        base_url: str | None = None,
        max_retries: int = 4,
        retry_delay_s: float = 1.0,
        max_retry_wait_s: float = 60.0,
        max_pause_continuations: int = 5,
        context_window_tokens: int = 200_000,
    ) -> None:
        if max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive number of tokens, got {max_tokens}")
        if thinking is not True and thinking is not False:
            if thinking < _MIN_THINKING_BUDGET or thinking >= max_tokens:
                raise ConfigError(
                    f"thinking budget must be at least {_MIN_THINKING_BUDGET} tokens and below max_tokens "
                    f"({max_tokens}), got {thinking}; or pass thinking=True for adaptive thinking"
                )
        if max_retries < 0 or retry_delay_s < 0 or max_retry_wait_s < 0:
            raise ConfigError(
                f"max_retries, retry_delay_s and max_retry_wait_s must be 0 or more, got {max_retries}, "
                f"{retry_delay_s} and {max_retry_wait_s}"
            )
        if max_pause_continuations < 0:
            raise ConfigError(f"max_pause_continuations must be 0 or more, got {max_pause_continuations}")
        if context_window_tokens <= max_tokens:
            raise ConfigError(
                f"context_window_tokens ({context_window_tokens}) must be more than max_tokens ({max_tokens})"
            )
        if client is None:
            _sdk()  # a missing extra is a deployment mistake: say so when the model is built
        elif callable(getattr(client, "with_options", None)):
            client = client.with_options(max_retries=0)  # the budget is ours: SDK retries would multiply it
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.thinking = thinking
        self.cache = cache
        self.trigger_note = trigger_note
        self.max_retries = max_retries
        self.retry_delay_s = retry_delay_s
        self.max_retry_wait_s = max_retry_wait_s
        self.max_pause_continuations = max_pause_continuations
        self.context_window_tokens = context_window_tokens
        self._client = client
        self._api_key = api_key
        self._base_url = base_url
        # the credentials to keep out of every message we raise or log, whichever side holds them
        register_secret(api_key)
        _register_credentials(client)
        self._owned: tuple[asyncio.AbstractEventLoop, AsyncAnthropic] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> AnthropicModel:
        """Build from the environment: ``ANTHROPIC_API_KEY`` (required), ``ANTHROPIC_MODEL`` and
        ``ANTHROPIC_BASE_URL`` (optional). Keyword arguments win over the environment."""
        env = os.environ if env is None else env
        if "client" not in kwargs and "api_key" not in kwargs:
            key = env.get("ANTHROPIC_API_KEY", "").strip()
            if not key:
                raise ConfigError("ANTHROPIC_API_KEY is not set; export it, or pass api_key= or client=")
            kwargs["api_key"] = key
        if env.get("ANTHROPIC_MODEL") and "model" not in kwargs:
            kwargs["model"] = env["ANTHROPIC_MODEL"]
        if env.get("ANTHROPIC_BASE_URL") and "base_url" not in kwargs and "client" not in kwargs:
            kwargs["base_url"] = env["ANTHROPIC_BASE_URL"]
        return cls(**kwargs)

    def __repr__(self) -> str:
        if self._client is not None:
            auth = "client=<injected>"
        else:
            auth = "api_key=<set>" if self._api_key else "api_key=<from environment>"
        return (
            f"AnthropicModel(model={self.model!r}, max_tokens={self.max_tokens}, thinking={self.thinking!r}, "
            f"cache={self.cache}, {auth})"
        )

    # --- the request ------------------------------------------------------------------------------

    def thinking_param(self) -> dict[str, Any] | None:
        if self.thinking is False:
            return None
        if self.thinking is True:
            return {"type": "adaptive"}
        return {"type": "enabled", "budget_tokens": int(self.thinking)}

    def build_params(self, request: ModelRequest) -> dict[str, Any]:
        """The keyword arguments of ``client.messages.stream`` for one call (no I/O; handy in tests)."""
        params: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "messages": transcript_param(request.messages, trigger_note=self.trigger_note, cache=self.cache),
        }
        system = system_param(request.system, cache=self.cache)
        if system is not None:
            params["system"] = system
        tools = tools_param(request.tools, cache=self.cache)
        if tools is not None:
            params["tools"] = tools
        thinking = self.thinking_param()
        if thinking is not None:
            params["thinking"] = thinking
        if self.temperature is not None:
            params["extra_body"] = {"temperature": self.temperature}
        return params

    # --- the call -----------------------------------------------------------------------------------

    def _client_for_this_loop(self) -> Any:
        if self._client is not None:
            return self._client
        loop = asyncio.get_running_loop()
        if self._owned is None or self._owned[0] is not loop:
            # An SDK client's connection pool belongs to the loop it was used on; a worker that runs
            # each task in a fresh loop gets a fresh client.
            sdk = _sdk()
            options: dict[str, Any] = {"api_key": self._api_key, "base_url": self._base_url, "max_retries": 0}
            self._owned = (loop, sdk.AsyncAnthropic(**options))
            _register_credentials(self._owned[1])  # the SDK may have read them from the environment
        return self._owned[1]

    async def aclose(self) -> None:
        """Close the client this model made (an injected client is the caller's to close)."""
        if self._owned is not None:
            owned, self._owned = self._owned[1], None
            await owned.close()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelDelta]:
        client = self._client_for_this_loop()
        params = self.build_params(request)
        finals: list[Any] = []
        inputs: list[dict[int, str]] = []  # per request, the tool-input JSON each content block streamed
        budget = RetryBudget(self.max_retries, self.retry_delay_s, self.max_retry_wait_s)
        while True:
            async for chunk in self._call(client, params, finals, inputs, budget):
                yield chunk
            if finals[-1].stop_reason != "pause_turn" or len(finals) > self.max_pause_continuations:
                break
            # Paused (a long server-tool run): send what it wrote so far back as the assistant's
            # message, as it came, and the model goes on from there. Still the same model step.
            params = {**params, "messages": continuation_param(params["messages"], finals)}
        # usage summed over the requests (the cost); the window as the last one filled it (the context policy's)
        last = usage_from(finals[-1]) if len(finals) > 1 else None
        yield Done(
            reply=reply_from(*finals),
            finish=finish_for(finals[-1].stop_reason),
            usage=usage_from(*finals),
            window_tokens=None if last is None else last.context_tokens + last.output_tokens,
            complete_calls=complete_call_ids(finals, inputs),
        )

    async def _call(
        self,
        client: Any,
        params: dict[str, Any],
        finals: list[Any],
        inputs: list[dict[int, str]],
        budget: RetryBudget,
    ) -> AsyncIterator[ModelDelta]:
        """One streamed request, sent again while ``budget`` allows: forward its deltas, then append its final
        message to ``finals`` and the tool-input JSON its content blocks streamed (by block index) to ``inputs``."""
        while True:
            forwarded = False
            streamed: dict[int, str] = {}
            try:
                async with client.messages.stream(**params) as events:
                    async for event in events:
                        _collect_input(event, streamed)
                        chunk = _chunk(event)
                        if chunk is not None:
                            forwarded = True
                            yield chunk
                    final = await events.get_final_message()
            except Exception as exc:
                error = self._translate(exc)
                wait = None if forwarded else budget.next_wait(exc)
                if wait is None:
                    if not forwarded:  # the budget decided: nobody above sends it again
                        error = _not_retryable(error, budget.spent() if worth_retrying(exc) else None)
                    if error is exc:
                        raise
                    # a cause whose text held a secret is not chained: a traceback would print it
                    raise error from (None if scrub(str(exc)) != str(exc) else exc)
                log.warning(
                    "anthropic request failed before any output (%s); retry %d/%d in %.2fs",
                    error,
                    budget.used,
                    budget.max_retries,
                    wait,
                )
                await asyncio.sleep(wait)
                continue
            break
        if getattr(final, "stop_reason", None) is None:
            raise ModelStreamError("the Anthropic stream ended before the model finished (no stop_reason)")
        finals.append(final)
        inputs.append(streamed)

    # --- errors -------------------------------------------------------------------------------------

    def _translate(self, exc: Exception) -> Exception:
        """The error the engine sees: the provider's message, never the key; unknown errors pass through."""
        sdk = sys.modules.get("anthropic")
        if sdk is not None and isinstance(exc, sdk.APIStatusError):
            error_type = getattr(exc, "type", None)
            detail = getattr(exc, "api_message", None) or exc.message
            in_stream = exc.status_code < 400
            where = "stream error" if in_stream else f"API error {exc.status_code}"
            kind = f" {error_type}" if error_type else ""
            request = f" (request {exc.request_id})" if getattr(exc, "request_id", None) else ""
            retryable = error_type in RETRYABLE_STREAM_ERRORS if in_stream else exc.status_code in (408, 409, 429)
            too_long = exc.status_code == 400 and any(m in str(detail).lower() for m in _TOO_LONG)
            return (ContextWindowExceededError if too_long else ModelProviderError)(
                scrub(f"Anthropic {where}{kind}: {detail}{request}"),
                None if in_stream else exc.status_code,
                error_type,
                getattr(exc, "request_id", None),
                retryable or exc.status_code >= 500,
            )
        if (sdk is not None and isinstance(exc, sdk.APIConnectionError)) or isinstance(exc, transport_errors()):
            return ModelProviderError(
                scrub(f"Anthropic connection failed: {exc or type(exc).__name__}"), retryable=True
            )
        if sdk is not None and isinstance(exc, sdk.AnthropicError):
            return ModelProviderError(scrub(f"Anthropic client error: {exc}"))
        if isinstance(exc, (ValueError, RuntimeError, AssertionError, LookupError, TypeError)):
            # raised by the SDK while decoding or assembling the stream
            return ModelStreamError(scrub(f"malformed Anthropic stream: {type(exc).__name__}: {exc}"))
        return exc
