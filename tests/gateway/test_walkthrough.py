"""An operator's first hour, scripted: a terminal (tmux) typed into, through the README, from a fresh copy of the
repository and a venv of its own, each command's output asserted.

What it covers, in the README's order: installing the checkout (``pip install './june-worker[...]'``), ``june
migrate`` and a worker's and migrate's one-line refusals (a bad setting, Postgres not answering), the CLI's
worked example (an order, a refund that needs approval, a refused and an accepted answer), following the session
and leaving with Ctrl-C, the gateway (``june gateway`` and the ``curl``), and the failure cases the README and the
CLI promise one line for (a broker that is down, Ctrl-C while a turn waits, a gateway without tokens, a session
of another channel). Any traceback on the screen fails it.

How it stays fast: the workers are the test module's (``demo_kit.demo_stack``: the default agents, Postgres and
Redis of the test run), standing in for the README's ``june migrate`` / ``june worker`` / ``june beat`` lines
(``WORKER_STEPS`` is where typed ones go); the venv sees the test venv's packages (a ``.pth``), so ``pip install``
builds and installs only june-worker itself, from the machine's local package index, never the internet
(:func:`terminal_kit.offline_pip_env`). Ports are free ones instead of 8080, the queue and key prefix the stack's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT, Stack

from .cli_kit import cli_env
from .demo_kit import demo_stack
from .terminal_kit import Ran, Terminal, offline_pip_env
from .test_cli import free_port
from .test_demo_stack import TURN_ID, readme_transcript

__all__ = ["demo_stack"]  # the fixture, imported for pytest

README = (ROOT / "README.md").read_text(encoding="utf-8")


@dataclass
class Step:
    """One command typed at the terminal, and what must come of it.

    ``expect``: the exact lines it prints (after :meth:`Walk.normal`); ``contains``: lines or parts it must print;
    ``one_line``: it prints exactly one line (a failure said in one line); ``until``: text to wait for, then press
    Ctrl-C; ``window``: another terminal window (a server started there runs on: see ``background``)."""

    command: str
    code: int = 0
    expect: list[str] | None = None
    contains: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)
    one_line: bool = False
    until: str | None = None
    window: str = "main"
    background: str | None = None
    """Don't wait for it to end: wait for this text (a server saying it is up), and leave it running."""
    check: Callable[[Walk, Ran], None] | None = None


class Walk:
    """The terminal, where the walk stands (the checkout, its venv, the stack), and what it remembers."""

    def __init__(self, terminal: Terminal, stack: Stack, port: int) -> None:
        self.terminal = terminal
        self.stack = stack
        self.port = port
        self.turns: list[str] = []  # turn ids, in the order the walk met them

    def normal(self, line: str) -> str:
        """A printed line as the README writes it: its turn ids, queue and port the README's."""
        line = TURN_ID.sub("t_01JD...", line).replace(f" on {self.stack.queue}", " on june")
        return line.replace(f"127.0.0.1:{self.port}", "127.0.0.1:8080")

    def command(self, text: str) -> str:
        """A README command as typed here: the gateway's free port, the turn ids met so far for ``t_01JD...``."""
        text = text.replace("127.0.0.1:8080", f"127.0.0.1:{self.port}").replace("--port 8080", f"--port {self.port}")
        text = text.replace("-Q june", f"-Q {self.stack.queue}")
        if self.turns:
            text = text.replace("t_01JD...", self.turns[-1])
        return text

    def do(self, step: Step) -> Ran:
        command = self.command(step.command)
        if step.background is not None:
            self.terminal.type(command, step.window)
            self.terminal.wait_for(step.background, step.window)
            ran = Ran(command, 0, self.terminal.screen(step.window)[1:])
            self.no_traceback(ran)
            return ran
        if step.until is not None:
            self.terminal.type(command, step.window)
            self.terminal.wait_for(step.until, step.window)
            self.terminal.press("C-c", step.window)
        else:
            self.terminal.type(command, step.window)
        ran = self.terminal.wait_done(command, step.window)
        self.turns += [t for t in TURN_ID.findall(ran.text) if t not in self.turns]
        self.no_traceback(ran)
        shown = [self.normal(line) for line in ran.lines]
        where = f"$ {command}\n" + "\n".join(ran.lines)
        assert ran.code == step.code, f"exit {ran.code}, not {step.code}:\n{where}"
        if step.expect is not None:
            assert shown == step.expect, where
        for part in step.contains:
            assert any(part in line for line in shown), f"{part!r} not printed:\n{where}"
        for part in step.absent:
            assert not any(part in line for line in shown), f"{part!r} printed:\n{where}"
        if step.one_line:
            assert len(ran.lines) == 1, f"one line promised:\n{where}"
        if step.check is not None:
            step.check(self, ran)
        return ran

    @staticmethod
    def no_traceback(ran: Ran) -> None:
        assert "Traceback (most recent call last)" not in ran.text, f"$ {ran.command}\n{ran.text}"


