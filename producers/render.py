"""How ``june-produce`` shows events and outcomes: JSON lines for programs, a live rich view for people.

No I/O of its own beyond the stream or :class:`rich.console.Console` it is handed, so tests
render onto a ``StringIO``. The rule a reader must not break: **text from a turn is printed as
text, never as rich markup** (a model reply with ``[bold]`` in it must print verbatim), so
everything goes through :class:`rich.text.Text`.
"""

from __future__ import annotations

import json
import shlex
from typing import Any, TextIO

from rich.console import Console
from rich.text import Text

from june_wire.events import FollowedEvent

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_SUSPENDED",
    "EXIT_TIMEOUT",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "LiveView",
    "OpenRequests",
    "answerable",
    "exit_code",
    "resume_command",
    "turn_status",
    "write_json",
]

EXIT_OK = 0
"""The turn completed; a control message was accepted."""
EXIT_FAILED = 1
"""The turn failed, was cancelled or rejected; a control message was not accepted."""
EXIT_USAGE = 2
"""Bad command line or argument (argparse's code)."""
EXIT_SUSPENDED = 3
"""The turn parked on an input request: answer it with ``june-produce resume``."""
EXIT_TIMEOUT = 4
"""``--timeout`` passed before the turn ended."""
EXIT_UNAVAILABLE = 5
"""The broker, the result backend or Redis could not be reached, or a worker did not answer in time."""
EXIT_INTERRUPTED = 130
"""Ctrl-C."""

_CLIP = 300


def write_json(out: TextIO, value: Any) -> None:
    """One JSON line, flushed, so a reader of a pipe sees each event as it comes."""
    out.write(json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str) + "\n")
    out.flush()


def turn_status(event: FollowedEvent | None) -> str:
    """``completed`` / ``failed`` / ``rejected`` / ``cancelled`` / ``suspended`` for a terminal event, else ``unfinished``."""
    if event is None or not event.terminal:
        return "unfinished"
    if event.type == "turn.failed":
        return "rejected" if event.data.get("phase") == "intake" else "failed"
    return {"turn.completed": "completed", "turn.cancelled": "cancelled", "input.requested": "suspended"}[event.type]


def exit_code(event: FollowedEvent | None) -> int:
    """The exit code for a turn whose last event followed was ``event``."""
    return {
        "completed": EXIT_OK,
        "failed": EXIT_FAILED,
        "rejected": EXIT_FAILED,
        "cancelled": EXIT_FAILED,
        "suspended": EXIT_SUSPENDED,
    }.get(turn_status(event), EXIT_TIMEOUT)


def _compact(value: Any) -> str:
    text = (
        value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    )
    return text if len(text) <= _CLIP else text[: _CLIP - 1] + "…"


def _request(event: FollowedEvent) -> dict[str, Any]:
    request = event.data.get("request")
    return request if isinstance(request, dict) else {}


def answerable(event: FollowedEvent) -> bool:
    """Whether a person answers this input request; not one of a child turn's (``child:<agent>:<turn>``, a
    subagent's: only the child's end answers it)."""
    return not str(_request(event).get("id", "")).startswith("child:")


class OpenRequests:
    """The input requests a followed stream has left open so far: asked, and neither answered (one by one:
    ``input.answered``; the last: the turn's ``turn.started`` of its resume) nor ended with their turn."""

    def __init__(self) -> None:
        self._open: dict[tuple[str | None, str], FollowedEvent] = {}

    def see(self, event: FollowedEvent) -> None:
        if event.type == "input.requested":
            if answerable(event):
                self._open[(event.turn_id, str(_request(event).get("id")))] = event
        elif event.type == "input.answered":
            self._open.pop((event.turn_id, str(event.data.get("input_id"))), None)
        elif event.type in ("turn.started", "turn.completed", "turn.failed", "turn.cancelled"):
            for key in [k for k in self._open if k[0] == event.turn_id]:
                del self._open[key]

    def open(self) -> list[FollowedEvent]:
        return list(self._open.values())


