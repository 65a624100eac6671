"""``sent_at`` in a ``june.turn``: when the producer sent it, epoch seconds. A number is taken (stored with the turn,
carried by a re-send); anything else is the message's rejection naming the field, as for every other field. A
producer stamps it in a header (``june_sent_at``) instead, which a worker older than the stamp ignores."""

from __future__ import annotations

from typing import Any

import pytest

from june_wire.ids import SENT_AT_HEADER
from june_worker.engine.store import TurnPayload, TurnRecord
from june_worker.errors import PayloadError
from june_worker.worker.control import turn_message
from june_worker.worker.payloads import TurnMessage, parse_payload
from june_worker.worker.tasks import sent_at_of

BASE = {"turn_id": "t_1", "agent": "ops", "session": "s", "text": "hi"}


@pytest.mark.parametrize("sent_at", [1_700_000_000, 1_700_000_000.25, None])
def test_a_number_or_nothing_is_taken(sent_at: Any) -> None:
    assert parse_payload(TurnMessage, ({**BASE, "sent_at": sent_at},), {}).sent_at == sent_at


@pytest.mark.parametrize("sent_at", ["1700000000", True, 0, -5.0, float("inf"), [1]])
def test_anything_else_rejects_the_message_naming_sent_at(sent_at: Any) -> None:
    with pytest.raises(PayloadError, match="sent_at"):
        parse_payload(TurnMessage, ({**BASE, "sent_at": sent_at},), {})


def test_a_re_send_of_a_recorded_turn_carries_its_first_sent_at() -> None:
    rec = TurnRecord(turn_id="t_1", agent="ops", session="s", payload=TurnPayload(text="hi", sent_at=1_700_000_000.5))
    message = parse_payload(TurnMessage, (turn_message(rec),), {})
    assert message.sent_at == 1_700_000_000.5
    assert "sent_at" not in turn_message(rec.model_copy(update={"payload": TurnPayload(text="hi")}))


class _Request:
    def __init__(self, headers: dict[str, Any]) -> None:
        self.headers = headers


@pytest.mark.parametrize(
    ("header", "expected"),
    [("1700000000.25", 1_700_000_000.25), (None, None), ("soon", None), ("-1", None), ("inf", None), ("nan", None),
     (1_700_000_000, None), ("9" * 100, None)],
)  # fmt: skip
def test_a_producers_sent_at_header_is_read_when_it_is_a_time_and_dropped_otherwise(header: Any, expected: Any) -> None:
    # a stamp only measures the queue wait: a bad one is dropped, never a reason to refuse the turn
    request = _Request({} if header is None else {SENT_AT_HEADER: header})
    assert sent_at_of(request) == expected
