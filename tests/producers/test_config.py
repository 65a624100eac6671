"""A producer is configured like the worker: the same variables, the same defaults."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from producers import JuneProducer, ProducerConfigError, ResultTimeout, TaskFailed


def test_from_env_reads_the_worker_variables() -> None:
    env = {
        "JUNE_REDIS_URL": "redis://events:6379/1",
        "CELERY_BROKER_URL": "redis://broker:6379/2",
        "CELERY_RESULT_BACKEND": "redis://results:6379/3",
        "JUNE_QUEUE": "turns",
        "JUNE_CONTROL_QUEUE": "turns.control",
        "JUNE_KEY_PREFIX": "prod",
    }
    with JuneProducer.from_env(env) as producer:
        assert producer.redis_url == "redis://events:6379/1"
        assert producer.broker_url == "redis://broker:6379/2"
        assert producer.result_backend == "redis://results:6379/3"
        assert (producer.queue, producer.control_queue, producer.key_prefix) == ("turns", "turns.control", "prod")
        assert producer.stream_key("ops", "s1") == "prod:events:{ops:s1}"


def test_broker_and_result_backend_default_to_the_redis_url() -> None:
    with JuneProducer.from_env({"JUNE_REDIS_URL": "redis://events:6379/1"}) as producer:
        assert producer.broker_url == producer.result_backend == "redis://events:6379/1"
        assert (producer.queue, producer.control_queue, producer.key_prefix) == ("june", "june.control", "june")
        assert producer.stream_key("ops", "s1") == "june:events:{ops:s1}"


def test_an_empty_variable_is_a_config_error_naming_it() -> None:
    with pytest.raises(ProducerConfigError, match="JUNE_CONTROL_QUEUE"):
        JuneProducer.from_env({"JUNE_CONTROL_QUEUE": ""})


@pytest.mark.parametrize(
    "kwargs",
    [{"queue": "has space"}, {"control_queue": ""}, {"key_prefix": "a{b}"}, {"broker_url": "localhost"}],
)
def test_bad_settings_are_config_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ProducerConfigError):
        JuneProducer(**kwargs)


def test_repr_hides_passwords() -> None:
    with JuneProducer("redis://:pa55word@cache:6379/0") as producer:
        assert "pa55word" not in repr(producer)
        assert "redis://***@cache:6379/0" in repr(producer)


def test_errors_survive_pickling() -> None:
    for error in (ResultTimeout("june.reset", "session ops:s1", 5, "june.control", "id-1"), TaskFailed("a", "b", "c")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
