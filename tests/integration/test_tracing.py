"""OpenTelemetry traces through Celery: the producer's span is the parent of the worker's turn span.

The producer runs in a process of its own with the SDK's in-memory exporter (a tracer provider
is set once per process, and this test must not leave one in the test process for the others),
and prints the spans it finished; the worker's pool processes record theirs the same way and also
append them to a file (tests/integration/traced_agents.py).
One trace holds ``june.start_turn`` -> ``june.turn`` -> a span per step (``chat scripted``,
``execute_tool lookup``), with the GenAI attributes, and no attribute holds the turn's text, its
tool arguments or results. A parked turn's second run, after its resume, joins the same trace.
On both brokers: the trace context travels in the message's headers, on Redis and RabbitMQ alike.

Fails on main (d2b81ad): no span is made and no trace header is sent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, Stack, wait_for
from .observe_agents import SECRET, USAGE

pytestmark = [pytest.mark.integration, pytest.mark.brokers("redis", "amqp")]

PRODUCER = """
import json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from producers import JuneProducer
from tests.integration.traced_agents import span_record

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
args = json.loads(sys.argv[1])
with JuneProducer(args["redis_url"], broker_url=args["broker_url"], queue=args["queue"],
                  control_queue=args["control_queue"], key_prefix=args["prefix"]) as producer:
    turn_id = producer.start_turn(args["agent"], args["session"], args["text"])
print(json.dumps({"turn_id": turn_id, "spans": [span_record(s) for s in exporter.get_finished_spans()]}))
"""


def start_traced(stack: Stack, agent: str, session: str, text: str) -> tuple[str, list[dict[str, Any]]]:
    """``start_turn`` from a producer process with an SDK: the turn id and the spans it finished."""
    args = {
        "redis_url": stack.redis_url, "broker_url": stack.broker_url, "queue": stack.queue,
        "control_queue": stack.control_queue, "prefix": stack.prefix, "agent": agent, "session": session,
        "text": text,
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", PRODUCER, json.dumps(args)], env=stack.env, cwd=ROOT, capture_output=True,
        text=True, timeout=60, check=True,
    )  # fmt: skip
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return str(out["turn_id"]), list(out["spans"])


@pytest.fixture(scope="module")
def spans_file(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spans") / "worker-spans.jsonl"
    path.touch()
    stack.env["JUNE_AGENTS"] = "tests.integration.agents:ALL,tests.integration.traced_agents:ALL"
    stack.worker("traced", concurrency=2, env={"JUNE_IT_SPANS": str(path)})
    return path


@pytest.fixture(scope="module")
def producer(stack: Stack) -> Iterator[Any]:
    with stack.producer() as producer:
        yield producer


def worker_spans(path: Path, trace_id: str) -> list[dict[str, Any]]:
    return [s for s in map(json.loads, path.read_text().splitlines()) if s["trace_id"] == trace_id]


def all_attribute_values(spans: list[dict[str, Any]]) -> list[str]:
    return [json.dumps(v) for s in spans for v in s["attributes"].values()]


def test_the_producer_span_is_the_parent_of_the_turn_span_and_steps_are_its_children(
    stack: Stack, spans_file: Path, session_id: str
) -> None:
    # Given a producer with an SDK, sending a turn that calls a tool.
    turn_id, sent = start_traced(stack, "metered", session_id, f"lookup {SECRET}")
    assert [(s["name"], s["kind"], s["attributes"]["june.turn_id"]) for s in sent] == [
        ("june.start_turn", "PRODUCER", turn_id)
    ]
    start = sent[0]

    # When the worker ran it.
    assert stack.wait_terminal("metered", session_id, turn_id)["type"] == "turn.completed"
    spans = wait_for(
        lambda: (lambda found: found if len(found) == 4 else None)(worker_spans(spans_file, start["trace_id"])),
        timeout_s=20,
        what="the worker's four spans of the turn",
    )

    # Then the trace id came through Celery: the turn span is the producer span's child, the steps the turn's.
    (turn,) = [s for s in spans if s["name"] == "june.turn"]
    assert turn["parent_id"] == start["span_id"] and turn["kind"] == "CONSUMER"
    assert turn["attributes"]["june.turn_id"] == turn_id and turn["attributes"]["june.turn.status"] == "completed"
    steps = sorted((s for s in spans if s is not turn), key=lambda s: s["attributes"]["june.step"])
    assert [(s["name"], s["parent_id"], s["attributes"]["june.step"]) for s in steps] == [
        ("chat scripted", turn["span_id"], "model:1"),
        ("chat scripted", turn["span_id"], "model:3"),
        ("execute_tool lookup", turn["span_id"], "tool:1:c1"),
    ]
    chat = steps[0]["attributes"]
    assert chat["gen_ai.operation.name"] == "chat" and chat["gen_ai.system"] == "scripted"
    assert chat["gen_ai.request.model"] == "scripted"
    assert (chat["gen_ai.usage.input_tokens"], chat["gen_ai.usage.output_tokens"]) == (
        USAGE.input_tokens,
        USAGE.output_tokens,
    )
    tool = steps[2]["attributes"]
    assert (tool["gen_ai.tool.name"], tool["june.tool.outcome"], steps[2]["status"]) == ("lookup", "ok", "UNSET")

    # And no attribute holds the text, the tool's arguments or its result.
    assert not [v for v in all_attribute_values([start, *spans]) if SECRET in v]


def test_a_resumed_turn_runs_again_in_the_trace_of_the_span_that_sent_it(
    stack: Stack, spans_file: Path, producer: Any, session_id: str
) -> None:
    # Given a traced turn that parked.
    turn_id, (start,) = start_traced(stack, "metered", session_id, f"ask {SECRET}")
    assert stack.wait_terminal("metered", session_id, turn_id)["type"] == "input.requested"

    # When it is resumed (from a producer with no span of its own around the call).
    assert producer.resume("metered", session_id, turn_id, "confirm", True).status == "accepted"

    # Then its second run is a child of the span that sent the turn, like the first.
    def runs() -> list[dict[str, Any]] | None:
        found = [s for s in worker_spans(spans_file, start["trace_id"]) if s["name"] == "june.turn"]
        return found if len(found) == 2 else None

    both = wait_for(runs, timeout_s=20, what="both runs' spans")
    assert [s["parent_id"] for s in both] == [start["span_id"], start["span_id"]]
    assert sorted(s["attributes"]["june.turn.status"] for s in both) == ["completed", "suspended"]
    asked = [s for s in worker_spans(spans_file, start["trace_id"]) if s["name"] == "execute_tool ask"]
    assert sorted(s["attributes"]["june.tool.outcome"] for s in asked) == ["ok", "parked"]
