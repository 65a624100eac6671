"""A terminal a test types into, as an operator would: a tmux session of its own (its own server socket), a bash
in it, and what the screen shows after each command.

Each command's exit code comes from the prompt: bash prints ``__done <code>__`` before every prompt
(``PROMPT_COMMAND``), so a step has ended when one more such line is on the screen: a wait on the screen,
never a sleep. The screen is cleared before each command, so what a command printed is everything between
its typed line and that marker (``capture-pane -J`` joins lines the terminal wrapped).

``tmux`` must be installed: ``make test`` installs it as it installs chromium; without it the test fails,
in one line saying what to install (it never skips).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["Ran", "Terminal"]

INSTALL_TMUX = "tmux is missing: install it (apt-get install -y tmux; make test does it as root)"
_DONE = re.compile(r"__done (\d+)__$")  # at the end of a line: output without a newline comes before it
_RC = """PS1='$ '
PROMPT_COMMAND='echo "__done $?__"'
"""


@dataclass
class Ran:
    """A command typed at the terminal: its exit code and what it printed (the screen's lines, in order)."""

    command: str
    code: int
    lines: list[str]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


class Terminal:
    """A bash in a tmux session of the test's own; windows by name (``main`` at first)."""

    def __init__(self, cwd: Path, env: dict[str, str], *, width: int = 250, height: int = 60) -> None:
        tmux = shutil.which("tmux")
        if tmux is None:
            pytest.fail(INSTALL_TMUX, pytrace=False)
        self.tmux = tmux
        self.cwd = cwd
        self.env = {k: v for k, v in env.items() if k not in ("TMUX", "TMUX_PANE")}
        self.env["VIRTUAL_ENV_DISABLE_PROMPT"] = "1"  # the prompt stays "$ " once a venv is activated
        self.socket = f"june-walk-{uuid.uuid4().hex[:10]}"
        self.rc = cwd / f".{self.socket}.bashrc"
        self.rc.write_text(_RC)
        self._cmd("-f", "/dev/null", "new-session", "-d", "-s", "walk", "-n", "main", "-x", str(width),
                  "-y", str(height), "-c", str(cwd), self._shell())  # fmt: skip
        self._ready("main")

    def _shell(self) -> str:
        return f"bash --noprofile --rcfile {self.rc}"

    def _cmd(self, *args: str) -> str:
        done = subprocess.run([self.tmux, "-L", self.socket, *args], env=self.env, cwd=self.cwd,
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        if done.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args[:2])} failed: {done.stderr.strip()}")
        return done.stdout

    def window(self, name: str) -> None:
        """Open another window (another shell in the same directory, with the same environment)."""
        self._cmd("new-window", "-t", "walk", "-n", name, "-c", str(self.cwd), self._shell())
        self._ready(name)

    def screen(self, window: str = "main") -> list[str]:
        """What the window shows, its scrollback included, without trailing blank lines."""
        lines = self._cmd("capture-pane", "-p", "-J", "-S", "-", "-t", f"walk:{window}").splitlines()
        while lines and not lines[-1].strip():
            lines.pop()
        return lines

    def _markers(self, window: str) -> list[int]:
        return [int(m.group(1)) for line in self.screen(window) if (m := _DONE.search(line.rstrip()))]

    def _wait(self, window: str, count: int, timeout_s: float, what: str) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while len(markers := self._markers(window)) < count:
            if time.monotonic() > deadline:
                shown = "\n".join(self.screen(window)[-40:])
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; the screen:\n{shown}")
            time.sleep(0.05)  # polling the screen for the prompt's marker, not waiting for a worker
        return markers

    def _ready(self, window: str) -> None:
        self._wait(window, 1, 30, f"bash to start in window {window}")

    def clear(self, window: str = "main") -> None:
        self._cmd("send-keys", "-t", f"walk:{window}", "-l", "clear")
        self._cmd("send-keys", "-t", f"walk:{window}", "Enter")
        self._wait_cleared(window)
        self._cmd("clear-history", "-t", f"walk:{window}")

    def _wait_cleared(self, window: str) -> None:
        deadline = time.monotonic() + 30
        while not (len(lines := self.screen(window)) <= 2 and lines and _DONE.fullmatch(lines[0].strip())):
            if time.monotonic() > deadline:
                raise AssertionError(f"the screen of window {window} did not clear:\n" + "\n".join(lines[-20:]))
            time.sleep(0.02)

    def type(self, command: str, window: str = "main") -> None:
        """Type ``command`` and press Enter, on a cleared screen (don't wait for it: :meth:`wait_done`)."""
        self.clear(window)
        self._cmd("send-keys", "-t", f"walk:{window}", "-l", command)
        self._cmd("send-keys", "-t", f"walk:{window}", "Enter")

    def wait_for(self, needle: str, window: str = "main", timeout_s: float = 60) -> None:
        """Until ``needle`` is on the window's screen, below the typed command; fails at once if the command ended."""
        deadline = time.monotonic() + timeout_s
        while not any(needle in line for line in self.screen(window)[1:]):
            if len(self._markers(window)) > 1:
                shown = "\n".join(self.screen(window)[-40:])
                raise AssertionError(f"the command ended before printing {needle!r}; the screen:\n{shown}")
            if time.monotonic() > deadline:
                shown = "\n".join(self.screen(window)[-40:])
                raise AssertionError(f"timed out after {timeout_s}s waiting for {needle!r}; the screen:\n{shown}")
            time.sleep(0.05)  # polling the screen, not waiting for a worker

    def press(self, key: str, window: str = "main") -> None:
        """A key as tmux names it: ``C-c`` is Ctrl-C (the terminal sends SIGINT to the foreground job)."""
        self._cmd("send-keys", "-t", f"walk:{window}", key)

    def wait_done(self, command: str, window: str = "main", timeout_s: float = 90) -> Ran:
        """The typed command's exit code and output, once its prompt came back."""
        markers = self._wait(window, 2, timeout_s, f"{command!r} to end")
        lines = self.screen(window)
        ends = [i for i, line in enumerate(lines) if _DONE.search(line.rstrip())]
        output = lines[ends[0] + 2 : ends[1]]  # after the clear's marker and the typed line
        unfinished = _DONE.sub("", lines[ends[1]].rstrip())  # a last line printed without its newline
        return Ran(command, markers[1], output + ([unfinished] if unfinished else []))

    def run(self, command: str, window: str = "main", timeout_s: float = 90) -> Ran:
        self.type(command, window)
        return self.wait_done(command, window, timeout_s)

    def close(self) -> None:
        subprocess.run([self.tmux, "-L", self.socket, "kill-server"], env=self.env, capture_output=True, timeout=30)
        self.rc.unlink(missing_ok=True)
        sockets = Path(self.env.get("TMUX_TMPDIR") or "/tmp", f"tmux-{os.getuid()}")
        (sockets / self.socket).unlink(missing_ok=True)  # kill-server leaves its socket file behind


def offline_pip_env(python: str) -> dict[str, str]:
    """pip's variables for installing without the internet: the local indexes (``file://``) and find-links of the
    machine's pip configuration only, never an https index (no test calls the internet)."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    values: dict[str, list[str]] = {}
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        values.setdefault(key.split(".", 1)[-1], []).extend(value.strip().strip("'\"").split())
    for name, key in (("PIP_INDEX_URL", "index-url"), ("PIP_EXTRA_INDEX_URL", "extra-index-url"),
                      ("PIP_FIND_LINKS", "find-links")):  # fmt: skip
        values.setdefault(key, []).extend(os.environ.get(name, "").split())
    indexes = [u for u in values.get("index-url", []) + values.get("extra-index-url", []) if u.startswith("file:")]
    links = [u for u in values.get("find-links", []) if not re.match(r"^https?:", u)]
    env = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    if indexes:
        env["PIP_INDEX_URL"], env["PIP_EXTRA_INDEX_URL"] = indexes[0], " ".join(indexes[1:])
    else:
        env["PIP_NO_INDEX"] = "1"
    env["PIP_FIND_LINKS"] = " ".join(links)
    return env
