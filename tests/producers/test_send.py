"""What a producer puts on the broker, read back from the queue as a worker would receive it: the task
name, ONE JSON object argument, the queue (turns vs control), and an ``argsrepr`` without secrets.

No worker consumes these queues: each test has queues of its own and pops its messages itself.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from pydantic import ValidationError

from june_wire.ids import SENT_AT_HEADER
from june_worker.worker.payloads import TurnMessage
from producers import BrokerUnavailable, JuneProducer, ResultTimeout
from tests._services import closed_port

from .conftest import Names
from .kit import pop_message, returns_within, wait_until

pytestmark = pytest.mark.integration

SECRET = "hunter2-secret"


def test_start_turn_sends_june_turn_with_one_json_object_to_the_turn_queue(
    producer: JuneProducer, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    before = time.time()
    turn_id = producer.start_turn("ops", session_id, "summarize this thread")
    after = time.time()

    message = pop_message(rclient, names.queue)
    assert message.task == "june.turn"
    assert message.kwargs == {}
    # when it was sent, by the producer's clock (the worker's queue wait), in a header an older worker ignores
    assert before <= float(message.headers[SENT_AT_HEADER]) <= after
    assert message.args == [
        {
            "turn_id": turn_id,
            "agent": "ops",
            "session": session_id,
            "text": "summarize this thread",
            "event": None,
            "trigger": None,
            "replace": False,
        }
    ]
    assert message.properties["delivery_info"]["routing_key"] == names.queue
    assert rclient.llen(names.control_queue) == 0


def test_start_turn_returns_a_fresh_turn_id_each_time_and_keeps_a_given_one(
    producer: JuneProducer, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    first = producer.start_turn("ops", session_id, "one")
    second = producer.start_turn("ops", session_id, "two")
    resent = producer.start_turn("ops", session_id, "two", turn_id=second)

    assert first.startswith("t_") and len(first) == 28
    assert first < second == resent
    assert [pop_message(rclient, names.queue).args[0]["turn_id"] for _ in range(3)] == [first, second, second]


def test_start_turn_carries_event_trigger_and_replace(
    producer: JuneProducer, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    event = {"source": "slack", "user": {"id": "U1", "attested": True}, "thread": "T9"}
    trigger = {"kind": "proactive", "by": "cron:daily"}

    producer.start_turn("ops", session_id, "daily digest", event=event, trigger=trigger, replace=True)

    (payload,) = pop_message(rclient, names.queue).args
    assert payload["event"] == event
    assert payload["trigger"] == trigger
    assert payload["replace"] is True
    assert "target" not in payload  # only sent when given


def test_start_turn_carries_a_delivery_target(
    producer: JuneProducer, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    producer.start_turn("ops", session_id, "digest", target={"channel": "C-ops"})
    (payload,) = pop_message(rclient, names.queue).args
    assert payload["target"] == {"channel": "C-ops"}


def test_argsrepr_names_ids_only_never_the_text_or_the_event(
    producer: JuneProducer, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    turn_id = producer.start_turn(
        "ops", session_id, f"my password is {SECRET}", event={"source": "slack", "raw": {"token": SECRET}}
    )

    message = pop_message(rclient, names.queue)
    assert message.headers["argsrepr"] == f"{{turn_id={turn_id} agent=ops session={session_id}}}"
    assert message.headers["kwargsrepr"] == ""
    assert SECRET not in json.dumps(message.headers)
    assert SECRET not in json.dumps(message.properties)
    assert SECRET in json.dumps(message.args)  # the worker does get it, in the body


def test_proactive_sends_june_proactive_with_an_explicit_turn_id_to_the_turn_queue(
    producer: JuneProducer, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    turn_id = producer.proactive("ops", session_id, "post the digest", by="cron:daily", target={"channel": "C1"})

    message = pop_message(rclient, names.queue)
    assert message.task == "june.proactive"
    assert message.args == [
        {
            "turn_id": turn_id,
            "agent": "ops",
            "session": session_id,
            "text": "post the digest",
            "by": "cron:daily",
            "target": {"channel": "C1"},
        }
    ]
    assert message.headers["argsrepr"] == f"{{turn_id={turn_id} agent=ops session={session_id}}}"


def test_resume_goes_to_the_control_queue_without_its_value_in_argsrepr(
    producer: JuneProducer, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    with pytest.raises(ResultTimeout):
        producer.resume("ops", session_id, "t_1", "approve", {"pin": SECRET}, by="U1", timeout_s=0.2)

    message = pop_message(rclient, names.control_queue)
    assert message.task == "june.resume"
    assert message.args == [
        {
            "agent": "ops",
            "session": session_id,
            "turn_id": "t_1",
            "input_id": "approve",
            "value": {"pin": SECRET},
            "by": "U1",
            "principal": None,
        }
    ]
    assert message.properties["delivery_info"]["routing_key"] == names.control_queue
    assert message.headers["argsrepr"] == f"{{turn_id=t_1 agent=ops session={session_id} input_id=approve}}"
    assert SECRET not in json.dumps(message.headers)
    assert rclient.llen(names.queue) == 0


@pytest.mark.parametrize(
    ("call", "task", "payload"),
    [
        (lambda p, s: p.cancel("ops", s, "t_1", timeout_s=0.2), "june.cancel", {"turn_id": "t_1"}),
        (lambda p, s: p.cancel("ops", s, timeout_s=0.2), "june.cancel", {"turn_id": None}),
        (lambda p, s: p.reset("ops", s, timeout_s=0.2), "june.reset", {}),
    ],
    ids=["cancel-turn", "cancel-session", "reset"],
)
def test_cancel_and_reset_go_to_the_control_queue(
    producer: JuneProducer,
    names: Names,
    rclient: redis.Redis,
    session_id: str,
    call: Callable[[JuneProducer, str], object],
    task: str,
    payload: dict[str, Any],
) -> None:
    with pytest.raises(ResultTimeout):
        call(producer, session_id)

    message = pop_message(rclient, names.control_queue)
    assert message.task == task
    assert message.args == [{"agent": "ops", "session": session_id, **payload}]
    assert message.kwargs == {}
    assert rclient.llen(names.queue) == 0


def test_a_result_that_does_not_come_raises_timeout_error_naming_task_turn_and_queue(
    producer: JuneProducer, names: Names, session_id: str
) -> None:
    with pytest.raises(TimeoutError) as caught:
        producer.resume("ops", session_id, "t_waits", "approve", True, by="U1", timeout_s=0.2)

    assert isinstance(caught.value, ResultTimeout)
    text = str(caught.value)
    assert "june.resume" in text and "t_waits" in text and names.control_queue in text


@pytest.mark.parametrize(
    ("agent", "session", "text"),
    [("o ps", "s1", "hi"), ("ops", "s 1", "hi"), ("ops", "", "hi"), ("ops", "s1", 42)],
    ids=["agent-with-space", "session-with-space", "empty-session", "text-not-a-string"],
)
def test_bad_arguments_raise_value_error_and_send_nothing(
    producer: JuneProducer, names: Names, rclient: redis.Redis, agent: str, session: str, text: Any
) -> None:
    with pytest.raises(ValueError, match="invalid"):
        producer.start_turn(agent, session, text)
    assert rclient.llen(names.queue) == 0


@pytest.mark.parametrize("field", ["agent", "session", "turn_id"])
def test_a_name_ending_in_a_line_break_is_refused_before_sending_as_the_worker_would_refuse_it(
    producer: JuneProducer, names: Names, rclient: redis.Redis, session_id: str, field: str
) -> None:
    # Given a name that matches its rule but for a trailing line break (a header or file read without stripping)
    sent = {"agent": "ops", "session": session_id, "turn_id": "t_given"} | {field: f"{field}1\n"}
    with pytest.raises(ValidationError):  # the worker refuses such a message (and records the rejection)
        TurnMessage.model_validate({**sent, "text": "hi"})
    # When a producer is asked to send it, Then it is refused at the call, naming it, and nothing is sent
    with pytest.raises(ValueError, match=f"invalid {field.replace('_', ' ')}.*'{field}1\\\\n'"):
        producer.start_turn(sent["agent"], sent["session"], "hi", turn_id=sent["turn_id"])
    assert rclient.llen(names.queue) == 0


def test_an_event_that_is_not_json_is_refused_before_sending(
    producer: JuneProducer, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    with pytest.raises(ValueError, match="event.*JSON"):
        producer.start_turn("ops", session_id, "hi", event={"source": "x", "when": object()})
    assert rclient.llen(names.queue) == 0


def test_a_broker_that_is_down_raises_broker_unavailable_with_the_cause_and_no_password() -> None:
    url = f"redis://:{SECRET}@127.0.0.1:{closed_port()}/0"
    with JuneProducer(url, queue="nowhere", control_queue="nowhere.control") as producer:
        with pytest.raises(BrokerUnavailable) as turn_error:
            producer.start_turn("ops", "s1", "hi")
        with pytest.raises(BrokerUnavailable) as cancel_error:
            producer.cancel("ops", "s1")

    assert isinstance(turn_error.value, ConnectionError)
    assert "june.turn" in str(turn_error.value) and "'nowhere'" in str(turn_error.value)
    assert turn_error.value.__cause__ is not None
    assert "result backend" in str(cancel_error.value)
    for error in (turn_error.value, cancel_error.value):
        assert SECRET not in str(error) and "***@" in str(error)


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A port that takes TCP connections and never says a word: a hung broker, or one behind a dead link."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield int(s.getsockname()[1])


@pytest.mark.timeout(60)  # a publish that hangs fails here instead of blocking the run
@pytest.mark.parametrize("down", ["refused", "silent"])
@pytest.mark.parametrize("scheme", ["redis", "sentinel", "amqp"])
def test_a_broker_that_is_down_or_silent_raises_broker_unavailable_instead_of_hanging(scheme: str, down: str) -> None:
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(silent_port()) if down == "silent" else closed_port()
        url = {
            "redis": f"redis://:{SECRET}@127.0.0.1:{port}/0",
            "sentinel": f"sentinel://:{SECRET}@127.0.0.1:{port}/0",  # a Redis behind Sentinel: the sentinel hangs
            "amqp": f"amqp://u:{SECRET}@127.0.0.1:{port}//",
        }[scheme]
        timeout_s, retries = 0.5, 2
        producer = stack.enter_context(
            JuneProducer(
                f"redis://127.0.0.1:{closed_port()}/0",
                broker_url=url,
                broker_transport_options={"master_name": "june"} if scheme == "sentinel" else None,
                publish_timeout_s=timeout_s,
                publish_retries=retries,
            )
        )
        with pytest.raises(BrokerUnavailable) as raised:
            # what the retry policy allows, (retries + 1) x timeout, ten times over: a hang fails here, not at 60 s
            returns_within(lambda: producer.start_turn("ops", "s1", "hi"), 10 * (retries + 1) * timeout_s, "start_turn")

    message = str(raised.value)
    assert message.startswith("could not send june.turn {turn_id=t_")
    assert f"{scheme}://***@127.0.0.1:{port}" in message and SECRET not in message


def test_the_task_sent_event_for_flower_carries_the_summary_not_the_payload(
    producer: JuneProducer, rclient: redis.Redis, session_id: str
) -> None:
    pubsub = rclient.pubsub()
    pubsub.psubscribe("*celeryev/task.sent")
    try:
        wait_until(lambda: pubsub.get_message(timeout=0.1) is not None, "the subscription to be confirmed")
        turn_id = producer.start_turn("ops", session_id, f"my password is {SECRET}")

        sent: dict[str, Any] = {}

        def got_it() -> bool:
            message = pubsub.get_message(timeout=0.1)
            if message and message["type"] == "pmessage":
                event = json.loads(base64.b64decode(json.loads(message["data"])["body"]))
                if turn_id in str(event.get("args")):
                    sent.update(event)
            return bool(sent)

        wait_until(got_it, "the task-sent event")
    finally:
        pubsub.close()

    assert sent["name"] == "june.turn"
    assert sent["args"] == f"{{turn_id={turn_id} agent=ops session={session_id}}}"
    assert SECRET not in json.dumps(sent)
