"""What the worker asks of each broker (june_worker/worker/broker.py), and that producers ask the same."""

from __future__ import annotations

from typing import Any

import pytest

from june_worker.errors import ConfigError
from june_worker.worker.broker import celery_options, publish_options, queues
from june_worker.worker.settings import WorkerSettings
from producers import JuneProducer

REDIS = {"CELERY_BROKER_URL": "redis://broker:6379/0"}
SENTINEL = {"CELERY_BROKER_URL": "sentinel://sentinel-1:26379;sentinel://sentinel-2:26379/0"}
AMQP = {"CELERY_BROKER_URL": "amqp://guest:guest@rabbit:5672//"}


def _options(env: dict[str, str]) -> dict[str, Any]:
    return celery_options(WorkerSettings.from_env(env))


def test_on_redis_an_unacknowledged_message_comes_back_after_three_leases_not_an_hour() -> None:
    transport = _options({**REDIS, "JUNE_LEASE_S": "30"})["broker_transport_options"]
    assert transport["visibility_timeout"] == 90.0
    assert transport["unacked_restore_interval"] == 15.0  # looked for every sixth of it
    assert transport["unacked_restore_throttle"] == 1  # and every look scans (kombu's default: one in ten)
    short = _options({**REDIS, "JUNE_LEASE_S": "2"})["broker_transport_options"]
    assert short["visibility_timeout"] == 6.0
    given = _options({**REDIS, "JUNE_BROKER_VISIBILITY_S": "600"})["broker_transport_options"]
    assert given["visibility_timeout"] == 600.0


def test_on_redis_a_publish_cannot_wait_forever() -> None:
    options = _options({**REDIS, "JUNE_PUBLISH_TIMEOUT_S": "2", "JUNE_PUBLISH_RETRIES": "4"})
    assert options["broker_transport_options"]["socket_timeout"] == 2.0
    assert options["broker_transport_options"]["socket_connect_timeout"] == 2.0
    assert options["broker_connection_timeout"] == 2.0
    assert options["task_publish_retry_policy"]["max_retries"] == 4


def test_behind_sentinel_a_publish_is_bounded_too_and_redis_py_does_not_retry_on_its_own() -> None:
    env = {**SENTINEL, "JUNE_PUBLISH_TIMEOUT_S": "2"}
    transport = _options(env)["broker_transport_options"]
    assert (transport["socket_timeout"], transport["socket_connect_timeout"]) == (2.0, 2.0)
    asked = transport["sentinel_kwargs"]
    assert (asked["socket_timeout"], asked["socket_connect_timeout"], asked["retry"].get_retries()) == (2.0, 2.0, 0)
    with JuneProducer.from_env(env, broker_transport_options={"master_name": "june"}) as producer:
        for app in (producer._turn_app, producer._control_app):
            given = app.conf.broker_transport_options
            assert (given["socket_timeout"], given["socket_connect_timeout"]) == (2.0, 2.0)
            sentinel = given["sentinel_kwargs"]
            assert (sentinel["socket_timeout"], sentinel["socket_connect_timeout"]) == (2.0, 2.0)
            assert sentinel["retry"].get_retries() == 0 and given["master_name"] == "june"


def test_on_rabbitmq_queues_are_durable_quorum_queues_and_publishes_are_confirmed() -> None:
    options = _options({**AMQP, "JUNE_QUEUE": "turns", "JUNE_CONTROL_QUEUE": "turns.control"})
    declared = [(q.name, q.durable, q.queue_arguments) for q in options["task_queues"]]
    assert declared == [
        ("turns", True, {"x-queue-type": "quorum"}),
        ("turns.control", True, {"x-queue-type": "quorum"}),  # control messages on a queue of their own
    ]
    assert options["broker_transport_options"] == {"confirm_publish": True}
    assert options["task_default_delivery_mode"] == "persistent"
    assert publish_options(WorkerSettings.from_env(AMQP)) == {"timeout": 5.0, "confirm_timeout": 5.0}


def test_the_queue_type_can_be_classic_and_nothing_else() -> None:
    classic = _options({**AMQP, "JUNE_BROKER_QUEUE_TYPE": "classic"})["task_queues"]
    assert {q.queue_arguments["x-queue-type"] for q in classic} == {"classic"}
    with pytest.raises(ConfigError, match="JUNE_BROKER_QUEUE_TYPE"):
        WorkerSettings.from_env({**AMQP, "JUNE_BROKER_QUEUE_TYPE": "stream"})


def test_the_worker_app_is_configured_with_them() -> None:
    from june_worker.worker.app import app

    assert app.conf.task_acks_late is True and app.conf.task_reject_on_worker_lost is True
    assert [q.name for q in app.conf.task_queues] == [
        app.conf.task_default_queue,
        app.conf.task_routes["june.cancel"]["queue"],
    ]
    assert app.conf.task_publish_retry_policy["max_retries"] == WorkerSettings.from_env().publish_retries


@pytest.mark.parametrize("env", [REDIS, AMQP, {**AMQP, "JUNE_BROKER_QUEUE_TYPE": "classic"}])
def test_a_producer_declares_the_queues_the_workers_declare(env: dict[str, str]) -> None:
    env = {**env, "JUNE_QUEUE": "turns", "JUNE_CONTROL_QUEUE": "turns.control", "JUNE_PUBLISH_RETRIES": "2"}
    worker = {(q.name, q.durable, str(q.queue_arguments)) for q in queues(WorkerSettings.from_env(env))}
    with JuneProducer.from_env(env) as producer:
        for app in (producer._turn_app, producer._control_app):
            assert {(q.name, q.durable, str(q.queue_arguments)) for q in app.conf.task_queues} == worker
            policy = dict(app.conf.task_publish_retry_policy)
            assert callable(policy.pop("errback"))  # it counts each retry (producers/metrics.py), nothing more
            assert policy == celery_options(WorkerSettings.from_env(env))["task_publish_retry_policy"]


@pytest.mark.parametrize("env", [REDIS, SENTINEL, AMQP])
def test_every_broker_setting_is_one_the_installed_celery_and_kombu_read(env: dict[str, str]) -> None:
    # Celery and kombu ignore a setting or transport option they do not know without a word: the floors in
    # pyproject.toml (celery 5.5, kombu 5.7) are the versions that read all of these.
    import inspect

    import amqp
    from celery.app.defaults import NAMESPACES, flatten
    from kombu.transport import redis

    options = _options(env)
    assert set(options) <= {name for name, _ in flatten(NAMESPACES)}
    if env is REDIS:
        read = set(redis.Channel.from_transport_options)
    elif env is SENTINEL:
        read = set(redis.SentinelChannel.from_transport_options)
    else:  # kombu hands RabbitMQ's transport options to py-amqp's connection as keyword arguments
        read = set(inspect.signature(amqp.Connection).parameters)
    assert set(options["broker_transport_options"]) <= read