def resume_command(agent: str, session: str, event: FollowedEvent) -> str:
    """The ``june-produce resume`` command line that answers the input request ``event`` announces."""
    request = _request(event)
    schema = request.get("schema")
    value = "true" if isinstance(schema, dict) and schema.get("type") == "boolean" else "VALUE"
    answerers = request.get("answerers")
    by = "USER"
    if isinstance(answerers, dict) and isinstance(answerers.get("user"), str):
        by = answerers["user"]
    turn = event.turn_id or "TURN"
    return shlex.join(
        ["june-produce", "resume", agent, session, turn, str(request.get("id", "INPUT")), value, "--by", by]
    )


class LiveView:
    """Writes events to a console as they come: streamed text inline, one line per structural event."""

    def __init__(self, console: Console, agent: str, session: str, *, show_reasoning: bool = True) -> None:
        self.console = console
        self.agent = agent
        self.session = session
        self.show_reasoning = show_reasoning
        self.hint_requests = True
        """False while a follow replays the past: an input request then gets its ``answer with:`` line only if it
        is still open once the replay is over (:meth:`still_waiting`)."""
        self._open = False  # streamed text is on the current line, without its newline
        self._streamed: dict[tuple[str | None, str], str] = {}
        self._attempts: dict[tuple[str | None, str], int] = {}  # the attempt whose deltas are shown, per step

    # --- lines ------------------------------------------------------------------------------------

    def _line(self, *parts: tuple[str, str] | str) -> None:
        self._close()
        self.console.print(Text.assemble(*parts), soft_wrap=True)

    def _stream(self, text: str, style: str) -> None:
        self.console.print(Text(text, style=style), end="", soft_wrap=True)
        self._open = not text.endswith("\n")

    def end_line(self) -> bool:
        """Finish a line of streamed text (before a note, or when the user interrupts); whether one was open."""
        was_open = self._open
        self._close()
        return was_open

    def _close(self) -> None:
        if self._open:
            self.console.print()
            self._open = False

    # --- what the CLI calls -------------------------------------------------------------------------

    def enqueued(self, turn_id: str, queue: str) -> None:
        self._line(("queued ", "dim"), (turn_id, "bold"), (f" for {self.agent}:{self.session} on {queue}", "dim"))

    def note(self, text: str, style: str = "dim") -> None:
        self._line((text, style))

    def show(self, event: FollowedEvent) -> None:
        handler = getattr(self, "_on_" + event.type.replace(".", "_"), None)
        if handler is None:
            self._line(("· ", "dim"), (event.type, "dim"), " ", (_compact(event.data), "dim"))
        else:
            handler(event)

    def finish(self, last: FollowedEvent | None) -> None:
        """The closing line of a followed turn: its status, or that the wait ended first."""
        self._close()
        if last is None or not last.terminal:
            self._line(("… stopped waiting; the turn has not ended (follow it again to see the rest)", "yellow"))

    def still_waiting(self, event: FollowedEvent) -> None:
        """An input request the replay of the past left open: which one, and the command that answers it."""
        request = _request(event)
        self._line(
            ("⏸ still waiting for input ", "yellow"),
            (str(request.get("id")), "bold yellow"),
            (f" of turn {event.turn_id}", "yellow"),
        )
        self._line(("  answer with: ", "dim"), (resume_command(self.agent, self.session, event), "bold"))

    def outcome(self, command: str, data: dict[str, Any], ok: bool) -> None:
        """A control message's answer: ``resume: accepted`` and the details the worker gave."""
        details = {k: v for k, v in data.items() if k != "status" and v is not None}
        self._line(
            (f"{command}: ", "bold"),
            (str(data.get("status")), "green" if ok else "red"),
            (f"  {_compact(details)}" if details else "", "dim"),
        )

    # --- one method per event type -----------------------------------------------------------------

    def _on_turn_started(self, event: FollowedEvent) -> None:
        trigger = event.data.get("trigger")
        how, said = "", None
        if isinstance(trigger, dict):
            kind = trigger.get("kind")
            if kind == "proactive":
                how = f" (proactive, by {trigger.get('by')})"
            elif kind == "resume":
                how = f" (resumed after input {trigger.get('input_id') or trigger.get('call_id')})"
            elif kind == "inbound" and isinstance(trigger.get("event"), dict):
                source = trigger["event"].get("source")
                user = trigger["event"].get("user")
                who = f" from {user.get('id')}" if isinstance(user, dict) else ""
                how = f" ({source}{who})"
                said = trigger["event"].get("text")
        self._line(("▶ ", "cyan"), ("turn ", "dim"), (event.turn_id or "?", "bold"), (f" started{how}", "dim"))
        if isinstance(said, str) and said:  # what the person said: the other side of the conversation
            self._line(("› ", "cyan"), (said, "bold"))

    def _current(self, event: FollowedEvent) -> bool:
        """False for a delta of an older attempt at its step (a dead worker's): it is not shown. The first
        delta of a newer attempt says that the text shown so far for the step came from a dead attempt."""
        attempt, key = event.attempt, (event.turn_id, str(event.step))
        if attempt is None:
            return True
        shown = self._attempts.get(key)
        if shown is not None and attempt < shown:
            return False
        if shown is not None and attempt > shown:
            self._streamed.pop(key, None)
            self._line(
                (f"↻ {event.step} retried (attempt {attempt}); the text above was from a dead attempt", "yellow")
            )
        self._attempts[key] = attempt
        return True

    def _on_message_delta(self, event: FollowedEvent) -> None:
        if not self._current(event):
            return
        text = str(event.data.get("text", ""))
        key = (event.turn_id, str(event.data.get("step")))
        self._streamed[key] = self._streamed.get(key, "") + text
        self._stream(text, "")

    def _on_reasoning_delta(self, event: FollowedEvent) -> None:
        if self._current(event) and self.show_reasoning:
            self._stream(str(event.data.get("text", "")), "dim italic")

    def _on_message_completed(self, event: FollowedEvent) -> None:
        text = str(event.data.get("text", ""))
        streamed = self._streamed.pop((event.turn_id, str(event.data.get("step"))), None)
        if streamed == text:
            self._close()  # it was shown as it typed
        elif not streamed:
            self._line((text, ""))  # caught up from the stream: no deltas for this message
        else:
            self._line(("(final text of a retried step)", "dim"))
            self._line((text, ""))

    def _on_action_requested(self, event: FollowedEvent) -> None:
        call = event.data.get("call") or {}
        self._line(("→ ", "magenta"), (str(call.get("name")), "bold magenta"), (f" {_compact(call.get('input'))}", ""))

    def _on_action_completed(self, event: FollowedEvent) -> None:
        call = event.data.get("call") or {}
        name = str(call.get("name"))
        if event.data.get("error"):
            self._line(("✗ ", "red"), (name, "bold red"), (f" failed: {_compact(event.data['error'])}", "red"))
        else:
            self._line(("← ", "magenta"), (name, "bold magenta"), (f" {_compact(event.data.get('result'))}", "dim"))

    def _on_context_compacted(self, event: FollowedEvent) -> None:
        summarized, kept = event.data.get("summarized"), event.data.get("kept_from")
        self._line(
            ("⋯ context compacted: ", "dim"), (f"{summarized} older messages summarised, kept from {kept}", "dim")
        )

    def _on_input_requested(self, event: FollowedEvent) -> None:
        request = _request(event)
        self._line(
            ("⏸ waiting for input ", "yellow"),
            (str(request.get("id")), "bold yellow"),
            (": ", "yellow"),
            (str(request.get("prompt", "")), "bold"),
        )
        if request.get("schema") is not None:
            self._line(("  expects ", "dim"), (_compact(request["schema"]), "dim"))
        if request.get("answerers") is not None:
            self._line(("  who may answer ", "dim"), (_compact(request["answerers"]), "dim"))
        if self.hint_requests and answerable(event):
            self._line(("  answer with: ", "dim"), (resume_command(self.agent, self.session, event), "bold"))

    def _on_turn_completed(self, event: FollowedEvent) -> None:
        usage = event.data.get("usage")
        tokens = ""
        if isinstance(usage, dict):
            tokens = f" ({usage.get('input_tokens', 0)} in / {usage.get('output_tokens', 0)} out tokens)"
        self._line(("✓ completed", "bold green"), (tokens, "dim"))

    def _on_turn_failed(self, event: FollowedEvent) -> None:
        error = event.data.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        phase = event.data.get("phase")
        label = "✗ rejected" if phase == "intake" else "✗ failed" + (f" in {phase}" if phase else "")
        self._line((label, "bold red"), (f": {message}" if message else "", "red"))

    def _on_turn_cancelled(self, event: FollowedEvent) -> None:
        self._line(("■ cancelled", "bold yellow"), (f" ({event.data.get('reason')})", "dim"))
