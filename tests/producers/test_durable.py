"""``durable=True``: the producer records the turn in june's Postgres before it sends the message.

What it records must be what a worker would record for the same message (the worker's own
models read it back here), once per turn id, and never something a worker could not read.
No worker runs: the turn's message is read back from the broker's queue.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
from pydantic import ValidationError

from june_worker.engine.store import SessionRef, TurnPayload
from june_worker.engine.types import InboundEvent
from june_worker.stores.postgres import PostgresStore
from june_worker.worker.payloads import ProactiveMessage, TurnMessage
from producers import BrokerUnavailable, DatabaseUnavailable, JuneProducer, ProducerConfigError
from producers._durable import check_event
from tests._services import closed_port

from .conftest import Names
from .kit import pop_message

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def migrated_database(database_url: str, prefix: str) -> Iterator[str]:
    """A database of its own (``<prefix>_<random>``), migrated as `june migrate` leaves it, dropped at the end."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'create database "{name}"')
    url = psycopg.conninfo.make_conninfo(database_url, dbname=name)
    PostgresStore(url).close()
    try:
        yield url
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'drop database if exists "{name}" with (force)')


@pytest.fixture(scope="module")
def db(database_url: str) -> Iterator[str]:
    """A migrated database of this module's own."""
    with migrated_database(database_url, "june_durable") as url:
        yield url


@pytest.fixture
def durable(redis_url: str, db: str, names: Names) -> Iterator[JuneProducer]:
    p = JuneProducer(
        redis_url,
        queue=names.queue,
        control_queue=names.control_queue,
        key_prefix=names.prefix,
        database_url=db,
        durable=True,
    )
    yield p
    p.close()


def _stored(db: str, session: str) -> list[tuple[str, str, TurnPayload]]:
    with psycopg.connect(db) as conn:
        rows = conn.execute(
            "select turn_id, status, payload::text from june_turns where agent = 'ops' and session = %s "
            "order by position",
            (session,),
        ).fetchall()
    return [(t, s, TurnPayload.model_validate_json(p)) for t, s, p in rows]


