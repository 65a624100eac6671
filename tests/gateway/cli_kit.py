"""Running ``june-produce`` against a test stack, as a person would (on a terminal) or a program would (JSON lines)."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
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
