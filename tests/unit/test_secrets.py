"""Secrets never reach a stored, published or logged string: error reports, causes, stacks, tool errors, logs."""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, field_validator

import june_worker
from june_worker import Agent, FatalToolError, Runtime, ToolContext, tool
from june_worker.engine.endings import MESSAGE_MAX_CHARS, STACK_MAX_CHARS, error_info
from june_worker.engine.events import ActionCompleted, Failed
from june_worker.engine.model import Done, ModelDelta, ModelRequest, TextChunk
from june_worker.engine.secrets import PLACEHOLDER, ScrubFilter, StreamScrubber, register_secret, scrub, scrub_json
from june_worker.engine.store import SessionRef
from june_worker.engine.tools import ERROR_MAX_CHARS, format_tool_error
from june_worker.engine.types import ModelReply, ToolCall
from june_worker.models import Reply, ScriptedModel
from june_worker.models.anthropic import AnthropicModel
from june_worker.observe.logs import JsonFormatter
from june_worker.stores import MemoryStore, SQLiteStore

from .kit import FnModel, Recorder


def fresh_secret() -> str:
    return f"tok-{uuid.uuid4().hex}"  # not key-shaped: only registration can catch it


def test_a_registered_secret_is_replaced_wherever_it_appears() -> None:
    secret = fresh_secret()
    assert scrub(f"bad token {secret}!") == f"bad token {secret}!"  # not registered yet
    register_secret(secret)
    assert scrub(f"bad token {secret}, again {secret}!") == f"bad token {PLACEHOLDER}, again {PLACEHOLDER}!"


def test_anything_shaped_like_an_anthropic_key_is_replaced_registered_or_not() -> None:
    text = "keys sk-ant-api03-AbC_d-9xYz and sk-ant-admin01-QQQQ8888 end"
    assert scrub(text) == f"keys {PLACEHOLDER} and {PLACEHOLDER} end"


def test_a_value_too_short_to_be_a_credential_is_not_registered() -> None:
    register_secret("abc")
    register_secret("")
    register_secret(None)
    assert scrub("abc abc") == "abc abc"


def test_error_info_scrubs_the_message_every_cause_and_the_stack() -> None:
    # Given an error whose cause chain holds the secret, chained implicitly and suppressed
    secret = fresh_secret()
    register_secret(secret)
    try:
        try:
            raise ConnectionError(f"proxy said: invalid key {secret}")
        except ConnectionError:
            raise RuntimeError(f"request with {secret} failed") from None
    except RuntimeError as exc:
        info = error_info(exc)
    # Then no field of the report holds it, and each still says what happened
    dumped = info.model_dump_json()
    assert secret not in dumped
    assert info.message == f"request with {PLACEHOLDER} failed"
    assert info.cause_chain == [f"proxy said: invalid key {PLACEHOLDER}"]
    assert info.stack is not None and f"RuntimeError: request with {PLACEHOLDER} failed" in info.stack


def test_a_tools_error_text_is_scrubbed_before_the_model_reads_it() -> None:
    assert (
        format_tool_error(ValueError("key sk-ant-api03-AbCdEf123 refused")) == f"ValueError: key {PLACEHOLDER} refused"
    )


# --- scrubbed whole, then cut ----------------------------------------------------------------------------


def test_a_message_long_enough_to_be_cut_inside_a_secret_keeps_no_piece_of_it() -> None:
    # Given a registered secret that straddles the message's bound
    secret = fresh_secret()
    register_secret(secret)
    padding = "x" * (MESSAGE_MAX_CHARS - 10)
    try:
        try:
            raise ValueError(padding + secret)
        except ValueError as cause:
            raise RuntimeError(padding + secret) from cause
    except RuntimeError as exc:
        info = error_info(exc)
    # Then neither the message nor the cause ends with the secret's first characters
    assert info.message == padding + PLACEHOLDER and info.cause_chain == [info.message]
    assert secret[:6] not in info.model_dump_json()


