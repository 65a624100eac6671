"""``june-produce``: enqueue turns, answer parked ones, cancel, reset, and watch events, from a shell.

::

    june-produce turn ops s1 "refund order 42"          # enqueue, then show the turn live
    june-produce turn ops s1 "..." --no-follow           # print the turn id and return
    june-produce turn ops s1 "..." --durable             # recorded in june's Postgres first
    june-produce follow ops s1 [--turn T] [--from ID]    # a session's (or a turn's) events
    june-produce resume ops s1 T approve-refund true --by U024BE7LH [--follow]
    june-produce cancel ops s1 [T]
    june-produce reset ops s1

A turn typed here is a message from the person at the shell: it carries the inbound event
``{"source": "cli", "kind": "message", "user": {"id": <--user, default the login name>,
"attested": true}, "text": <what was typed>}`` unless ``--event`` gives another or ``--proactive-by``
makes it proactive (the text in the event is what a follower of the session sees the person say).
The speaker is attested as ``--by`` is trusted: whoever can reach the broker can send anything.

Configuration comes from the worker's variables (``JUNE_REDIS_URL``, ``CELERY_BROKER_URL``,
``CELERY_RESULT_BACKEND``, ``JUNE_QUEUE``, ``JUNE_CONTROL_QUEUE``, ``JUNE_KEY_PREFIX``,
``JUNE_BROKER_QUEUE_TYPE``, ``JUNE_PUBLISH_TIMEOUT_S``, ``JUNE_PUBLISH_RETRIES``, and
``JUNE_DATABASE_URL`` for ``--durable``). With
``--json``, or when stdout is not a terminal, stdout carries JSON lines only (one per event, with
its ``stream_id``); messages for people go to stderr. Exit codes: see :mod:`producers.render`.

The rule a reader must not break: argument parsing and I/O live here, drawing lives in
:mod:`producers.render`, so each can be tested without the other.
"""

from __future__ import annotations

import argparse
import getpass
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import redis
from rich.console import Console

from june_wire.events import FollowedEvent

from . import new_turn_id, render
from .client import JuneProducer
from .errors import ProducerError, StreamGapError
from .render import LiveView, OpenRequests, write_json

__all__ = ["build_parser", "cli_event", "login_name", "main", "parse_value"]

_CANCEL_FAILURES = frozenset({"rejected", "error", "invalid", "forbidden", "not_found"})