def test_a_durable_turn_is_recorded_queued_and_then_sent(
    durable: JuneProducer, db: str, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    turn_id = durable.start_turn("ops", session_id, "order 2 widget")

    assert [(t, s) for t, s, _ in _stored(db, session_id)] == [(turn_id, "queued")]
    assert pop_message(rclient, names.queue).args[0]["turn_id"] == turn_id


def test_what_is_recorded_is_what_a_worker_records_for_the_same_message(
    durable: JuneProducer, db: str, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    event = {"source": "slack", "user": {"id": "U1", "attested": True}, "thread": "T9", "raw": {"ts": "1.2"}}
    turn_id = durable.start_turn(
        "ops", session_id, "daily digest", event=event, trigger={"kind": "proactive", "by": "cron"}, target={"c": 1}
    )
    proactive_id = durable.proactive("ops", session_id, "post it", by="cron:daily", target={"channel": "C1"})

    turn = TurnMessage.model_validate(pop_message(rclient, names.queue).args[0])
    proactive = ProactiveMessage.model_validate(pop_message(rclient, names.queue).args[0])
    # the worker's intake (june_worker/worker/control.py) stores these payloads for these messages
    expected = [
        (
            turn_id,
            TurnPayload(
                text=turn.text,
                event=turn.event,
                trigger_by=turn.trigger_by(),
                target=turn.target,
                sent_at=turn.sent_at,
                queue=names.queue,  # the worker's: the queue the message came from; the producer's: where it sent it
            ),
        ),
        (
            proactive_id,
            TurnPayload(text=proactive.text, trigger_by=proactive.by, target=proactive.target, queue=names.queue),
        ),
    ]
    assert [(t, p) for t, _, p in _stored(db, session_id)] == expected


def test_a_turn_id_sent_again_is_recorded_once(durable: JuneProducer, db: str, session_id: str) -> None:
    first = durable.start_turn("ops", session_id, "one")
    again = durable.start_turn("ops", session_id, "one", turn_id=first)
    second = durable.start_turn("ops", session_id, "two")

    assert again == first
    assert [t for t, _, _ in _stored(db, session_id)] == [first, second]


def test_a_parked_session_records_nothing_and_the_message_still_goes_out(
    durable: JuneProducer, db: str, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(
            "insert into june_sessions (agent, session, suspended) values ('ops', %s, '{}'::json)", (session_id,)
        )

    turn_id = durable.start_turn("ops", session_id, "while parked")

    assert _stored(db, session_id) == []  # the worker rejects it, with its reason, when the message comes
    assert pop_message(rclient, names.queue).args[0]["turn_id"] == turn_id


def test_a_parked_session_with_a_reset_pending_records_the_turn_which_queues_behind_the_reset(
    durable: JuneProducer, db: str, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    # the reset is about to end the park: a worker's intake (june_intake) records a turn then, and so does this
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(
            "insert into june_sessions (agent, session, suspended, reset_pending) values ('ops', %s, '{}'::json, true)",
            (session_id,),
        )

    turn_id = durable.start_turn("ops", session_id, "after the reset")

    assert [(t, s) for t, s, _ in _stored(db, session_id)] == [(turn_id, "queued")]
    assert pop_message(rclient, names.queue).args[0]["turn_id"] == turn_id


def test_with_the_broker_down_a_recorded_turn_is_returned_and_the_sweeper_will_send_it(
    redis_url: str, db: str, session_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    broker = f"redis://127.0.0.1:{closed_port()}/0"
    with JuneProducer(redis_url, broker_url=broker, database_url=db, publish_timeout_s=0.5, publish_retries=1) as p:
        with caplog.at_level(logging.WARNING, logger="producers"):
            turn_id = p.start_turn("ops", session_id, "accepted anyway", durable=True)
        with pytest.raises(BrokerUnavailable):  # without durable the same send is an error
            p.start_turn("ops", f"{session_id}-plain", "not accepted")

    assert [(t, s) for t, s, _ in _stored(db, session_id)] == [(turn_id, "queued")]
    assert f"turn {turn_id} is recorded in Postgres, the sweeper will send it" in caplog.text


def test_with_postgres_down_nothing_is_recorded_or_sent(
    redis_url: str, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    url = f"postgresql://postgres@127.0.0.1:{closed_port()}/june"
    with JuneProducer(redis_url, queue=names.queue, database_url=url, durable=True, publish_timeout_s=1) as p:
        with pytest.raises(DatabaseUnavailable, match="nothing was recorded or sent") as raised:
            p.start_turn("ops", session_id, "hi")

    assert isinstance(raised.value, ConnectionError)
    assert rclient.llen(names.queue) == 0


def test_a_database_that_was_never_migrated_is_named(redis_url: str, database_url: str, session_id: str) -> None:
    name = f"june_bare_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'create database "{name}"')
    url = psycopg.conninfo.make_conninfo(**{**psycopg.conninfo.conninfo_to_dict(database_url), "dbname": name})
    try:
        with JuneProducer(redis_url, database_url=url, durable=True) as p:
            with pytest.raises(ProducerConfigError, match="june migrate"):
                p.start_turn("ops", session_id, "hi")
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'drop database if exists "{name}" with (force)')


@pytest.fixture
def own_db(database_url: str) -> Iterator[str]:
    """A migrated database of this test's own, for a test that changes its privileges or triggers."""
    with migrated_database(database_url, "june_durable_own") as url:
        yield url


def test_a_database_user_that_may_not_record_turns_is_a_config_error_saying_what_to_grant(
    redis_url: str, own_db: str, session_id: str
) -> None:
    role = f"june_producer_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(own_db, autocommit=True) as conn:
        conn.execute(f"create role {role} login")  # may connect and run the function, not write the tables
    try:
        url = psycopg.conninfo.make_conninfo(own_db, user=role)
        with JuneProducer(redis_url, database_url=url, durable=True) as p:
            with pytest.raises(ProducerConfigError, match="may not record turns") as raised:
                p.start_turn("ops", session_id, "hi")
        assert "InsufficientPrivilege: permission denied" in str(raised.value)
        assert "grant it EXECUTE on june_enqueue_turn" in str(raised.value) and "\n" not in str(raised.value)
        assert _stored(own_db, session_id) == []
    finally:
        with psycopg.connect(own_db, autocommit=True) as conn:
            conn.execute(f"drop owned by {role}")
            conn.execute(f"drop role {role}")


def test_a_record_postgres_refuses_for_another_reason_is_one_clear_line_from_the_cli_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    redis_url: str,
    own_db: str,
    names: Names,
    rclient: redis.Redis,
    session_id: str,
) -> None:
    from producers import ProducerError
    from producers.cli import main

    with psycopg.connect(own_db, autocommit=True) as conn:  # an application's own rule, enforced in the database
        conn.execute(
            "create function no_turns() returns trigger language plpgsql as "
            "$$ begin raise exception 'turns are closed for maintenance'; end $$"
        )
        conn.execute("create trigger no_turns before insert on june_turns for each row execute function no_turns()")
    with JuneProducer(redis_url, queue=names.queue, database_url=own_db, durable=True) as p:
        with pytest.raises(ProducerError, match="Postgres refused it") as raised:
            p.start_turn("ops", session_id, "hi")
    assert "RaiseException: turns are closed for maintenance" in str(raised.value)
    assert "nothing was recorded or sent" in str(raised.value)

    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**names.env(redis_url), "JUNE_DATABASE_URL": own_db}.items():
        monkeypatch.setenv(name, value)
    assert main(["turn", "ops", session_id, "hi", "--durable", "--no-follow", "--json"]) == 5
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("june-produce: could not record turn t_"), err
    assert rclient.llen(names.queue) == 0


def test_durable_needs_a_database_and_refuses_replace(durable: JuneProducer, redis_url: str) -> None:
    with pytest.raises(ProducerConfigError, match="database_url"):
        JuneProducer(redis_url, durable=True)
    with JuneProducer(redis_url) as plain:
        with pytest.raises(ProducerConfigError, match="database_url"):
            plain.start_turn("ops", "s1", "hi", durable=True)
    with pytest.raises(ValueError, match="replace"):
        durable.start_turn("ops", "s1", "hi", replace=True)


EVENTS: list[tuple[dict[str, Any], bool]] = [  # (an inbound event, whether a durable producer records it)
    ({"source": "slack"}, True),
    ({"source": "slack", "user": {"id": "U1", "attested": True, "team": "T1"}, "principal": {"id": "a", "x": 1}}, True),
    ({"source": "cli", "kind": "message", "thread": "t", "text": "hi", "raw": {"any": [1, 2]}, "extra": True}, True),
    ({"source": "slack", "user": None, "principal": None, "kind": None}, True),
    ({}, False),
    ({"source": 7}, False),
    ({"source": "slack", "user": {"id": 5}}, False),
    ({"source": "slack", "user": {"name": "ann"}}, False),
    ({"source": "slack", "user": {"id": "U1", "attested": "yes"}}, False),  # stricter than the worker: fine
    ({"source": "slack", "user": "U1"}, False),
    ({"source": "slack", "principal": {"name": "acct"}}, False),
    ({"source": "slack", "thread": 12}, False),
    ({"source": "slack", "text": ["a"]}, False),
]


@pytest.mark.parametrize(("event", "recorded"), EVENTS)
def test_an_event_is_recorded_only_if_a_worker_can_read_it(event: dict[str, Any], recorded: bool) -> None:
    try:
        check_event(event)
        accepted = True
    except ValueError:
        accepted = False
    try:
        InboundEvent.model_validate(event)
        readable = True
    except ValidationError:
        readable = False
    assert accepted == recorded
    assert readable or not accepted, f"the producer would record {event}, which a worker cannot read"


def test_an_unreadable_event_is_refused_before_anything_is_recorded_or_sent(
    durable: JuneProducer, db: str, names: Names, rclient: redis.Redis, session_id: str
) -> None:
    with pytest.raises(ValueError, match="user"):
        durable.start_turn("ops", session_id, "hi", event={"source": "slack", "user": {"id": 5}})

    assert _stored(db, session_id) == []
    assert rclient.llen(names.queue) == 0


UNSTORABLE: list[tuple[str, dict[str, Any], str]] = [  # (how it is sent, its arguments, what the error names)
    ("start_turn", {"text": "order\x00 2"}, "text: contains a NUL character at index 5"),
    ("start_turn", {"text": "caf\udce9"}, "text: contains a lone surrogate (U+DCE9) at index 3"),
    ("start_turn", {"event": {"source": "slack", "user": {"id": "U\x001"}}}, "event.user.id: contains a NUL"),
    ("start_turn", {"trigger": {"kind": "proactive", "by": "cron\udcff"}}, "trigger.by: contains a lone surrogate"),
    ("start_turn", {"target": {"channel": "C\x00"}}, "target.channel: contains a NUL"),
    ("proactive", {"by": "cron\x00daily"}, "by: contains a NUL character at index 4"),
    ("proactive", {"text": "\ud800", "by": "cron"}, "text: contains a lone surrogate (U+D800)"),
    ("proactive", {"by": "cron", "target": {"t\udcff": 1}}, "target (a key): contains a lone surrogate"),
]


@pytest.mark.parametrize(("method", "arguments", "named"), UNSTORABLE)
def test_a_durable_turn_holding_a_string_no_store_can_hold_is_refused_before_anything_is_recorded_or_sent(
    durable: JuneProducer,
    db: str,
    names: Names,
    rclient: redis.Redis,
    session_id: str,
    method: str,
    arguments: dict[str, Any],
    named: str,
) -> None:
    send = getattr(durable, method)
    arguments = {"text": "hi", **({"by": "cron"} if method == "proactive" else {}), **arguments}
    text = arguments.pop("text")

    with pytest.raises(ValueError, match="cannot be stored") as refused:
        send("ops", session_id, text, **arguments)

    assert named in str(refused.value) and "NUL characters or lone surrogates" in str(refused.value)
    assert _stored(db, session_id) == []
    assert rclient.llen(names.queue) == 0


def test_the_store_records_a_turn_through_the_same_function(db: str, session_id: str) -> None:
    # the worker's store and the durable producer share june_enqueue_turn: one rule for both
    store = PostgresStore(db)
    try:
        rec, recorded = store.enqueue_turn(SessionRef("ops", session_id), "t_store", TurnPayload(text="hi"))
        again = store.enqueue_turn(SessionRef("ops", session_id), "t_store", TurnPayload(text="hi"))
    finally:
        store.close()
    assert (rec.turn_id, rec.status, rec.position, recorded) == ("t_store", "queued", 1, True)
    assert (again[0].position, again[1]) == (1, False)
    with psycopg.connect(db) as conn:
        statements = conn.execute("select count(*) from pg_proc where proname = 'june_enqueue_turn'").fetchone()
    assert statements == (1,)


def test_the_cli_records_a_turn_with_durable_and_says_what_is_missing_without_a_database(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    redis_url: str,
    db: str,
    names: Names,
    rclient: redis.Redis,
    session_id: str,
) -> None:
    from producers.cli import main

    for name in ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "JUNE_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in names.env(redis_url).items():
        monkeypatch.setenv(name, value)

    assert main(["turn", "ops", session_id, "hi", "--durable", "--no-follow", "--json"]) == 2
    assert "durable=True needs database_url (JUNE_DATABASE_URL)" in capsys.readouterr().err

    monkeypatch.setenv("JUNE_DATABASE_URL", db)
    assert main(["turn", "ops", session_id, "hi", "--durable", "--no-follow", "--json"]) == 0
    turn_id = json.loads(capsys.readouterr().out)["turn_id"]
    assert [(t, s) for t, s, _ in _stored(db, session_id)] == [(turn_id, "queued")]
    assert pop_message(rclient, names.queue).args[0]["turn_id"] == turn_id