def test_a_stack_cut_to_its_tail_inside_a_key_keeps_no_piece_of_it() -> None:
    # Given an error whose text puts a key just before the last STACK_MAX_CHARS characters of its traceback
    key = "sk-ant-api03-Zq8kVb1yLr0Tn4Xp6Wd2Hc9Jm5Gs3Fa7"
    try:
        raise ValueError("denied " + key + "." * (STACK_MAX_CHARS - 30))
    except ValueError as exc:
        info = error_info(exc)
    # Then the stack's tail holds no piece of the key's end
    assert info.stack is not None and len(info.stack) == STACK_MAX_CHARS
    assert key[-6:] not in info.stack and key[-6:] not in info.message


def test_a_tool_error_is_scrubbed_whole_before_it_is_cut() -> None:
    secret = fresh_secret()
    register_secret(secret)
    text = format_tool_error(ValueError("x" * (ERROR_MAX_CHARS - 20) + secret))
    assert len(text) == ERROR_MAX_CHARS and secret[:8] not in text


# --- logs ----------------------------------------------------------------------------------------------


def record_with(secret: str, *, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord("t", logging.ERROR, __file__, 1, "refused %s: %r", (secret, {"k": secret}), exc_info)


def test_the_log_filter_scrubs_a_records_message_and_its_traceback() -> None:
    # Given a record whose arguments and exception hold a registered secret
    secret = fresh_secret()
    register_secret(secret)
    try:
        raise PermissionError(f"proxy refused {secret}")
    except PermissionError as exc:
        record = record_with(secret, exc=exc)
    # When the filter has seen it
    assert ScrubFilter().filter(record) is True
    # Then no formatter prints the secret, and the traceback still says what was raised
    for formatter in (logging.Formatter(), JsonFormatter()):
        text = formatter.format(record)
        assert secret not in text and f"PermissionError: proxy refused {PLACEHOLDER}" in text
    assert record.exc_info is None and json.loads(JsonFormatter().format(record))["exc_type"] == "PermissionError"


def test_the_log_filter_leaves_a_record_without_a_secret_as_it_is() -> None:
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "%s - %s", ("GET", "/v1/turns"), None)
    ScrubFilter().filter(record)
    assert (record.msg, record.args) == ("%s - %s", ("GET", "/v1/turns"))


def test_the_log_filter_scrubs_arguments_that_do_not_fit_their_message() -> None:
    secret = fresh_secret()
    register_secret(secret)
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "%s and %s", (secret,), None)
    ScrubFilter().filter(record)
    assert secret not in record.getMessage()


def test_every_logger_of_the_package_scrubs_its_records() -> None:
    # Given every module of the package imported
    for info in pkgutil.walk_packages(june_worker.__path__, "june_worker."):
        importlib.import_module(info.name)
    loggers = {
        name: logger
        for name, logger in logging.Logger.manager.loggerDict.items()
        # (the package logs to its modules' loggers only; a bare "june_worker" is a test's, made to watch them)
        if name.startswith("june_worker.") and isinstance(logger, logging.Logger)
    }
    # Then each carries the scrubbing filter, but those of modules that only run in the processes whose
    # handlers june scrubs (worker and beat: worker/app.py; the gateway: its lifespan)
    handlers_only = {"june_worker.channels.slack", "june_worker.channels.webhook", "june_worker.gateway.slack",
                     "june_worker.retention"}  # fmt: skip
    unscrubbed = {n for n, lg in loggers.items() if not any(isinstance(f, ScrubFilter) for f in lg.filters)}
    assert "june_worker.turn" in loggers and unscrubbed <= handlers_only


@tool
def leak(ctx: ToolContext) -> dict[str, Any]:
    """Fail the turn, naming the credential it used."""
    raise FatalToolError(f"upstream refused credential {LEAKED}")


LEAKED = fresh_secret()


