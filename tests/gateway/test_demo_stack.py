"""The demo agent on the worker stack: the README's worked example, run as written, on the default ``JUNE_AGENTS``.

Workers start without ``JUNE_AGENTS`` (so they serve ``june_worker.demo:build_agent``, as
docker-compose does) on a database of their own; each ``$ june-produce ...`` line of the README's
console block runs on a terminal and must print what the README says, turn ids, the queue name
and the login name aside. Then the same demo turns go through the gateway.
"""

from __future__ import annotations

import re
import shlex
import uuid

import httpx

from june_worker.gateway import Principal, TokenTable, create_app
from tests.integration.conftest import ROOT, Stack

from .cli_kit import run_cli
from .conftest import settings_for
from .demo_kit import demo_stack
from .kit import ServedApp

__all__ = ["demo_stack"]  # the fixture, imported for pytest

TURN_ID = re.compile(r"t_[0-9A-HJKMNP-TV-Z]{26}")


def readme_transcript() -> list[tuple[str, list[str]]]:
    """The README's worked example: (command, the lines it prints) for each ``$ june-produce`` line."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("### Worked example", 1)[1].split("```console\n", 1)[1].split("```", 1)[0]
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    return steps


def test_the_readme_worked_example_runs_as_written_on_the_default_agents(demo_stack: Stack) -> None:
    steps = readme_transcript()
    assert [shlex.split(c)[:2] for c, _ in steps] == [["june-produce", "turn"]] * 2 + [["june-produce", "resume"]] * 2
    parked: str | None = None
    exit_codes = [0, 3, 1, 0]  # completed, waiting for input, not accepted, accepted and completed
    for (command, expected), exit_code in zip(steps, exit_codes, strict=True):
        args = shlex.split(command)[1:]
        args = [parked if a == "t_01JD..." and parked else a for a in args]
        ran = run_cli(demo_stack, *args, tty=True, user="alice")
        assert ran.err == "", ran.err
        seen = TURN_ID.findall(ran.out)
        if args[0] == "turn":
            parked = seen[0]
        shown = TURN_ID.sub("t_01JD...", ran.out).replace(f" on {demo_stack.queue}", " on june")
        assert shown.splitlines() == expected, f"{command}\n{ran.out}"
        assert ran.code == exit_code, command
    assert demo_stack.sql("select id, item, qty from orders") == [(1, "widget", 3)]


def test_the_demo_turns_complete_through_the_gateway(demo_stack: Stack) -> None:
    token = f"demo-token-{uuid.uuid4().hex}"
    tokens = TokenTable.of({token: Principal("U024BE7LH", frozenset({"ops"}))})
    served = ServedApp(create_app(settings_for(demo_stack, tokens, agents=("ops",))))
    try:
        with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
            path = f"/v1/agents/ops/sessions/web-{uuid.uuid4().hex[:8]}"
            hello = client.post(f"{path}/turns", json={"text": "hello"}, params={"wait": 1}).json()
            assert hello["text"] == "I can place orders and refund them. Try: 'Order 3 widgets'."
            order = client.post(f"{path}/turns", json={"text": "Order 3 widgets"}, params={"wait": 1}).json()
            assert order["status"] == "completed", order
            assert re.fullmatch(r"Done: order #\d+ for 3 x widget is placed\.", order["text"])
            refund = client.post(f"{path}/turns", json={"text": "Please refund order 42"}, params={"wait": 1}).json()
            assert refund["status"] == "suspended" and refund["input"]["id"] == "approve-refund"
            approved = client.post(
                f"{path}/turns/{refund['turn_id']}/resume",
                json={"input_id": "approve-refund", "value": True},
                params={"wait": 1},
            ).json()
            assert approved["text"] == "The refund on order 42 was approved and sent."
    finally:
        served.stop()