def parse_value(text: str) -> Any:
    """An answer typed on the command line: JSON when it parses (``true``, ``42``, ``{"a": 1}``), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def _position(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


class _Out:
    """Where output goes: JSON lines on stdout, or the live view; messages for people on stderr.

    ``history``: the stream id up to which the events shown are the session's past (a follow that
    replays it). An input request among them gets its ``answer with:`` hint only once the replay
    has shown it still open (:meth:`end_of_history`): most were answered long ago.
    """

    def __init__(self, stdout: TextIO, stderr: TextIO, json_mode: bool, agent: str, session: str) -> None:
        self.stdout, self.stderr, self.json_mode = stdout, stderr, json_mode
        self.view = LiveView(Console(file=stdout, highlight=False), agent, session)
        self.requests = OpenRequests()
        self.history: tuple[int, int] | None = None
        self.turn: str | None = None  # the turn being sent or followed, for the line Ctrl-C prints
        self.sent = False  # whether that turn's message is known to be sent
        self.last_id: str | None = None  # the stream id of the last event shown
        self.waiting_for: str | None = None  # the control message whose answer is awaited (resume, cancel, reset)

    def interrupted(self) -> str:
        """The one line Ctrl-C prints: what goes on without this command, and the command that follows it."""
        agent, session = self.view.agent, self.view.session
        if self.waiting_for is not None:
            return (
                f"interrupted while waiting for the worker's answer to the {self.waiting_for}: it may have been sent "
                f"and may still apply; see the session with: {shlex.join(['june-produce', 'follow', agent, session])}"
            )
        if self.turn is not None:
            follow = shlex.join(["june-produce", "follow", agent, session, "--turn", self.turn])
            if not self.sent:
                return (
                    f"interrupted while sending turn {self.turn}: it may be queued; send it again with --turn-id "
                    f"{self.turn} (it runs once), or see it with: {follow}"
                )
            return f"stopped following; turn {self.turn} goes on without you: {follow}"
        again = ["june-produce", "follow", agent, session] + (["--from", self.last_id] if self.last_id else [])
        return f"stopped following {agent}:{session}; go on from where you were with: {shlex.join(again)}"

    def replaying(self, until: str) -> None:
        """Events up to stream id ``until`` are the past: their input requests wait for :meth:`end_of_history`."""
        self.history = _position(until)
        self.view.hint_requests = False

    def _past(self, event: FollowedEvent) -> bool:
        return self.history is not None and _position(event.stream_id) <= self.history

    def end_of_history(self) -> None:
        """The replay has shown the past: hint how to answer each input request it left open, and go live."""
        if self.history is None:
            return
        self.history = None
        self.view.hint_requests = True
        for event in self.requests.open():
            command = render.resume_command(self.view.agent, self.view.session, event)
            if self.json_mode:
                print(f"june-produce: turn {event.turn_id} still waits; answer with: {command}", file=self.stderr)
            else:
                self.view.still_waiting(event)

    def info(self, text: str) -> None:
        if self.json_mode:
            print(f"june-produce: {text}", file=self.stderr, flush=True)
        else:
            self.view.note(text)

    def event(self, event: FollowedEvent) -> None:
        if self.history is not None and not self._past(event):
            self.end_of_history()  # the first event after the past: what is still open was, when it began
        self.requests.see(event)
        self.last_id = event.stream_id
        if self.json_mode:
            write_json(self.stdout, event.to_json())
            if event.type == "input.requested" and self.history is None and render.answerable(event):
                command = render.resume_command(self.view.agent, self.view.session, event)
                print(f"june-produce: answer with: {command}", file=self.stderr, flush=True)
        else:
            self.view.show(event)

    def gap(self, gap: StreamGapError) -> None:
        """Events the stream no longer holds: said on stdout (a ``stream.gap`` line, or a note) before going on."""
        if self.json_mode:
            write_json(
                self.stdout,
                {
                    "stream_id": gap.resume_id,
                    "type": "stream.gap",
                    "first_missing_seq": gap.first_missing_seq,
                    "next_seq": gap.next_seq,
                    "after_id": gap.after_id,
                    "resume_id": gap.resume_id,
                    "message": gap.message,
                },
            )
        else:
            self.view.note(f"⚠ {gap.message}", "yellow")

    def outcome(self, command: str, data: dict[str, Any], ok: bool) -> None:
        if self.json_mode:
            write_json(self.stdout, data)
        else:
            self.view.outcome(command, data, ok)


class _Position:
    """Where a follow goes on from: the last stream id handled, and the last structural seq held."""

    def __init__(self, last_id: str) -> None:
        self.last_id = last_id
        self.last_seq: int | None = None
        self.last: FollowedEvent | None = None


def _drain(
    producer: JuneProducer, out: _Out, args: argparse.Namespace, turn_id: str | None, at: _Position,
    timeout_s: float | None,
) -> int:  # fmt: skip
    """Show the events after ``at`` (until the turn's terminal event, or ``timeout_s``); how many were shown."""
    shown = 0
    while True:
        events = producer.follow(
            args.agent, args.session, turn_id=turn_id, last_id=at.last_id, timeout_s=timeout_s, last_seq=at.last_seq
        )
        try:
            for event in events:
                out.event(event)
                shown += 1
                at.last, at.last_id = event, event.stream_id
                if event.seq is not None:
                    at.last_seq = event.seq
            return shown
        except StreamGapError as gap:  # told, then followed on after the gap
            out.gap(gap)
            at.last_id, at.last_seq = gap.resume_id, (gap.next_seq - 1 if gap.next_seq is not None else None)


def _follow(
    producer: JuneProducer, out: _Out, args: argparse.Namespace, turn_id: str | None, last_id: str,
    history: str | None = None,
) -> int:  # fmt: skip
    """Show a session's (or a turn's) events after ``last_id``; the exit code. ``history``: the stream's last id
    before anything was sent: a follow that starts before it replays the past first, to its end, then goes live."""
    at = _Position(last_id)
    if history is not None and history != "0-0" and last_id not in ("$", history):
        out.replaying(history)
        # A turn's follow ends at its first terminal event; one of the past (a park answered since) is not its end
        while _drain(producer, out, args, turn_id, at, 0) and turn_id is not None and _answered_park(out, at.last):
            pass
        out.end_of_history()
        if turn_id is not None and at.last is not None and at.last.terminal:
            return _finish(out, args, turn_id, at.last)
    _drain(producer, out, args, turn_id, at, args.timeout)
    return _finish(out, args, turn_id, at.last)


def _answered_park(out: _Out, last: FollowedEvent | None) -> bool:
    """The replay stopped at a park of the past that its stream may answer further on: read on."""
    return last is not None and last.type == "input.requested" and out._past(last)


def _finish(out: _Out, args: argparse.Namespace, turn_id: str | None, last: FollowedEvent | None) -> int:
    if turn_id is None:
        return render.EXIT_OK
    if not out.json_mode:
        out.view.finish(last)
    elif last is None or not last.terminal:
        out.info(f"stopped waiting after {args.timeout:g}s; turn {turn_id} has not ended")
    return render.exit_code(last)


def login_name() -> str:
    """Who is at the shell, as the system knows them; ``cli`` when it cannot say."""
    try:
        return getpass.getuser() or "cli"
    except (OSError, KeyError, ImportError):
        return "cli"


def cli_event(user: str, text: str | None = None) -> dict[str, Any]:
    """The inbound event of a turn typed at the shell: its speaker is the CLI's user, vouched for like ``--by``, and
    what they typed (its ``turn.started`` then shows a follower of the session what the person said)."""
    event: dict[str, Any] = {"source": "cli", "kind": "message", "user": {"id": user, "attested": True}}
    if text is not None:
        event["text"] = text
    return event


def _cmd_turn(producer: JuneProducer, out: _Out, args: argparse.Namespace) -> int:
    trigger = {"kind": "proactive", "by": args.proactive_by} if args.proactive_by else None
    event = args.event
    if args.user is not None and (event is not None or trigger is not None):
        raise ValueError("--user names the speaker of the default event; it cannot go with --event or --proactive-by")
    if event is None and trigger is None:
        event = cli_event(args.user or login_name(), args.text)
    # A new turn's events all come after the stream's current end; a resent turn id may have older ones (its past).
    tail = "0-0" if args.no_follow else producer.last_stream_id(args.agent, args.session)
    start = "0-0" if args.turn_id else tail
    out.turn = args.turn_id or new_turn_id()  # minted here, so a Ctrl-C while sending can name it
    turn_id = producer.start_turn(
        args.agent,
        args.session,
        args.text,
        event=event,
        turn_id=out.turn,
        replace=args.replace,
        trigger=trigger,
        durable=True if args.durable else None,
    )
    out.sent = True
    if args.no_follow:
        if out.json_mode:
            write_json(out.stdout, {"turn_id": turn_id, "agent": args.agent, "session": args.session})
        else:
            print(turn_id, file=out.stdout, flush=True)
        return render.EXIT_OK
    if out.json_mode:
        out.info(f"queued {turn_id} for {args.agent}:{args.session} on {producer.queue}")
    else:
        out.view.enqueued(turn_id, producer.queue)
    return _follow(producer, out, args, turn_id, start, history=tail)


def _cmd_follow(producer: JuneProducer, out: _Out, args: argparse.Namespace) -> int:
    out.turn, out.sent = args.turn, True
    history = producer.last_stream_id(args.agent, args.session)  # what the stream holds is the past
    return _follow(producer, out, args, args.turn, args.from_id, history=history)


def _cmd_resume(producer: JuneProducer, out: _Out, args: argparse.Namespace) -> int:
    start = producer.last_stream_id(args.agent, args.session) if args.follow else "0-0"
    out.waiting_for = "resume"
    outcome = producer.resume(
        args.agent,
        args.session,
        args.turn,
        args.input,
        parse_value(args.value),
        by=args.by,
        timeout_s=args.wait,
    )
    out.waiting_for = None
    out.outcome("resume", {**outcome.raw, "status": outcome.status}, outcome.accepted)
    if not outcome.accepted:
        return render.EXIT_FAILED
    if args.follow:
        out.turn, out.sent = args.turn, True
        return _follow(producer, out, args, args.turn, start)
    return render.EXIT_OK


def _cmd_cancel(producer: JuneProducer, out: _Out, args: argparse.Namespace) -> int:
    out.waiting_for = "cancel"
    result = producer.cancel(args.agent, args.session, args.turn, timeout_s=args.wait)
    out.waiting_for = None
    ok = result["status"] not in _CANCEL_FAILURES
    out.outcome("cancel", result, ok)
    return render.EXIT_OK if ok else render.EXIT_FAILED


def _cmd_reset(producer: JuneProducer, out: _Out, args: argparse.Namespace) -> int:
    out.waiting_for = "reset"
    outcome = producer.reset(args.agent, args.session, timeout_s=args.wait)
    out.waiting_for = None
    ok = outcome.status != "rejected"
    out.outcome("reset", {**outcome.raw, "status": outcome.status}, ok)
    return render.EXIT_OK if ok else render.EXIT_FAILED


Command = Callable[[JuneProducer, _Out, argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="june-produce",
        description="Send june turns and control messages, and follow their events. "
        "Configured by JUNE_REDIS_URL, CELERY_BROKER_URL, CELERY_RESULT_BACKEND, JUNE_QUEUE, "
        "JUNE_CONTROL_QUEUE, JUNE_KEY_PREFIX, JUNE_BROKER_QUEUE_TYPE, JUNE_PUBLISH_TIMEOUT_S, "
        "JUNE_PUBLISH_RETRIES and (for --durable) JUNE_DATABASE_URL.",
        epilog="exit codes: 0 completed/accepted, 1 failed/cancelled/rejected/not accepted, 2 usage, "
        "3 suspended (waiting for input), 4 --timeout passed first, 5 broker/Redis/worker unavailable",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Command, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(handler=handler)
        p.add_argument("agent", metavar="AGENT")
        p.add_argument("session", metavar="SESSION")
        p.add_argument("--json", action="store_true", help="JSON lines on stdout (the default when not a terminal)")
        return p

    def follow_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--timeout", type=_seconds, default=None, metavar="S", help="stop waiting after S seconds")

    def wait_option(p: argparse.ArgumentParser, default: float) -> None:
        p.add_argument(
            "--wait",
            type=_seconds,
            default=default,
            metavar="S",
            help=f"how long to wait for the worker's answer (default {default:g})",
        )

    p = command("turn", _cmd_turn, "enqueue a turn, then show its events until it ends")
    p.add_argument("text", metavar="TEXT")
    p.add_argument("--turn-id", help="resend this turn id (the worker runs a turn id once)")
    p.add_argument("--replace", action="store_true", help="cancel the session's unfinished turns for this one")
    p.add_argument(
        "--event",
        type=_json_object,
        metavar="JSON",
        help='the inbound event, a JSON object (default: {"source": "cli", "kind": "message", "user": '
        '{"id": USER, "attested": true}})',
    )
    p.add_argument(
        "--user",
        metavar="USER",
        help="who is typing: the speaker of the default event, who may answer its input requests "
        "that name no answerers (default: your login name)",
    )
    p.add_argument("--proactive-by", metavar="BY", help="a turn nobody typed, started by BY (e.g. cron:daily)")
    p.add_argument("--no-follow", action="store_true", help="print the turn id and return")
    p.add_argument(
        "--durable",
        action="store_true",
        help="record the turn in june's Postgres (JUNE_DATABASE_URL) before sending: it runs even if the broker "
        "loses the message",
    )
    follow_options(p)

    p = command("follow", _cmd_follow, "show a session's events (catch-up, then live)")
    p.add_argument("--turn", metavar="TURN", help="only this turn's events, ending after its last one")
    p.add_argument("--from", dest="from_id", default="0-0", metavar="ID", help="after this stream id (default 0-0)")
    follow_options(p)

    p = command("resume", _cmd_resume, "answer a parked turn's input request")
    p.add_argument("turn", metavar="TURN")
    p.add_argument("input", metavar="INPUT")
    p.add_argument("value", metavar="VALUE", help="JSON when it parses (true, 42, {...}), else a string")
    p.add_argument("--by", required=True, metavar="USER", help="the verified identity answering")
    p.add_argument("--follow", action="store_true", help="when accepted, show the turn until it ends")
    wait_option(p, 30)
    follow_options(p)

    p = command("cancel", _cmd_cancel, "cancel a turn, or all unfinished turns of the session")
    p.add_argument("turn", metavar="TURN", nargs="?")
    wait_option(p, 30)

    p = command("reset", _cmd_reset, "retire the session's history (a new generation)")
    wait_option(p, 60)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stdout, stderr = sys.stdout, sys.stderr
    out = _Out(stdout, stderr, args.json or not stdout.isatty(), args.agent, args.session)
    handler: Command = args.handler
    try:
        with JuneProducer.from_env() as producer:
            return handler(producer, out, args)
    except KeyboardInterrupt:
        ended = out.view.end_line() if not out.json_mode else False
        if not ended and stderr.isatty():
            print(file=stderr)  # off the line where the terminal echoed ^C
        print(f"june-produce: {out.interrupted()}", file=stderr, flush=True)
        return render.EXIT_INTERRUPTED
    except ValueError as exc:  # a bad argument, checked before anything was sent (ProducerConfigError too)
        print(f"june-produce: {exc}", file=stderr)
        return render.EXIT_USAGE
    except ProducerError as exc:
        print(f"june-produce: {exc}", file=stderr)
        return render.EXIT_UNAVAILABLE
    except redis.RedisError as exc:
        print(f"june-produce: reading events from Redis failed: {type(exc).__name__}: {exc}", file=stderr)
        return render.EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
