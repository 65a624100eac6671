"""Running ``june-produce`` against a test stack, as a person would (on a terminal) or a program would (JSON lines)."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from tests.integration.conftest import ROOT, Stack

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


@dataclass
class Ran:
    code: int
    out: str
    err: str


def cli_env(stack: Stack, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in stack.env.items() if not k.startswith("JUNE_GATEWAY_")}
    return {**env, **extra}


def run_cli(stack: Stack, *args: str, tty: bool = False, user: str = "ann") -> Ran:
    """``june-produce ARGS`` with the stack's settings; on a pseudo-terminal when ``tty`` (the live view).

    ``USER`` / ``LOGNAME`` are set to ``user``: the login name the CLI takes as the speaker.
    """
    env = cli_env(stack, USER=user, LOGNAME=user, TERM="dumb", COLUMNS="200", NO_COLOR="1")
    cmd = [sys.executable, "-m", "producers.cli", *args]
    if not tty:
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=90)
        return Ran(done.returncode, done.stdout, done.stderr)
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=slave, stderr=subprocess.PIPE)
    finally:
        os.close(slave)
    chunks: list[bytes] = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    code = proc.wait(90)
    if proc.stderr:
        proc.stderr.close()
    out = _ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r\n", "\n")
    return Ran(code, out, err)


class OnTerminal:
    """``june-produce ARGS`` on a pseudo-terminal (stdout and stderr both, as a shell shows them), read as it goes:
    wait for a line, then press Ctrl-C (SIGINT, what the terminal sends its foreground process)."""

    def __init__(self, stack: Stack, *args: str, user: str = "ann") -> None:
        env = cli_env(stack, USER=user, LOGNAME=user, TERM="dumb", COLUMNS="200", NO_COLOR="1")
        self.master, slave = pty.openpty()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "producers.cli", *args], env=env, cwd=ROOT,
                                         stdout=slave, stderr=slave)  # fmt: skip
        finally:
            os.close(slave)
        self._chunks: list[bytes] = []

    def text(self) -> str:
        return _ANSI.sub("", b"".join(self._chunks).decode(errors="replace")).replace("\r\n", "\n")

    def wait_for(self, needle: str, timeout_s: float = 60) -> None:
        """Read until ``needle`` has been printed; fail with what was printed when it was not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while needle not in self.text():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._read(remaining):
                raise AssertionError(f"june-produce did not print {needle!r}; it printed:\n{self.text()}")

    def _read(self, timeout_s: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout_s)
        if not ready:
            return False
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the child closed its end
            return False
        self._chunks.append(data)
        return bool(data)

    def interrupt(self) -> Ran:
        """Ctrl-C, then everything it printed until it exited, and its exit code."""
        self.proc.send_signal(signal.SIGINT)
        while self._read(30):
            pass
        code = self.proc.wait(30)
        os.close(self.master)
        return Ran(code, self.text(), "")
