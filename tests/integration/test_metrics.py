"""Prometheus metrics and transition logs on real workers: two worker instances, each a prefork pool of two.

Each worker serves ``/metrics`` from its main process (``JUNE_METRICS_PORT``) over its own
multiprocess directory. Turns of every ending run on both; a tool that SIGKILLs its pool process
(``die``) makes the pool replace it twice. Scraping both workers and summing gives exactly the
turns run, by status, the attempts, the steps, the tool outcomes and the tokens the model reported;
a killed process's counts stay, its in-progress gauge goes. No label holds a session or turn id.

Fails on main (d2b81ad): workers serve no ``/metrics`` and log no transitions.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Proc, Stack, wait_for
from .observe_agents import SECRET

pytestmark = pytest.mark.integration

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def workers(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Proc, int]]:
    stack.env["JUNE_AGENTS"] = "tests.integration.agents:ALL,tests.integration.observe_agents:ALL"
    started = []
    for n in (1, 2):
        port = _free_port()
        env = {
            "JUNE_METRICS_PORT": str(port),
            "PROMETHEUS_MULTIPROC_DIR": str(tmp_path_factory.mktemp(f"metrics-{n}")),
            "JUNE_LOG_FORMAT": "json",
            "JUNE_MAX_ATTEMPTS": "2",
        }
        started.append((stack.worker(f"metrics-{n}", concurrency=2, env=env), port))
    stack.beat(env={"JUNE_MAX_ATTEMPTS": "2"})
    return started


def scrape(port: int) -> Samples:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out: Samples = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
    return out


def summed(workers: list[tuple[Proc, int]]) -> Samples:
    total: Samples = defaultdict(lambda: defaultdict(float))
    for _, port in workers:
        for name, series in scrape(port).items():
            for labels, value in series.items():
                total[name][labels] += value
    return total


def by(samples: Samples, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """The series of ``name`` keyed by the values of ``keys``, zeros left out."""
    out: dict[tuple[str, ...], float] = {}
    for labels, value in samples.get(name, {}).items():
        if value:
            found = dict(labels)
            out[tuple(found[k] for k in keys)] = value
    return out


def test_metrics_of_two_workers_count_the_turns_run_by_status(stack: Stack, workers: list[tuple[Proc, int]]) -> None:
    # Given turns of every ending, on sessions of their own, over two workers.
    plan = ["hello"] * 4 + ["lookup"] * 2 + ["oops"] + ["fatal"] * 2 + ["ask"]
    sessions = [f"m-{uuid.uuid4().hex[:10]}" for _ in plan]
    turns = [(s, stack.turn("metered", s, f"{word} {SECRET}")) for s, word in zip(sessions, plan, strict=True)]
    die_session = f"m-{uuid.uuid4().hex[:10]}"
    turns.append((die_session, stack.turn("ops", die_session, f"die {uuid.uuid4().hex}")))
    ghost_session = f"m-{uuid.uuid4().hex[:10]}"
    turns.append((ghost_session, stack.turn("nobody", ghost_session, "hello")))

    # When they have all ended.
    ends = {}
    for session, turn_id in turns:
        agent = "ops" if session == die_session else "nobody" if session == ghost_session else "metered"
        ends[turn_id] = stack.wait_terminal(agent, session, turn_id, timeout_s=90)["type"]
    assert sorted(ends.values()).count("turn.failed") == 4  # 2 fatal, the poisoned die, the rejection

    # Then both workers' /metrics together count exactly those turns, by agent and status.
    expected_turns = {
        ("metered", "completed"): 7,
        ("metered", "failed"): 2,
        ("metered", "suspended"): 1,
        ("ops", "failed"): 1,
        ("_other", "rejected"): 1,
    }

    def settled() -> Samples | None:
        samples = summed(workers)
        return samples if by(samples, "june_turns_total", "agent", "status") == expected_turns else None

    samples = wait_for(settled, timeout_s=30, every_s=0.5, what="the scraped turn counts to match the turns run")
    assert by(samples, "june_turn_attempts_total", "agent") == {("metered",): 10, ("ops",): 2}
    assert by(samples, "june_lease_takeovers_total", "agent") == {("ops",): 2}  # the two replays of die
    assert by(samples, "june_step_duration_seconds_count", "agent", "kind") == {
        ("metered", "model"): 13,
        ("metered", "tool"): 6,
        ("ops", "model"): 1,
    }
    assert by(samples, "june_tool_calls_total", "agent", "tool", "outcome") == {
        ("metered", "lookup", "ok"): 2,
        ("metered", "oops", "error"): 1,
        ("metered", "fatal", "aborted"): 2,
        ("metered", "ask", "parked"): 1,
    }
    assert by(samples, "june_model_tokens_total", "agent", "model", "type") == {
        ("metered", "scripted", "input"): 13 * 11,
        ("metered", "scripted", "output"): 13 * 5,
        ("metered", "scripted", "cache_read"): 13 * 3,
        ("metered", "scripted", "cache_write"): 13 * 2,
    }
    assert by(samples, "june_turn_duration_seconds_count", "agent", "status")[("metered", "completed")] == 7
    # The two pool processes die killed were replaced; what they counted stays, their in-progress gauge goes.
    assert by(samples, "june_turns_in_progress", "agent") == {}

    # The state gauges (each worker serves them; read one): the parked session, nothing queued, the queues.
    state = scrape(workers[0][1])
    assert by(state, "june_sessions_parked", "agent") == {("metered",): 1}
    assert by(state, "june_turns_unfinished", "agent", "status") == {}
    assert state["june_state_up"][()] == 1
    assert {dict(k)["queue"] for k in state["june_queue_depth_messages"]} == {stack.queue, stack.control_queue}
    assert state["june_workers_alive"][()] >= 2

    # No label anywhere holds a session or turn id, or any text of the turns.
    values = {v for series in samples.values() for labels in series for _, v in labels}
    assert not [v for v in values if v.startswith(("t_", "m-")) or SECRET in v]


def test_transitions_are_json_lines_with_ids_and_never_text(stack: Stack, workers: list[tuple[Proc, int]]) -> None:
    # Given workers logging JSON (JUNE_LOG_FORMAT=json), and turns that complete, fail and park.
    words = ["lookup", "fatal", "ask"]
    sessions = {word: f"j-{uuid.uuid4().hex[:10]}" for word in words}
    ids = {word: stack.turn("metered", sessions[word], f"{word} {SECRET}") for word in words}
    for word in words:
        stack.wait_terminal("metered", sessions[word], ids[word])

    # Then log records are JSON objects, one per line, and each turn's transitions are there with their ids.
    def transitions() -> dict[str, list[str]] | None:
        seen: dict[str, list[str]] = defaultdict(list)
        for proc, _ in workers:
            for line in proc.log.read_text().splitlines():
                if not line.startswith("{"):
                    continue  # the banner and warnings Celery prints before its logging is set up
                record = json.loads(line)
                if record.get("logger") == "june_worker.turns" and record.get("turn_id") in ids.values():
                    assert {"ts", "level", "event", "turn_id", "agent", "session", "step", "attempt"} <= set(record)
                    assert record["agent"] == "metered" and record["session"] == sessions[_word(ids, record)]
                    assert SECRET not in line, line  # never the text, an argument or an error's message
                    if record["event"] == "turn.failed":
                        assert (record["phase"], record["step"], record["error_type"]) == (
                            "tool", "tool:1:c1", "FatalToolError",
                        )  # fmt: skip
                    seen[_word(ids, record)].append(str(record["event"]))
        return seen if all(seen[w][-1:] == [f"turn.{end}"] for w, end in _ENDS.items()) else None

    seen = wait_for(transitions, timeout_s=20, every_s=0.2, what="each turn's transitions in the JSON logs")
    assert seen == {"lookup": ["turn.running", "turn.completed"], "fatal": ["turn.running", "turn.failed"],
                    "ask": ["turn.running", "turn.suspended"]}  # fmt: skip


_ENDS = {"lookup": "completed", "fatal": "failed", "ask": "suspended"}


def _word(ids: dict[str, str], record: dict[str, object]) -> str:
    return next(w for w, t in ids.items() if t == record["turn_id"])


def test_a_parked_turn_a_reset_ends_is_counted_cancelled_and_logged(
    stack: Stack, workers: list[tuple[Proc, int]]
) -> None:
    # Given a turn parked on an answer
    before = by(summed(workers), "june_turns_total", "agent", "status").get(("metered", "cancelled"), 0)
    session = f"r-{uuid.uuid4().hex[:10]}"
    turn_id = stack.turn("metered", session, f"ask {SECRET}")
    assert stack.wait_terminal("metered", session, turn_id)["type"] == "input.requested"
    # When the session is reset
    assert stack.send("june.reset", {"agent": "metered", "session": session}).get(timeout=60)["status"] == "reset"
    # Then that turn counts as cancelled once, and its transition is logged (reason reset)
    wait_for(
        lambda: (
            by(summed(workers), "june_turns_total", "agent", "status").get(("metered", "cancelled"), 0) == before + 1
        ),
        timeout_s=30,
        every_s=0.5,
        what="the reset turn counted as cancelled",
    )

    def cancelled() -> dict[str, object] | None:
        for proc, _ in workers:
            for line in proc.log.read_text().splitlines():
                if line.startswith("{") and turn_id in line:
                    record = json.loads(line)
                    if record.get("event") == "turn.cancelled":
                        return record  # type: ignore[no-any-return]
        return None

    record = wait_for(cancelled, timeout_s=20, every_s=0.2, what="the turn.cancelled transition")
    assert (record["agent"], record["session"], record["reason"]) == ("metered", session, "reset")
