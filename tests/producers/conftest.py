"""Fixtures of the producer tests: a producer on queues and a key prefix of its own, and a stub worker.

Nothing here needs a june worker: what a producer sends is read back from the broker's queue,
what it follows is written to the stream by the test, and control results come from
``stub_worker.py``, a real Celery worker process answering with canned summaries.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from producers import JuneProducer
from tests._budgets import PROCESS_START_S

from .kit import queue_keys, wait_until

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Names:
    """Queue names and a key prefix no other test uses."""

    queue: str
    control_queue: str
    prefix: str

    def env(self, redis_url: str) -> dict[str, str]:
        return {
            "JUNE_REDIS_URL": redis_url,
            "JUNE_QUEUE": self.queue,
            "JUNE_CONTROL_QUEUE": self.control_queue,
            "JUNE_KEY_PREFIX": self.prefix,
        }


def _unique() -> Names:
    tag = uuid.uuid4().hex[:12]
    return Names(queue=f"test-{tag}", control_queue=f"test-{tag}.control", prefix=f"jp-{tag}")


def _cleanup(client: redis.Redis, names: Names) -> None:
    keys = list(client.scan_iter(match=f"{names.prefix}:*", count=1000))
    keys += queue_keys(names.queue, names.control_queue)
    client.delete(*keys)


@pytest.fixture
def names() -> Names:
    return _unique()


@pytest.fixture
def rclient(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def producer(redis_url: str, names: Names, rclient: redis.Redis) -> Iterator[JuneProducer]:
    p = JuneProducer(redis_url, queue=names.queue, control_queue=names.control_queue, key_prefix=names.prefix)
    yield p
    p.close()
    _cleanup(rclient, names)


@dataclass(frozen=True)
class StubWorker:
    names: Names
    process: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="session")
def stub_worker(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StubWorker]:
    """One Celery worker process (solo pool) running tests/producers/stub_worker.py on a control queue of its own."""
    names = _unique()
    workdir = tmp_path_factory.mktemp("stub-worker")
    ready, log = workdir / "ready", workdir / "worker.log"
    env = {
        **os.environ,
        "STUB_BROKER_URL": redis_url,
        "STUB_KEY_PREFIX": names.prefix,
        "STUB_READY_FILE": str(ready),
        "PYTHONPATH": str(REPO),
    }
    command = [
        sys.executable, "-m", "celery", "-A", "tests.producers.stub_worker:app", "worker",
        "--pool", "solo", "--queues", names.control_queue, "--hostname", f"stub-{names.prefix}@%h",
        "--without-heartbeat", "--without-gossip", "--without-mingle", "--loglevel", "INFO",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:

        def started() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"stub worker exited with {process.returncode}:\n{log.read_text()}")
            return ready.exists()

        wait_until(started, "the stub Celery worker to be ready", timeout_s=PROCESS_START_S)
        yield StubWorker(names, process, log)
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=20)
        _cleanup(client, names)
        client.close()


@pytest.fixture
def control_producer(redis_url: str, stub_worker: StubWorker, rclient: redis.Redis) -> Iterator[JuneProducer]:
    """A producer whose control queue the stub worker consumes (turns go to a queue of the test's own)."""
    names = stub_worker.names
    own = _unique()
    p = JuneProducer(redis_url, queue=own.queue, control_queue=names.control_queue, key_prefix=names.prefix)
    yield p
    p.close()
    _cleanup(rclient, own)
