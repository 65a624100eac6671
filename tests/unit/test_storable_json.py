"""storable_json's fast check agrees with unstorable_reason: a value comes back as itself exactly when it is storable."""

from __future__ import annotations

import pytest

from june_wire.storable import storable_json, unstorable_reason

CASES = [
    "plain",
    "é ü ascii-free",
    "nul \x00 inside",
    "lone \ud800 surrogate",
    {"a": 1, "b": [1, "x", None, 2.5]},
    {"k\x00": "key holds a NUL"},
    {"deep": [{"deeper": ["ok", "bad \udfff"]}]},
    ("tuple", "of", "str"),
    [],
    {},
    42,
    None,
]


@pytest.mark.parametrize("value", CASES)
def test_storable_json_returns_the_value_itself_exactly_when_nothing_is_unstorable(value: object) -> None:
    # Given a JSON-like value; When it is made storable; Then it is the same object iff nothing needed replacing
    out = storable_json(value)
    assert (out is value) == (unstorable_reason(value) is None)
    assert unstorable_reason(out) is None