# --- the steps, in the README's order ------------------------------------------------------------------------


def install_steps() -> list[Step]:
    """The README's "Installing it": activate the venv, install the checkout with the extras run here."""
    block = README.split("## Installing it", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    install = next(line.split("#")[0].strip() for line in block.splitlines() if line.startswith("pip install"))
    assert install == "pip install './june-worker[worker,producers,gateway,flower]'", install
    return [
        Step(". .venv/bin/activate", expect=[]),
        Step(install, contains=["Successfully installed june-worker-0.1.0"]),
        Step("command -v june june-produce", check=lambda walk, ran: _installed_here(walk, ran)),
    ]


def _installed_here(walk: Walk, ran: Ran) -> None:
    assert ran.lines == [str(walk.terminal.cwd / ".venv" / "bin" / name) for name in ("june", "june-produce")]


WORKER_STEPS: list[Step] = [
    # the schema is there (the stack's workers migrated it): migrate says so, and says nothing else
    Step("june migrate", expect=["schema is up to date"]),
    # a turn worker and beat as the README starts them, each left running in a window of its own
    *(Step(". .venv/bin/activate", window=window, expect=[]) for window in ("worker", "beat")),
    Step("june worker -Q june", window="worker", background="ready."),
    Step("june beat", window="beat", background="beat: Starting"),
    # the mistakes of a first hour, each one line that names what to fix, before Celery or a pool starts
    Step(
        "JUNE_LEASE_S=abc june worker -Q june", code=2, one_line=True,
        contains=["june worker: JUNE_LEASE_S='abc': expected a number of seconds, at least 0.5"],
    ),
    Step(
        "JUNE_DATABASE_URL=postgresql://postgres@127.0.0.1:1/june june migrate", code=1, one_line=True,
        contains=["june migrate: postgres at 127.0.0.1:1 does not answer (connection refused)"],
    ),
]  # fmt: skip
"""``june migrate`` and the worker's one-line refusals as an operator types them; the stack's workers stand in for a
running ``june worker`` / ``june beat`` (a step in a window of its own with ``background`` would type them)."""


def cli_steps() -> list[Step]:
    """The README's worked example, as written: each ``$ june-produce`` line and the lines it prints."""
    steps = readme_transcript()
    codes = [0, 3, 1, 0]  # completed, waiting for input, not accepted, accepted and completed
    assert len(steps) == len(codes)
    return [Step(command, code, expect=expected) for (command, expected), code in zip(steps, codes, strict=True)]


def follow_steps() -> list[Step]:
    """Following the session of the worked example: both sides replayed, no hint to answer the approval answered
    above, and Ctrl-C says in one line how to go on."""
    return [
        Step(
            "june-produce follow ops cli-1",
            code=130,
            until="The refund on order 42 was approved and sent.",
            contains=["› Order 3 widgets", "› Please refund order 42", "⏸ waiting for input approve-refund: Refund $19.50 on order 42?"],
            absent=["answer with:", "still waiting"],
            check=lambda walk, ran: _left_with_one_line(ran, "june-produce: stopped following ops:cli-1; go on from "
                                                        "where you were with: june-produce follow ops cli-1 --from "),
        ),
    ]  # fmt: skip


def _left_with_one_line(ran: Ran, start: str) -> None:
    last = ran.lines[-1]
    assert last.startswith(start), "\n".join(ran.lines)


def gateway_steps() -> list[Step]:
    """The README's "Over HTTP": the token table, ``june gateway`` (in a window of its own), the ``curl``."""
    block = README.split("## Over HTTP", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    export, serve, *curl = block.replace("\\\n", " ").splitlines()
    curl_line = re.sub(r"\s+", " ", " ".join(curl))
    assert export.startswith("export JUNE_GATEWAY_TOKENS=") and serve.startswith("june gateway --port 8080")
    return [  # the gateway in a terminal of its own, as an operator runs it; the curl in the first one
        Step(". .venv/bin/activate", window="gateway", expect=[]),
        Step(export, window="gateway", expect=[]),
        Step(serve.split("#")[0].strip(), window="gateway", background="Application startup complete."),
        Step(
            curl_line,
            contains=[
                "event: turn.started",
                '"text":"Please refund order 42"',
                "event: input.requested",
                '"id":"approve-refund"',
            ],  # fmt: skip
        ),
    ]


def failure_steps() -> list[Step]:
    """What goes wrong in the first hour, each said in one line and never a traceback."""
    cli_1 = (
        'curl -s -H "Authorization: Bearer a-long-random-token-value" -H "Content-Type: application/json" '
        "http://127.0.0.1:8080/v1/agents/ops/sessions/cli-1/pending"
    )
    nobody = f"nobody-{uuid.uuid4().hex[:8]}"
    return [
        # the session the CLI opened is not this token's (README, "Over HTTP"): the 404 of a session that is not
        Step(cli_1, expect=['{"detail":"unknown session \'cli-1\' of agent \'ops\'"}']),
        # a broker that is down: exit 5, one line
        Step(
            'CELERY_BROKER_URL=redis://127.0.0.1:1/0 JUNE_PUBLISH_TIMEOUT_S=0.5 JUNE_PUBLISH_RETRIES=0 '
            'june-produce turn ops cli-2 "Order 3 widgets"',
            code=5, one_line=True, contains=["june-produce: could not send june.turn"],
        ),
        # Ctrl-C while a turn waits for a worker (its queue has none): the turn goes on, and how to follow it
        Step(
            f'JUNE_QUEUE={nobody} june-produce turn ops cli-3 "Order 3 widgets"',
            code=130, until="queued t_",
            check=lambda walk, ran: _left_with_one_line(
                ran, f"june-produce: stopped following; turn {walk.turns[-1]} goes on without you: "
                f"june-produce follow ops cli-3 --turn {walk.turns[-1]}"),
        ),
        # a gateway without tokens: exit 2, one line, before anything listens
        Step(
            "env -u JUNE_GATEWAY_TOKENS june gateway --port 8080",
            code=2, one_line=True, contains=["june gateway: the gateway has no bearer tokens"],
        ),
    ]  # fmt: skip


# --- the walk ----------------------------------------------------------------------------------------------------


def fresh_checkout(where: Path) -> Path:
    """The repository's files as a clone has them (what git tracks, as they are in this tree), in ``june-worker``."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    checkout = where / "june-worker"
    for name in filter(None, files.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            target = checkout / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return checkout


def fresh_venv(where: Path) -> Path:
    """``python3 -m venv .venv`` that sees the test venv's packages (the dependencies, pip), not june-worker."""
    venv = where / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()  # fmt: skip
    Path(site, "june-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = venv / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\nexec "{venv / "bin" / "python"}" -m pip "$@"\n')
    pip.chmod(0o755)
    return venv


SERVER_WINDOWS = ("worker", "beat", "gateway")
"""The terminal's windows besides ``main``: one per server the walk starts and leaves running."""


@pytest.fixture
def walk(demo_stack: Stack, tmp_path: Path) -> Iterator[Walk]:
    fresh_checkout(tmp_path)
    venv = fresh_venv(tmp_path)
    stack_env = cli_env(demo_stack)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUNE_", "CELERY_", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT)))
    names = ("JUNE_DATABASE_URL", "JUNE_REDIS_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "JUNE_QUEUE",
             "JUNE_CONTROL_QUEUE", "JUNE_KEY_PREFIX")  # fmt: skip
    env.update({name: stack_env[name] for name in names})  # the workers' settings, as an operator exports them
    env.update(offline_pip_env(str(venv / "bin" / "python")))
    env.update(USER="alice", LOGNAME="alice", TERM="xterm-256color", LANG="C.UTF-8", LC_ALL="C.UTF-8")
    terminal = Terminal(tmp_path, env)
    for window in SERVER_WINDOWS:
        terminal.window(window)
    try:
        yield Walk(terminal, demo_stack, free_port())
    finally:
        for window in SERVER_WINDOWS:
            terminal.press("C-c", window)  # the servers typed there, if they were started
        terminal.close()


@pytest.mark.timeout(300)  # some thirty commands, a pip install among them, typed one after another
def test_an_operator_walks_through_the_readme_from_a_fresh_checkout(walk: Walk) -> None:
    steps = install_steps() + WORKER_STEPS + cli_steps() + follow_steps() + gateway_steps() + failure_steps()
    for step in steps:
        walk.do(step)
    # and the servers in their windows never printed a traceback either
    for window in SERVER_WINDOWS:
        screen = "\n".join(walk.terminal.screen(window))
        assert "Traceback (most recent call last)" not in screen, f"{window}:\n{screen}"
    assert walk.stack.sql("select item, qty from orders") == [("widget", 3)]