class RefusingClient:
    """A look-alike SDK client whose every call raises an error the adapter passes through as it is."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key
        self.messages = self

    def stream(self, **params: Any) -> Any:
        raise PermissionError(f"proxy refused api key {self.api_key}")


@pytest.mark.parametrize("fault", ["fatal tool error", "passed-through model error"])
async def test_a_secret_in_a_failing_turns_exception_stays_out_of_the_in_process_log(
    fault: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a turn that fails on an exception whose text holds a registered secret (not key-shaped)
    register_secret(LEAKED)
    token = fresh_secret()
    if fault == "fatal tool error":
        model: Any = ScriptedModel([Reply("", calls=[{"id": "c1", "name": "leak", "input": {}}])])
        secret = LEAKED
    else:
        model, secret = AnthropicModel(client=RefusingClient(token)), token  # registers the client's key
    runtime = Runtime([Agent(name="ops", model=model, tools=[leak])], MemoryStore())
    # When it runs, logging everything
    caplog.set_level(logging.DEBUG)
    result = await runtime.session("ops", "s1").result(await runtime.session("ops", "s1").start("hi"))
    # Then it failed, its traceback was logged, and neither the log nor the report holds the secret
    assert isinstance(result, Failed) and PLACEHOLDER in result.error.message
    logged = "\n".join(logging.Formatter().format(r) for r in caplog.records)
    assert "Traceback" in logged and PLACEHOLDER in logged
    assert secret not in logged and secret not in caplog.text


class Shipment(BaseModel):
    address: str

    @field_validator("address")
    @classmethod
    def _no_keys(cls, value: str) -> str:
        raise ValueError(f"not an address: {value}")


@tool
def ship(ctx: ToolContext, order: Shipment) -> str:
    """Ship an order."""
    return "shipped"


async def test_a_refused_tool_input_that_quotes_a_secret_is_scrubbed_before_it_is_stored() -> None:
    # Given a tool whose input validator quotes the model's input back, and a model that sends a registered secret
    secret = fresh_secret()
    register_secret(secret)
    calls = [{"id": "c1", "name": "ship", "input": {"order": {"address": f"use {secret}"}}}]
    store = MemoryStore()
    runtime = Runtime(
        [Agent(name="ops", model=ScriptedModel([Reply("", calls=calls), Reply("ok")]), tools=[ship])], store
    )
    session = runtime.session("ops", "s1")
    # When the turn runs
    await session.result(await session.start("ship it"))
    # Then the model read the refusal scrubbed, and so does every event that reports it (the model's own call
    # input is its reply, stored as it wrote it)
    ref = SessionRef("ops", "s1")
    (refusal,) = [m for m in store.load(ref).messages if m.role == "tool"]
    assert isinstance(refusal.result, dict) and f"not an address: use {PLACEHOLDER}" in str(refusal.result["error"])
    reports = [json.dumps([e.result, e.error]) for e in store.events(ref) if isinstance(e, ActionCompleted)]
    assert reports and all(secret not in r and PLACEHOLDER in r for r in reports)


# --- streamed text -------------------------------------------------------------------------------------


def test_a_key_split_over_deltas_is_held_back_until_it_is_whole_and_then_replaced() -> None:
    scrubber = StreamScrubber()
    out = [scrubber.feed(p) for p in ("your key is sk-a", "nt-api03-AbC", "dEf0 and ", "more")]
    assert out == ["your key is ", "", f"{PLACEHOLDER} and ", "more"]
    assert scrubber.flush() == ""


def test_a_registered_secret_split_over_deltas_never_goes_out_in_pieces() -> None:
    secret = fresh_secret()
    register_secret(secret)
    scrubber = StreamScrubber()
    pieces = [f"token {secret[:5]}", secret[5:12], secret[12:] + " done"]
    out = "".join(scrubber.feed(p) for p in pieces) + scrubber.flush()
    assert out == f"token {PLACEHOLDER} done"
    assert scrubber.feed(f"a {secret[:5]}") == "a "  # its first characters are held, not published


def test_what_is_held_back_goes_out_when_the_text_ends() -> None:
    scrubber = StreamScrubber()
    assert scrubber.feed("ask-an") == "a"  # could begin a key
    assert scrubber.flush() == "sk-an"


STREAM_SECRET = "tok-streamed-0123456789"


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.sampled_from(["sk-ant-", "sk-", "ant", "-api03-", "AbCd", " ", "x", "tok-", STREAM_SECRET, "0123"]),
        max_size=12,
    ),
    st.lists(st.integers(0, 200), max_size=8),
)
def test_streamed_pieces_scrubbed_join_to_the_whole_text_scrubbed(parts: list[str], cuts: list[int]) -> None:
    register_secret(STREAM_SECRET)
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    scrubber = StreamScrubber()
    out = "".join(scrubber.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)) + scrubber.flush()
    assert out == scrub(text)


@tool
def read_env(ctx: ToolContext) -> dict[str, str]:
    """Read the environment (a tool a prompt could talk the model into calling)."""
    return {"ANTHROPIC_API_KEY": "sk-ant-api03-EnvEnvEnv0123456789"}


async def test_no_secret_from_a_tool_result_or_a_model_reply_is_stored_published_or_read_by_the_model() -> None:
    # Given a tool that returns a key, and a model that streams another one split over its deltas
    store = SQLiteStore(":memory:")
    leaked = "sk-ant-api03-ModelModel0123456789"

    async def reply(request: ModelRequest) -> AsyncIterator[ModelDelta]:
        answered = [m for m in request.messages if m.role == "tool"]
        if not answered:
            yield Done(reply=ModelReply(tool_calls=[ToolCall(id="c1", name="read_env")]))
            return
        if len(answered) > 1:
            yield Done(reply=ModelReply(text="done"))
            return
        seen.append(json.dumps([m.model_dump(mode="json") for m in request.messages]))
        for piece in ("here: ", leaked[:9], leaked[9:20], leaked[20:], " ok"):
            yield TextChunk(text=piece)
        yield Done(
            reply=ModelReply(text=f"here: {leaked} ok", tool_calls=[ToolCall(id="c2", name="x", input={"k": leaked})])
        )

    seen: list[str] = []
    runtime = Runtime([Agent(name="ops", model=FnModel(reply), tools=[read_env])], store)
    session = runtime.session("ops", "s1")
    rec = Recorder()
    session.observe(rec)
    # When the turn runs
    await session.result(await session.start("what is in the environment?"))
    # Then the model read the tool's result scrubbed, and no delta, event or stored message holds either key
    assert seen and "EnvEnvEnv" not in seen[0] and PLACEHOLDER in seen[0]
    deltas = "".join(e.text for e in rec.of("message.delta"))
    assert deltas == f"here: {PLACEHOLDER} ok"
    stored = json.dumps([m.model_dump(mode="json") for m in store.load(session.ref).messages])
    published = json.dumps([e.model_dump(mode="json") for e in [*rec.events, *store.events(session.ref)]])
    for text in (stored, published):
        assert "EnvEnvEnv" not in text and "ModelModel" not in text and PLACEHOLDER in text


def test_a_json_value_is_scrubbed_in_every_string_and_key_even_for_a_secret_json_escapes() -> None:
    quoted = f'quo"ted\\{uuid.uuid4().hex}'  # JSON writes it escaped: the one-look check cannot see it
    register_secret(quoted)
    value = {"rows": [{"note": f"x {quoted} y", quoted: 1}], "n": 2, "key": "sk-ant-api03-AbCdEfGh"}
    assert scrub_json(value) == {"rows": [{"note": f"x {PLACEHOLDER} y", PLACEHOLDER: 1}], "n": 2, "key": PLACEHOLDER}
    clean = {"rows": [{"id": 1, "name": "widget"}], "ok": True}
    assert scrub_json(clean) is clean
