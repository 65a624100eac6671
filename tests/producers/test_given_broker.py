"""A producer talks to the broker and result backend it was given, whatever Celery's variables in the process say.

Celery lets ``CELERY_BROKER_URL``, ``CELERY_BROKER_WRITE_URL``, ``CELERY_RESULT_BACKEND``, ``CELERY_LOADER`` and
``CELERY_CONFIG_MODULE`` in ``os.environ`` override or extend an app's own settings. A service that talks to two
june deployments, or a test harness, would then enqueue turns where no worker listens. Real Redis throughout: two
databases of the test server stand for the two deployments.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis

from producers import JuneProducer
from tests._services import closed_port

from .conftest import Names
from .kit import pop_message, queue_keys

pytestmark = pytest.mark.integration

PASSWORD = "s3cret-pw"


def on_db(url: str, db: int) -> str:
    """``url`` (``redis://host:port/0``) on Redis database ``db``."""
    return url.rsplit("/", 1)[0] + f"/{db}"


@pytest.fixture
def elsewhere(redis_url: str, names: Names) -> Iterator[redis.Redis]:
    """Database 5 of the test Redis: what the process's Celery variables name (no worker listens there)."""
    client = redis.Redis.from_url(on_db(redis_url, 5), decode_responses=True)
    yield client
    client.delete(*queue_keys(names.queue, names.control_queue))
    client.close()


@pytest.fixture
def given(redis_url: str, names: Names) -> Iterator[redis.Redis]:
    """Database 6 of the test Redis: the broker the producer is given."""
    client = redis.Redis.from_url(on_db(redis_url, 6), decode_responses=True)
    yield client
    client.delete(*queue_keys(names.queue, names.control_queue))
    client.close()


@pytest.mark.parametrize("variable", ["CELERY_BROKER_URL", "CELERY_BROKER_WRITE_URL"])
def test_a_turn_goes_to_the_broker_in_the_producers_mapping_not_to_the_one_the_process_environment_names(
    variable: str,
    redis_url: str,
    names: Names,
    elsewhere: redis.Redis,
    given: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    session_id: str,
) -> None:
    # Given the process's environment names broker db 5, and a producer whose mapping names db 6
    monkeypatch.setenv(variable, on_db(redis_url, 5))
    env = {**names.env(redis_url), "CELERY_BROKER_URL": on_db(redis_url, 6)}
    with JuneProducer.from_env(env) as producer:
        # When it starts a turn
        turn_id = producer.start_turn("ops", session_id, "hello")
    # Then the turn is on db 6, and nothing is on db 5
    message = pop_message(given, names.queue)
    assert (message.task, message.args[0]["turn_id"]) == ("june.turn", turn_id)
    assert elsewhere.llen(names.queue) == 0


def test_a_control_call_reads_its_answer_from_the_result_backend_it_was_given(
    redis_url: str, control_producer: JuneProducer, monkeypatch: pytest.MonkeyPatch, session_id: str
) -> None:
    # Given the stub worker answers on the test Redis, and the process's CELERY_RESULT_BACKEND names a Redis that
    # is not there (results are published on a channel, which every database of one server shares)
    monkeypatch.setenv("CELERY_RESULT_BACKEND", f"redis://127.0.0.1:{closed_port()}/5")
    with JuneProducer(
        redis_url,
        result_backend=redis_url,
        queue=control_producer.queue,
        control_queue=control_producer.control_queue,
        key_prefix=control_producer.key_prefix,
    ) as producer:
        # When the producer, given the test Redis for results, resets a session
        outcome = producer.reset("ops", session_id, timeout_s=10)
    # Then it reads the worker's answer there
    assert outcome.status == "reset"


def test_a_turn_needs_no_result_backend_when_the_process_environment_names_one(
    redis_url: str, names: Names, rclient: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the process's environment names a result backend that is not there, and a producer without one for
    # turns (they store no result)
    monkeypatch.setenv("CELERY_RESULT_BACKEND", f"redis://127.0.0.1:{closed_port()}/5")
    with JuneProducer(redis_url, queue=names.queue, control_queue=names.control_queue) as producer:
        # When it starts a turn
        turn_id = producer.start_turn("ops", "s1", "hello")
    # Then the turn is sent, without asking that backend anything
    assert pop_message(rclient, names.queue).args[0]["turn_id"] == turn_id


@pytest.mark.parametrize("variable", ["CELERY_CONFIG_MODULE", "CELERY_LOADER"])
def test_a_producer_imports_no_celery_settings_module_the_process_environment_names(
    variable: str, redis_url: str, names: Names, rclient: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the process's environment names a settings module (or loader) this service does not have
    monkeypatch.setenv(variable, "a_worker_deployments_celeryconfig")
    with JuneProducer(redis_url, queue=names.queue, control_queue=names.control_queue) as producer:
        # When it starts a turn
        turn_id = producer.start_turn("ops", "s1", "hello")
    # Then the turn is sent with the producer's own settings (nothing was imported, nothing failed)
    assert pop_message(rclient, names.queue).args[0]["turn_id"] == turn_id


def test_a_producer_names_its_broker_results_and_events_in_its_repr_and_log_without_passwords(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given URLs that carry a password, in the user-info and in the query
    broker = f"redis://:{PASSWORD}@broker.internal:6379/6"
    results = f"redis://results.internal:6379/7?password={PASSWORD}"
    # When a producer is made with them
    with caplog.at_level(logging.INFO, logger="producers"):
        producer = JuneProducer("redis://events.internal:6379/1", broker_url=broker, result_backend=results)
    try:
        # Then its repr and its log say where each goes, and neither holds the password
        for text in (repr(producer), caplog.text):
            assert "redis://***@broker.internal:6379/6" in text
            assert "redis://results.internal:6379/7?password=***" in text
            assert "redis://events.internal:6379/1" in text
            assert PASSWORD not in text
    finally:
        producer.close()
