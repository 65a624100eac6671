"""docker-compose.yml cannot run here (no Docker engine); this checks it says what the code reads."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from june_worker.worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


def _june_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if svc.get("build") == "."}


def _variables_the_code_reads() -> set[str]:
    """Every JUNE_* / CELERY_* / ANTHROPIC_* name the package's code mentions as a string."""
    pattern = re.compile(r"""["']((?:JUNE|CELERY|ANTHROPIC)_[A-Z0-9_]+)["']""")
    return {name for path in (ROOT / "june_worker").rglob("*.py") for name in pattern.findall(path.read_text())}


def test_the_stack_has_its_services_each_with_a_health_check(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"postgres", "redis", "worker", "control", "beat", "flower"} <= set(services)
    assert "FLOWER_BASIC_AUTH" in services["flower"]["environment"]  # Flower is never open without a login
    for name, svc in services.items():
        assert "healthcheck" in svc, f"service {name} has no health check"


def test_june_services_start_the_celery_app_the_package_exposes(compose: dict[str, Any]) -> None:
    from celery import Celery

    import june_worker.celery

    assert isinstance(june_worker.celery.app, Celery)
    commands = {name: svc["command"] for name, svc in _june_services(compose).items()}
    assert set(commands) >= {"worker", "beat", "flower"}
    for name, command in commands.items():
        argv = command if isinstance(command, list) else shlex.split(command)
        if argv[0] == "celery":
            assert argv[1:3] == ["-A", "june_worker"], f"{name} must start the june_worker app"
            assert argv[3] in {"worker", "beat", "flower"}
        else:
            assert argv[0] == "june", f"{name} runs neither celery nor the june command"


def test_every_variable_the_stack_sets_is_one_the_code_reads(compose: dict[str, Any]) -> None:
    read = _variables_the_code_reads()
    for name, svc in _june_services(compose).items():
        env = svc["environment"]
        unknown = {v for v in set(env) - read if not v.startswith("FLOWER_")}  # FLOWER_* is Flower's own
        assert not unknown, f"{name} sets variables nothing reads: {sorted(unknown)}"
        assert {"JUNE_DATABASE_URL", "JUNE_REDIS_URL", "CELERY_BROKER_URL", "JUNE_AGENTS"} <= set(env)
        WorkerSettings.from_env({k: str(v) for k, v in env.items()})  # parses: no ConfigError


def test_urls_point_at_the_stacks_own_postgres_and_redis(compose: dict[str, Any]) -> None:
    pg = compose["services"]["postgres"]["environment"]
    for svc in _june_services(compose).values():
        env = svc["environment"]
        db = urlparse(env["JUNE_DATABASE_URL"])
        assert (db.hostname, db.username, db.password, db.path.lstrip("/")) == (
            "postgres",
            pg["POSTGRES_USER"],
            pg["POSTGRES_PASSWORD"],
            pg["POSTGRES_DB"],
        )
        for var in ("JUNE_REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND"):
            assert urlparse(env[var]).hostname == "redis", var
        assert svc["depends_on"] == {
            "postgres": {"condition": "service_healthy"},
            "redis": {"condition": "service_healthy"},
        }


def test_redis_the_broker_keeps_what_it_acknowledged_across_a_restart(compose: dict[str, Any]) -> None:
    # Redis carries the turn messages: without AOF a restart loses every message not yet taken
    redis = compose["services"]["redis"]
    argv = redis["command"] if isinstance(redis["command"], list) else shlex.split(redis["command"])
    options = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert argv[0] == "redis-server"
    assert options["--appendonly"] == "yes"
    assert options["--appendfsync"] in ("everysec", "always")
    assert "/data" in _mount_points(redis)  # a named volume: the AOF outlives the container
    for svc in _june_services(compose).values():
        assert urlparse(svc["environment"]["CELERY_BROKER_URL"]).hostname == "redis"


def _mount_points(service: dict[str, Any]) -> set[str]:
    return {v["target"] if isinstance(v, dict) else str(v).split(":")[1] for v in service.get("volumes", [])}


def worker_queues(compose: dict[str, Any]) -> dict[str, tuple[set[str], WorkerSettings]]:
    """Each june worker service of the stack: the queues it consumes (``-Q``) and its settings."""
    out = {}
    for name, svc in _june_services(compose).items():
        argv = svc["command"] if isinstance(svc["command"], list) else shlex.split(svc["command"])
        if argv[:4] == ["celery", "-A", "june_worker", "worker"]:
            settings = WorkerSettings.from_env({k: str(v) for k, v in svc["environment"].items()})
            out[name] = (set(argv[argv.index("-Q") + 1].split(",")), settings)
    return out


def test_the_turn_queue_and_the_control_queue_are_consumed_each_by_workers_of_its_own(compose: dict[str, Any]) -> None:
    # a worker consuming both may keep a control message while its pool runs turns (per-consumer prefetch on
    # RabbitMQ's quorum queues): a cancel would wait for the turn it cancels (tests/integration/test_control_layout.py)
    workers = worker_queues(compose)
    consumed = set().union(*(queues for queues, _ in workers.values()))
    for queues, settings in workers.values():
        assert consumed == {settings.queue, settings.control_queue}
        assert queues in ({settings.queue}, {settings.control_queue})


def test_the_image_installs_the_extras_the_services_need() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    extras = set(re.search(r"\.\[([a-z,]+)\]", dockerfile).group(1).split(","))  # type: ignore[union-attr]
    assert {"worker", "flower", "anthropic"} <= extras
    assert "celeryconfig.py" in dockerfile
