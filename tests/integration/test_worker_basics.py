"""A turn sent by task name runs on a real Celery worker; its events are read back from Redis. On both brokers."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap

import pytest

from june_worker.stores.postgres import PostgresStore

from .conftest import Stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.brokers("redis", "amqp"), pytest.mark.modes("prefork", "threads")]


@pytest.fixture(scope="module", autouse=True)
def workers(stack: Stack) -> None:
    stack.worker("w1")
    stack.worker("w2", pool="solo")


def test_a_turn_enqueued_by_name_from_a_process_without_june_worker_completes(stack: Stack, session_id: str) -> None:
    # Given a producer process that imports celery and redis only (on RabbitMQ it declares the
    # turn queue as the workers do: a quorum queue; Redis ignores the setting)
    script = textwrap.dedent(
        f"""
        import json, sys, uuid
        from celery import Celery
        import redis
        app = Celery(broker={stack.broker_url!r})
        app.conf.task_serializer = "json"
        app.conf.task_create_missing_queue_type = "quorum"
        turn_id = "t_" + uuid.uuid4().hex
        app.send_task("june.turn", args=[{{"turn_id": turn_id, "agent": "ops", "session": {session_id!r},
                      "text": "order 3 widget"}}], queue={stack.queue!r})
        r = redis.Redis.from_url({stack.redis_url!r}, decode_responses=True)
        last, seen, waited = "0-0", [], 0
        while True:
            got = r.xread({{{stack.stream_key("ops", session_id)!r}: last}}, block=1000, count=100)
            if not got:
                waited += 1
                if waited > 20:
                    sys.exit("no events within 20 s")
                continue
            for entry_id, fields in got[0][1]:
                last = entry_id
                seen.append(fields["type"])
                if fields["type"] == "turn.completed":
                    print(json.dumps({{"turn_id": turn_id, "types": seen,
                                      "june_worker_imported": any(m.startswith("june_worker") for m in sys.modules)}}))
                    sys.exit(0)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    import json

    report = json.loads(out.stdout)
    assert report["june_worker_imported"] is False
    structural = [t for t in report["types"] if not t.endswith(".delta")]
    assert structural == [
        "turn.started",
        "message.completed",
        "action.requested",
        "action.completed",
        "message.completed",
        "turn.completed",
    ]
    rows = stack.sql("select item, qty from it_orders where turn_id = %s", report["turn_id"])
    assert rows == [("widget", 3)]


def test_each_stream_entry_carries_type_turn_session_and_seq(stack: Stack, session_id: str) -> None:
    turn_id = stack.turn("ops", session_id, "hello")
    stack.wait_terminal("ops", session_id, turn_id)
    events = stack.structural("ops", session_id)
    assert [e["seq"] for e in events] == [1, 2, 3]
    assert all(e["turn_id"] == turn_id and e["session"] == session_id and e["agent"] == "ops" for e in events)
    assert events[-1]["type"] == "turn.completed" and events[-1]["text"] == "ok: hello"


def test_the_task_result_is_a_small_summary(stack: Stack, session_id: str) -> None:
    turn_id = f"t_summary_{session_id}"
    result = stack.send("june.turn", {"turn_id": turn_id, "agent": "ops", "session": session_id, "text": "hi"})
    assert stack.outcome(result) == {"turn_id": turn_id, "agent": "ops", "session": session_id, "status": "completed"}
    assert result.state == "PENDING"  # turn tasks store no result: nobody reads it, storage stays bounded


def test_the_same_message_delivered_twice_gives_one_turn_and_one_row(stack: Stack, session_id: str) -> None:
    payload = {"turn_id": f"t_dup_{session_id}", "agent": "ops", "session": session_id, "text": "order 1 gadget"}
    first = stack.send("june.turn", payload)
    second = stack.send("june.turn", payload)
    assert stack.outcome(first)["status"] in ("completed", "running", "queued")
    stack.outcome(second)
    wait_for(lambda: (stack.turn_row("ops", session_id, payload["turn_id"]) or {}).get("status") == "completed")
    assert stack.sql("select count(*) from it_orders where turn_id = %s", payload["turn_id"]) == [(1,)]
    users = stack.sql(
        "select count(*) from june_messages where agent = 'ops' and session = %s and role = 'user'", session_id
    )
    assert users == [(1,)]
    started = [e for e in stack.structural("ops", session_id) if e["type"] == "turn.started"]
    assert len(started) == 1


def test_a_turn_a_producer_recorded_and_delivered_twice_runs_once(stack: Stack, session_id: str) -> None:
    # Given a turn recorded in Postgres by a durable producer (the schema migrated, as `june migrate` does)
    PostgresStore(stack.db_url).close()
    with contextlib.closing(stack.producer(database_url=stack.db_url)) as producer:
        turn_id = producer.start_turn("ops", session_id, "order 2 sprocket", durable=True)
    # When the same message is delivered twice more
    payload = {"turn_id": turn_id, "agent": "ops", "session": session_id, "text": "order 2 sprocket"}
    for result in [stack.send("june.turn", payload), stack.send("june.turn", payload)]:
        stack.outcome(result)
    # Then it ran once: one order row, one opening, one start
    wait_for(lambda: (stack.turn_row("ops", session_id, turn_id) or {}).get("status") == "completed")
    assert stack.sql("select count(*) from it_orders where turn_id = %s", turn_id) == [(1,)]
    users = stack.sql(
        "select count(*) from june_messages where agent = 'ops' and session = %s and role = 'user'", session_id
    )
    assert users == [(1,)]
    assert [e["type"] for e in stack.structural("ops", session_id)].count("turn.started") == 1
