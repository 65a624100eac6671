"""The Prometheus metrics june-worker records, and where a process keeps them.

Names follow Prometheus's conventions: a ``june_`` prefix, units in the name (``_seconds``),
counters end in ``_total``. Labels are bounded: an agent name the process serves (any other
is ``_other``), a model name, a tool name, a step kind, a status; **never a session or turn
id**. The full table is in docs/operations.md.

Worker processes (Celery prefork) record into prometheus_client's **multiprocess mode**: every
process writes its values to files of its own in ``PROMETHEUS_MULTIPROC_DIR``, which the worker's
main process reads when scraped (:mod:`.serve`). The directory must be chosen before
prometheus_client is first imported in a process, so this module imports it lazily, in
:func:`metrics`. A process without that directory (the worker host in a test or a bench, the
in-process runtime) records nothing: :func:`metrics` returns a :class:`Metrics` whose every
method does nothing. The gateway has its own registry (june_worker/gateway/metrics.py).

The rule a reader must not break: **a label value comes from a bounded set**; pass an agent
through :meth:`Metrics.agent` before using it as a label.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "INPUT_WAIT_BUCKETS_S",
    "QUEUE_WAIT_BUCKETS_S",
    "STEP_BUCKETS_S",
    "TURN_BUCKETS_S",
    "Metrics",
    "at_zero",
    "metrics",
    "multiprocess_dir",
    "reset_metrics",
]

TURN_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_WAIT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
INPUT_WAIT_BUCKETS_S = (1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 86400.0,
                        3 * 86400.0, 7 * 86400.0)  # fmt: skip
"""A person answers in seconds to days: an approval's wait reaches the longest park timeout people set."""
INPUT_ENDINGS = ("answered", "timed_out")
"""How a wait for an input ended (``june_input_wait_seconds``'s ``outcome``)."""
_log = logging.getLogger("june_worker.observe")
OTHER = "_other"
"""The label value of an agent this process does not serve (a message can name any agent)."""


def at_zero(metric: Any, label_sets: Iterable[Sequence[str]]) -> None:
    """Make each of ``label_sets`` a child of ``metric`` now, with nothing counted: exposed as 0 from the start.

    prometheus_client leaves out a labelled child until its first sample, so a panel or an alert on a
    counter nothing has counted yet shows "no data" instead of 0, and ``increase()`` misses the first
    count. Call it once the label values are known (the agents served, the routes, the statuses)."""
    for values in label_sets:
        metric.labels(*values)


