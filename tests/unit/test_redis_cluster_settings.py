"""How a Redis Cluster is named (``redis+cluster://``), and where one may not be used: broker, result backend."""

from __future__ import annotations

import pytest

from june_wire.redis_url import LazyRedisCluster, connect, describe, parse_cluster_url
from june_worker.errors import ConfigError
from june_worker.gateway.settings import GatewaySettings
from june_worker.worker.settings import WorkerSettings
from producers import JuneProducer, ProducerConfigError

CLUSTER = "redis+cluster://10.0.0.1:7000,10.0.0.2:7001"
SINGLE = "redis://broker:6379/0"


def test_a_cluster_url_names_its_seed_nodes_credentials_and_tls() -> None:
    where = parse_cluster_url("rediss+cluster://june:s%40cret@r-0.internal:6380,[::1]:6381/0")
    assert where.nodes == (("r-0.internal", 6380), ("::1", 6381))
    assert (where.username, where.password, where.tls) == ("june", "s@cret", True)
    assert parse_cluster_url(CLUSTER).nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001))


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+cluster://10.0.0.1", "host:port"),
        ("redis+cluster://10.0.0.1:7000,", "host:port"),
        ("redis+cluster://10.0.0.1:99999", "host:port"),
        ("redis+cluster://10.0.0.1:7000/3", "no database but 0"),
        ("redis+cluster://10.0.0.1:7000?timeout=3", "no query string"),
        ("redis://10.0.0.1:7000", "not a Redis Cluster URL"),
    ],
)
def test_a_bad_cluster_url_is_refused_saying_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_cluster_url(url)


def test_a_cluster_client_connects_on_first_use_and_its_description_holds_no_password() -> None:
    client = connect("redis+cluster://:hunter2@127.0.0.1:1")  # nothing listens there: no error until used
    assert isinstance(client, LazyRedisCluster)
    assert describe(client) == "Redis Cluster 127.0.0.1:1"
    client.close()


def test_workers_refuse_a_cluster_as_broker_or_result_backend_and_say_which_variable() -> None:
    with pytest.raises(ConfigError, match="CELERY_BROKER_URL is a Redis Cluster"):
        WorkerSettings.from_env({"JUNE_REDIS_URL": CLUSTER})  # the broker defaults to JUNE_REDIS_URL
    with pytest.raises(ConfigError, match="CELERY_RESULT_BACKEND is a Redis Cluster"):
        WorkerSettings.from_env({"JUNE_REDIS_URL": CLUSTER, "CELERY_BROKER_URL": SINGLE})
    with pytest.raises(ConfigError, match="JUNE_REDIS_URL: a Redis Cluster URL lists its nodes"):
        WorkerSettings.from_env({"JUNE_REDIS_URL": "redis+cluster://a", "CELERY_BROKER_URL": SINGLE,
                                 "CELERY_RESULT_BACKEND": SINGLE})  # fmt: skip


def test_on_a_cluster_the_firehose_is_split_over_sixteen_partitions_unless_told_otherwise() -> None:
    env = {"JUNE_REDIS_URL": CLUSTER, "CELERY_BROKER_URL": SINGLE, "CELERY_RESULT_BACKEND": SINGLE}
    assert WorkerSettings.from_env(env).firehose_partitions == 16
    assert WorkerSettings.from_env({**env, "JUNE_FIREHOSE_PARTITIONS": "4"}).firehose_partitions == 4
    assert WorkerSettings.from_env({"JUNE_REDIS_URL": SINGLE}).firehose_partitions == 1


def test_the_gateway_reads_as_many_firehose_partitions_as_the_workers_write_by_default() -> None:
    # Given the same environment on both sides (the gateway's console feed reads what the workers append)
    env = {"JUNE_REDIS_URL": CLUSTER, "CELERY_BROKER_URL": SINGLE, "CELERY_RESULT_BACKEND": SINGLE,
           "JUNE_GATEWAY_AGENTS": "ops", "JUNE_GATEWAY_INSECURE_DEV": "1"}  # fmt: skip
    for extra in ({}, {"JUNE_FIREHOSE_PARTITIONS": "4"}, {"JUNE_REDIS_URL": SINGLE}):
        both = {**env, **extra}
        worker = WorkerSettings.from_env(both).firehose_partitions
        # Then the gateway's count is the workers': from its environment, and built directly
        assert GatewaySettings.from_env(both).firehose_partitions == worker
        direct = GatewaySettings(agents=("ops",), insecure_dev=True, redis_url=both["JUNE_REDIS_URL"])
        assert direct.firehose_partitions == (worker if "JUNE_FIREHOSE_PARTITIONS" not in extra else 16)
    assert GatewaySettings.from_env(env).firehose_partitions == 16


def test_the_gateway_and_producers_refuse_a_cluster_as_broker_or_result_backend() -> None:
    with pytest.raises(ConfigError, match="CELERY_BROKER_URL is a Redis Cluster"):
        GatewaySettings.from_env({"JUNE_REDIS_URL": CLUSTER, "JUNE_GATEWAY_AGENTS": "ops"})
    with pytest.raises(ProducerConfigError, match="broker_url is a Redis Cluster"):
        JuneProducer(CLUSTER)
    with pytest.raises(ProducerConfigError, match="result_backend is a Redis Cluster"):
        JuneProducer(CLUSTER, broker_url=SINGLE)
