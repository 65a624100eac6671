"""How long the suite waits for what is slow only on a busy machine: a server, a worker or beat starting.

The figures fit a 2-core machine that runs two whole suites at once (``make test`` beside ``make test``, and other
work): there a throwaway RabbitMQ took over 60 s to boot, where it takes about 5 s alone, and a worker's start-up
takes several times its usual second or two. Each wait stays bounded, so a start that hangs still fails, later; a
test's own work keeps pytest-timeout's budget (``timeout`` in pyproject.toml), and only a test that also sets up or
tears down what a module, a package or the session shares gets :data:`SHARED_SETUP_S` more for it
(``tests/conftest.py``).

Knobs (seconds): ``JUNE_TEST_SERVER_START_S``, ``JUNE_TEST_PROCESS_START_S``.
"""

from __future__ import annotations

import os

__all__ = ["PROCESS_START_S", "SERVER_START_S", "SHARED_SETUP_S"]


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise ValueError(f"{name}={text!r}: expected a number of seconds above 0")
    return value


SERVER_START_S = _seconds("JUNE_TEST_SERVER_START_S", 180.0)
"""One attempt to start a throwaway Postgres, Redis or RabbitMQ (``initdb`` included); a start that fails or runs out
of time is tried once more (:mod:`tests._services`)."""

PROCESS_START_S = _seconds("JUNE_TEST_PROCESS_START_S", 120.0)
"""A Celery worker to log ``ready.``, beat to start, a served gateway to listen, a stub worker to be ready."""

SHARED_SETUP_S = 3 * PROCESS_START_S
"""What a test may spend beyond its own timeout setting up (or tearing down) fixtures it shares with other tests: up
to three processes started one after the other (two workers and beat, in test_metrics.py). The shared servers are
waited for before the test's timer starts (``tests/conftest.py``), so they need no share of this."""