def multiprocess_dir() -> str | None:
    """Where this process's worker metrics go (``PROMETHEUS_MULTIPROC_DIR``); None: not recorded."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class Metrics:
    """The worker's metric objects; every method is a no-op when ``enabled`` is False."""

    def __init__(self, enabled: bool, agents: Iterable[str] = ()) -> None:
        self.enabled = enabled
        self._agents = frozenset(agents)
        if not enabled:
            return
        from prometheus_client import Counter, Gauge, Histogram

        self.turns = Counter(
            "june_turns", "Turn runs that ended, by how they ended (a parked turn counts as suspended).",
            ["agent", "status"], registry=None,
        )  # fmt: skip
        self.turn_seconds = Histogram(
            "june_turn_duration_seconds", "Wall time of one run of a turn in a worker, from its start to its ending.",
            ["agent", "status"], buckets=TURN_BUCKETS_S, registry=None,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "june_step_duration_seconds", "Wall time of one step (a model call, a tool call), up to its commit.",
            ["agent", "kind"], buckets=STEP_BUCKETS_S, registry=None,
        )  # fmt: skip
        self.attempts = Counter(
            "june_turn_attempts",
            "Starts of a worker on a turn (the opening and every replay).",
            ["agent"],
            registry=None,
        )
        self.queue_wait = Histogram(
            "june_turn_queue_wait_seconds", "From a turn being enqueued (the producer's sent_at, else the record's "
            "creation) to a worker opening it, once per turn (not a re-send or a resume); negatives (clock skew) are 0.",
            ["agent"], buckets=QUEUE_WAIT_BUCKETS_S, registry=None,
        )  # fmt: skip
        self.input_wait = Histogram(
            "june_input_wait_seconds", "How long a parked turn's input request waited, from the park to the answer "
            "applied (answered) or the timeout applied (timed_out), by the database's clock.",
            ["agent", "outcome"], buckets=INPUT_WAIT_BUCKETS_S, registry=None,
        )  # fmt: skip
        self.interrupted = Counter(
            "june_turn_interruptions", "Runs that ended without an ending: a transient fault outlasted the step's "
            "retries, or the lease was lost.", ["agent", "reason"], registry=None,
        )  # fmt: skip
        self.takeovers = Counter(
            "june_lease_takeovers",
            "Sessions taken over with a turn another process left running (its holder died or stalled).", ["agent"],
            registry=None,
        )  # fmt: skip
        self.tokens = Counter(
            "june_model_tokens", "Model tokens, by type: input, output, cache_read, cache_write.",
            ["agent", "model", "type"], registry=None,
        )  # fmt: skip
        self.tool_calls = Counter(
            "june_tool_calls", "Tool calls, by outcome: ok, error (the tool's own), parked, aborted.",
            ["agent", "tool", "outcome"], registry=None,
        )  # fmt: skip
        self.sweeps = Counter(
            "june_sweeper_actions", "What the sweeper did: redispatched, expired_parks, resets, relayed, "
            "rebuilt, pruned_events, pruned_turns, pruned_archived.", ["action"], registry=None,
        )  # fmt: skip
        self.rejected_messages = Counter(
            "june_messages_rejected",
            "Task messages refused as unusable (bad payload), by task.",
            ["task"],
            registry=None,
        )
        self.loop_blocked_seconds = Histogram(
            "june_event_loop_blocked_seconds", "How long something held the event loop that a process's turns share "
            "(many turns per process), each time it held it past JUNE_LOOP_BLOCKED_S.",
            buckets=STEP_BUCKETS_S, registry=None,
        )  # fmt: skip
        self.in_progress = Gauge(
            "june_turns_in_progress", "Turns this worker's processes are running now.", ["agent"],
            multiprocess_mode="livesum", registry=None,
        )  # fmt: skip
        self._at_zero()

    def serve(self, agents: Iterable[str]) -> None:
        """The agents this process serves: their names are label values, any other is ``_other``."""
        self._agents = frozenset(agents)
        if self.enabled:
            self._at_zero()

    def _at_zero(self) -> None:
        """The wait histograms of every agent served, exposed with nothing observed (a panel shows 0, not no data)."""
        at_zero(self.queue_wait, [(a,) for a in sorted(self._agents)])
        at_zero(self.input_wait, [(a, outcome) for a in sorted(self._agents) for outcome in INPUT_ENDINGS])

    def agent(self, name: str) -> str:
        """``name`` if this process serves that agent, else ``_other``: a bounded label."""
        return name if name in self._agents else OTHER

    # --- recording ---------------------------------------------------------------------------

    def turn_ended(self, agent: str, status: str) -> None:
        if self.enabled:
            self.turns.labels(self.agent(agent), status).inc()

    def queue_waited(self, agent: str, seconds: float) -> None:
        """A turn opened ``seconds`` after it was enqueued (by another host's clock, maybe: a negative is 0)."""
        if self.enabled:
            self.queue_wait.labels(self.agent(agent)).observe(max(seconds, 0.0))

    def input_waited(self, agent: str, outcome: str, seconds: float, n: int = 1) -> None:
        """``n`` requests of a park ended ``outcome`` (one of :data:`INPUT_ENDINGS`) ``seconds`` after the park."""
        if not self.enabled:
            return
        try:  # called where an answer was applied: a fault of the metrics files must not fail it
            child = self.input_wait.labels(self.agent(agent), outcome)
            for _ in range(n):
                child.observe(max(seconds, 0.0))
        except Exception:
            _log.warning("recording june_input_wait_seconds failed", exc_info=True)

    def sweep(self, summary: dict[str, Any]) -> None:
        """Count a sweeper run's summary dict (``redispatched``, ``expired_parks``, ``resets``, ``relayed``, ``rebuilt``,
        ``pruned``)."""
        if not self.enabled:
            return
        for action in ("redispatched", "expired_parks", "resets", "relayed", "rebuilt"):
            if summary.get(action):
                self.sweeps.labels(action).inc(summary[action])
        for kind, n in (summary.get("pruned") or {}).items():
            if n:
                self.sweeps.labels(f"pruned_{kind}").inc(n)

    def loop_blocked(self, seconds: float) -> None:
        if self.enabled:
            self.loop_blocked_seconds.observe(seconds)

    def message_rejected(self, task: str) -> None:
        if self.enabled:
            self.rejected_messages.labels(task if task.startswith("june.") else OTHER).inc()


_LOCK = threading.Lock()
_METRICS: tuple[int, Metrics] | None = None


def metrics(agents: Iterable[str] | None = None) -> Metrics:
    """This process's metrics, made on first use (again after a fork); ``agents``: the names it serves (labels)."""
    global _METRICS
    with _LOCK:
        if _METRICS is None or _METRICS[0] != os.getpid():
            _METRICS = (os.getpid(), Metrics(multiprocess_dir() is not None, agents or ()))
        elif agents is not None:
            _METRICS[1].serve(agents)
        return _METRICS[1]


def reset_metrics() -> None:
    """Forget this process's metrics (tests that switch the directory)."""
    global _METRICS
    with _LOCK:
        _METRICS = None
