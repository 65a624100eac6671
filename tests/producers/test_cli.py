"""june-produce end to end in --json mode: main() with arguments, stdout captured as JSON lines.

A "worker" thread stands in for june where a turn must run: it pops the june.turn message from the
test's own queue and writes that turn's events to the stream. Control commands go to the stub
Celery worker (stub_worker.py).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import redis

from producers import JuneProducer
from producers.cli import main

from .conftest import Names, StubWorker
from .kit import WAIT_S, add_event, pop_message, returns_within, script, write_script

pytestmark = pytest.mark.integration


def lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, redis_url: str, names: Names, producer: JuneProducer) -> Names:
    """The CLI's environment: the test's own queues and key prefix (``producer`` cleans them up)."""
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in names.env(redis_url).items():
        monkeypatch.setenv(name, value)
    return names


@pytest.fixture
def stub_env(monkeypatch: pytest.MonkeyPatch, redis_url: str, stub_worker: StubWorker) -> Names:
    """The CLI's environment pointed at the stub worker's control queue and key prefix."""
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in stub_worker.names.env(redis_url).items():
        monkeypatch.setenv(name, value)
    return stub_worker.names


@contextlib.contextmanager
def fake_worker(rclient: redis.Redis, names: Names, end: str = "turn.completed") -> Iterator[list[Any]]:
    """Take the next june.turn message off the queue and write that turn's events, as june would."""
    received: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            message = pop_message(rclient, names.queue, timeout_s=WAIT_S)
            received.append(message)
            (payload,) = message.args
            stream = f"{names.prefix}:events:{{{payload['agent']}:{payload['session']}}}"
            write_script(
                rclient, stream, payload["agent"], payload["session"], payload["turn_id"], script("x", end=end)
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield received
    thread.join(WAIT_S)
    if errors:
        raise errors[0]


def test_turn_enqueues_and_prints_the_turns_events_as_json_lines_until_it_completes(
    env: Names, rclient: redis.Redis, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_worker(rclient, env) as received:
        code = main(["turn", "ops", session_id, "order a book", "--json", "--timeout", str(WAIT_S)])

    out, err = capsys.readouterr()
    events = lines(out)
    (payload,) = received[0].args
    assert code == 0
    assert payload["text"] == "order a book" and payload["session"] == session_id
    assert [e["type"] for e in events] == [t for t, _, _ in script("x")]
    assert all(e["turn_id"] == payload["turn_id"] and e["stream_id"] for e in events)
    assert events[0]["agent"] == "ops" and events[0]["session"] == session_id
    assert f"queued {payload['turn_id']}" in err


@pytest.mark.parametrize(("end", "code"), [("turn.failed", 1), ("turn.cancelled", 1), ("input.requested", 3)])
def test_turn_exit_code_says_how_the_turn_ended(
    env: Names, rclient: redis.Redis, session_id: str, capsys: pytest.CaptureFixture[str], end: str, code: int
) -> None:
    with fake_worker(rclient, env, end=end) as received:
        assert main(["turn", "ops", session_id, "hi", "--json", "--timeout", str(WAIT_S)]) == code

    out, err = capsys.readouterr()
    assert lines(out)[-1]["type"] == end
    if end == "input.requested":
        turn_id = received[0].args[0]["turn_id"]
        assert f"answer with: june-produce resume ops {session_id} {turn_id} approve true --by U9" in err


def test_turn_no_follow_prints_the_turn_id_and_sends_every_option(
    env: Names, rclient: redis.Redis, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "turn", "ops", session_id, "digest", "--no-follow", "--json", "--turn-id", "t_given", "--replace",
            "--event", '{"source": "slack", "thread": "T1"}', "--proactive-by", "cron:daily",
        ]
    )  # fmt: skip

    assert code == 0
    assert lines(capsys.readouterr().out) == [{"turn_id": "t_given", "agent": "ops", "session": session_id}]
    (payload,) = pop_message(rclient, env.queue).args
    assert payload == {
        "turn_id": "t_given",
        "agent": "ops",
        "session": session_id,
        "text": "digest",
        "event": {"source": "slack", "thread": "T1"},
        "trigger": {"kind": "proactive", "by": "cron:daily"},
        "replace": True,
    }


def test_follow_prints_a_turn_from_a_stream_id_and_exits_like_the_turn(
    env: Names, rclient: redis.Redis, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    stream = f"{env.prefix}:events:{{ops:{session_id}}}"
    ids = write_script(rclient, stream, "ops", session_id, "t_1", script("t_1", end="input.requested"))

    code = main(["follow", "ops", session_id, "--turn", "t_1", "--from", ids[3], "--json", "--timeout", str(WAIT_S)])

    events = lines(capsys.readouterr().out)
    assert code == 3
    assert [e["stream_id"] for e in events] == ids[4:]


def test_follow_of_a_session_prints_everything_until_its_timeout(
    env: Names, rclient: redis.Redis, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    stream = f"{env.prefix}:events:{{ops:{session_id}}}"
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1"))
    add_event(rclient, stream, "ops", session_id, "turn.started", "t_2", 7, trigger={"kind": "proactive", "by": "x"})

    assert main(["follow", "ops", session_id, "--json", "--timeout", "0"]) == 0
    assert [e["turn_id"] for e in lines(capsys.readouterr().out)] == ["t_1"] * len(script("t_1")) + ["t_2"]


def test_follow_that_times_out_before_the_turn_ends_exits_4(
    env: Names, rclient: redis.Redis, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    stream = f"{env.prefix}:events:{{ops:{session_id}}}"
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1")[:2])

    assert main(["follow", "ops", session_id, "--turn", "t_1", "--json", "--timeout", "0.2"]) == 4
    assert "has not ended" in capsys.readouterr().err


def answered_park(rclient: redis.Redis, stream: str, session_id: str) -> None:
    """t_1 parked on input ``approve``, was answered and completed; then t_2 ran."""
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1", end="input.requested"))
    resumed = {"trigger": {"kind": "resume", "call_id": "call_2", "input_id": "approve"}}
    add_event(rclient, stream, "ops", session_id, "turn.started", "t_1", 7, **resumed)
    add_event(rclient, stream, "ops", session_id, "turn.completed", "t_1", 8, text="Refunded.")
    write_script(rclient, stream, "ops", session_id, "t_2", script("t_2", first_seq=9))


def test_following_a_session_gives_no_answer_hint_for_a_park_answered_since(
    env: Names, rclient: redis.Redis, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a session whose first turn parked on an approval that was answered long ago
    answered_park(rclient, f"{env.prefix}:events:{{ops:{session_id}}}", session_id)
    # When its events are followed from the start
    assert main(["follow", "ops", session_id, "--json", "--timeout", "0"]) == 0
    # Then the old request is shown, and nothing tells to answer it
    captured = capsys.readouterr()
    assert "input.requested" in [e["type"] for e in lines(captured.out)]
    assert "answer with" not in captured.err


def test_following_a_session_still_parked_says_how_to_answer_it_once_its_past_is_shown(
    env: Names, rclient: redis.Redis, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a session whose turn parked and is still waiting
    stream = f"{env.prefix}:events:{{ops:{session_id}}}"
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1", end="input.requested"))
    # When its events are followed from the start
    assert main(["follow", "ops", session_id, "--json", "--timeout", "0"]) == 0
    # Then the command that answers it is given
    command = f"june-produce resume ops {session_id} t_1 approve true --by U9"
    assert capsys.readouterr().err.splitlines() == [f"june-produce: turn t_1 still waits; answer with: {command}"]


def test_following_a_turn_answered_since_it_parked_shows_it_to_its_end(
    env: Names, rclient: redis.Redis, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a turn that parked, was answered and completed
    answered_park(rclient, f"{env.prefix}:events:{{ops:{session_id}}}", session_id)
    # When that turn is followed from the start
    code = main(["follow", "ops", session_id, "--turn", "t_1", "--json", "--timeout", str(WAIT_S)])
    # Then the follow goes past its old park to its end, and exits as the turn ended
    captured = capsys.readouterr()
    assert [e["type"] for e in lines(captured.out)][-3:] == ["input.requested", "turn.started", "turn.completed"]
    assert code == 0 and "answer with" not in captured.err


@pytest.mark.parametrize(("typed", "value"), [("true", True), ("42", 42), ('"42"', "42"), ("ship it", "ship it")])
def test_resume_sends_the_value_parsed_as_json_when_it_parses(
    stub_env: Names, session_id: str, capsys: pytest.CaptureFixture[str], typed: str, value: object
) -> None:
    code = main(["resume", "ops", session_id, "t_1", "approve", typed, "--by", "U9", "--json", "--wait", str(WAIT_S)])

    (outcome,) = lines(capsys.readouterr().out)
    assert code == 0
    assert outcome["status"] == "accepted"
    assert outcome["echo"]["value"] == value and outcome["echo"]["by"] == "U9"


def test_resume_that_is_not_accepted_exits_1_and_prints_why(
    stub_env: Names, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["resume", "ops", session_id, "t_1", "approve", "deny", "--by", "U0", "--json", "--wait", str(WAIT_S)])

    (outcome,) = lines(capsys.readouterr().out)
    assert code == 1
    assert outcome["status"] == "forbidden" and outcome["reason"]


def test_resume_follow_shows_the_turn_continue_after_the_answer(
    stub_env: Names, rclient: redis.Redis, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    stream = f"{stub_env.prefix}:events:{{ops:{session_id}}}"
    write_script(rclient, stream, "ops", session_id, "t_1", script("t_1", end="input.requested"))

    code = main(
        ["resume", "ops", session_id, "t_1", "approve", "true", "--by", "U9", "--follow", "--json"]
        + ["--wait", str(WAIT_S), "--timeout", str(WAIT_S)]
    )

    outcome, *events = lines(capsys.readouterr().out)
    assert code == 0
    assert outcome["status"] == "accepted"
    assert [e["type"] for e in events] == ["turn.started", "message.completed", "turn.completed"]
    rclient.delete(stream)


def test_cancel_and_reset_print_the_workers_answer(
    stub_env: Names, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cancel", "ops", session_id, "t_7", "--json", "--wait", str(WAIT_S)]) == 0
    assert main(["reset", "ops", f"busy-{session_id}", "--json", "--wait", str(WAIT_S)]) == 0
    assert main(["reset", "ops", f"parked-{session_id}", "--json", "--wait", str(WAIT_S)]) == 1

    cancel, pending, rejected = lines(capsys.readouterr().out)
    assert cancel == {"status": "cancelled", "turn_ids": ["t_7"]}
    assert pending["status"] == "pending"
    assert rejected["status"] == "rejected" and rejected["reason"]


def test_a_reset_no_worker_answered_in_time_exits_5_and_its_message_expires_unrun(
    env: Names, rclient: redis.Redis, session_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given no worker on the control queue
    # When june-produce reset gives up waiting
    assert main(["reset", "ops", session_id, "--json", "--wait", "1"]) == 5
    # Then it says the reset was withdrawn, and the message left in the queue carries an expiry before now
    assert "withdrawn" in capsys.readouterr().err
    message = pop_message(rclient, env.control_queue)
    assert message.task == "june.reset"
    assert datetime.fromisoformat(message.headers["expires"]) < datetime.now(UTC)


def test_a_bad_name_exits_2_with_the_reason(env: Names, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["turn", "o ps", "s1", "hi", "--no-follow", "--json"]) == 2
    assert "invalid agent name" in capsys.readouterr().err


def test_an_event_that_is_not_a_json_object_is_a_usage_error(env: Names, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["turn", "ops", "s1", "hi", "--event", "[1]"])
    assert caught.value.code == 2
    assert "expected a JSON object" in capsys.readouterr().err


def test_an_unreachable_redis_exits_5_with_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("JUNE_REDIS_URL", f"redis://:pw@127.0.0.1:{port}/0")
    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)

    assert main(["turn", "ops", "s1", "hi", "--no-follow", "--json"]) == 5
    assert main(["follow", "ops", "s1", "--json", "--timeout", "0"]) == 5

    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("june-produce: ") for line in err)
    assert "could not send june.turn" in err[0] and ":pw@" not in err[0]


@pytest.mark.timeout(60)  # a CLI that hangs on a silent broker fails here
def test_a_silent_rabbitmq_exits_5_with_one_clear_line_within_the_publish_timeout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # takes connections, never answers
        port = silent.getsockname()[1]
        monkeypatch.setenv("CELERY_BROKER_URL", f"amqp://guest:pw@127.0.0.1:{port}//")
        timeout_s, retries = 0.5, 1
        monkeypatch.setenv("JUNE_PUBLISH_TIMEOUT_S", str(timeout_s))
        monkeypatch.setenv("JUNE_PUBLISH_RETRIES", str(retries))

        # within ten times what the retry policy allows, (retries + 1) x timeout: a hang fails here, not at 60 s
        code = returns_within(
            lambda: main(["turn", "ops", "s1", "hi", "--no-follow", "--json"]),
            10 * (retries + 1) * timeout_s,
            "the CLI",
        )
        assert code == 5

    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("june-produce: could not send june.turn")
    assert f"amqp://***@127.0.0.1:{port}//" in err[0] and ":pw@" not in err[0]
