"""Secrets never reach a stored or published string: error reports, causes, stacks, tool errors."""

from __future__ import annotations

import uuid

from june_worker.engine.endings import MESSAGE_MAX_CHARS, STACK_MAX_CHARS, error_info
from june_worker.engine.secrets import PLACEHOLDER, register_secret, scrub
from june_worker.engine.tools import ERROR_MAX_CHARS, format_tool_error


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
