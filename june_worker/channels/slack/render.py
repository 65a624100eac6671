"""Rendering one turn into one Slack thread: live while it runs, converged at least once when it ended.

Live (:meth:`SlackRenderer.feed` + :meth:`~SlackRenderer.push`): the first words start the reply,
with ``chat.startStream`` when streaming is on (later words go out with ``chat.appendStream``, tool
calls as ``task_update`` chunks on the stream's timeline, the end with ``chat.stopStream``), or
with ``chat.postMessage`` then ``chat.update`` otherwise (or when the stream cannot start). An
optional status line (``assistant.threads.setStatus``) is set when the run starts and always
cleared (post-once too: then it is all a run shows until its end). ``input.requested`` posts the
prompt with Approve / Deny buttons; the run that follows the answer renders into that prompt
message (``chat.update``). A prompt whose buttons Slack refuses for good (``invalid_blocks``) is
said in plain text instead, and logged: the turn stays parked, answerable from the gateway or the
console, and the run after the answer is a message of its own. Nothing is posted for a run with
no words (an empty or tool-only turn); a failed run gets a failure note, a cancelled one a closing
line ("superseded by a newer message" when it was replaced).

At least once (:meth:`SlackRenderer.finish`): every message's ``ts`` is recorded in the
:class:`~june_worker.channels.base.RenderState` right after Slack returned it, and each run that
ended is recorded with the digest of what it shows. ``finish`` folds the stored events, skips
what is recorded as shown, and brings the rest to its final form by updating the recorded
message (stopping a stream a dead worker left open), or posting it if none was recorded: a worker
killed mid-render leaves one complete reply.

The rule a reader must not break: **record a ts before anything else happens**, and never post a
message whose slot already holds one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...engine.events import InputRequested, TurnEvent, TurnResult, TurnStarted
from ...engine.failures import Failure, classify
from ...engine.types import InputRequest, JsonValue
from ...errors import ChannelError
from ..base import RenderContext
from ..view import Segment, Task, fold
from .api import SlackApi
from .blocks import answered_blocks, prompt_blocks

__all__ = ["SlackOptions", "SlackRenderer"]

log = logging.getLogger("june_worker.channels.slack")


@dataclass(frozen=True)
class SlackOptions:
    """How a Slack channel renders."""

    live: bool = True
    """Render while the turn runs; False: post once, when it ended."""
    stream: bool = True
    """Live with chat.startStream / appendStream / stopStream; False: chat.postMessage then chat.update."""
    status: str | None = None
    """A status line ("is thinking…") shown while the turn runs (assistant.threads.setStatus); None: none."""
    approval_confirm: bool = False
    """Approve / Deny ask again in a confirmation dialog."""
    interval_s: float = 0.6
    """Live pushes at most this often (Slack allows about one message update a second per channel)."""


@dataclass
class _Shown:
    """What this renderer put on a message during this run."""

    ts: str | None = None
    mode: str = "post"  # stream | post | update
    text: str = ""
    tasks: dict[str, str] = field(default_factory=dict)
    started_here: bool = False
    diverged: bool = False
    finished: bool = False


def _task_chunk(task: Task) -> dict[str, Any]:
    chunk: dict[str, Any] = {"type": "task_update", "id": task.id[:255], "title": task.name, "status": task.status}
    if task.error:
        chunk["output"] = task.error[:500]
    return chunk


_NOTE_PROMPT = 2000
"""How much of a prompt the plain note repeats when Slack refused its buttons."""


class _Aborted(Exception):
    """The live render was stopped (:meth:`SlackRenderer.abort`): no more Slack calls from it."""


class SlackRenderer:
    def __init__(
        self, api: SlackApi, target: Mapping[str, JsonValue], ctx: RenderContext, options: SlackOptions
    ) -> None:
        channel_id, thread_ts = target.get("channel_id"), target.get("thread_ts")
        if not isinstance(channel_id, str) or not channel_id:
            raise ChannelError('a Slack target needs "channel_id" (the channel to post in)', "", "bad_target", False)
        self.api = api
        self.ctx = ctx
        self.options = options
        self.channel_id = channel_id
        self.thread_ts = thread_ts if isinstance(thread_ts, str) and thread_ts else None
        user, team = target.get("user"), target.get("team_id")
        # Slack wants the person a stream is for, and their team, when it streams into a channel's thread.
        self.recipient = {"recipient_user_id": user if isinstance(user, str) else None,
                          "recipient_team_id": team if isinstance(team, str) else None}  # fmt: skip
        # Post-once still has a live part when there is a status line: it is set while the run goes on.
        self.live = options.live or bool(options.status and self.thread_ts)
        self.interval_s = options.interval_s
        self.segments = fold(ctx.history)
        self._seen_seq = max((e.seq or 0 for e in ctx.history), default=0)
        self._shown: dict[str, _Shown] = {}
        self._status_on = False
        self._no_status = False
        self._finishing = False
        self._aborted = threading.Event()

    def _call(self, method: str, **params: Any) -> dict[str, Any]:
        if self._aborted.is_set():
            raise _Aborted(method)
        return self.api.call(method, **params)

    # --- live ---------------------------------------------------------------------------------------

    def abort(self) -> None:
        """Make no Slack call from now on (a call in flight ends as it would, and its ts is recorded): the
        delivery is rendering the turn now, and two renderers of one thread would post twice."""
        self._aborted.set()

    def feed(self, event: TurnEvent) -> None:
        if event.seq is not None:
            if event.seq <= self._seen_seq:
                return  # already in the history this renderer started from
            self._seen_seq = event.seq
        fold([event], self.segments)

    def push(self) -> None:
        if not self.live or self._aborted.is_set() or not self.segments or self.segments[-1].key is None:
            return
        seg = self.segments[-1]
        try:
            self._status(seg)
            if not self.options.live:
                return  # post-once: the status line only; finish() posts the run and clears it
            if seg.key is not None and seg.key.startswith("resume:"):
                self._push_continuation(seg)
            else:
                self._push_reply(seg)
            if seg.ending == "parked":
                self._post_prompt(seg)
            if seg.ended:
                self._clear_status()
        except _Aborted:
            self.live = False  # stopped from outside: the delivery shows the rest
        except Exception as exc:
            # Live rendering is best effort: what it could not show (Slack failed, or the render state could not
            # be recorded, so going on might post twice), finish() shows when the run ends.
            kind = classify(exc, phase="channel")
            what = exc.method if isinstance(exc, ChannelError) and exc.method else type(exc).__name__
            log.warning("live rendering of turn %s stopped on %s (%s); the delivery finishes it",
                        self.ctx.turn_id, what, kind.value)  # fmt: skip
            self.live = False

    def _status(self, seg: Segment) -> None:
        if self.options.status and self.thread_ts and not seg.ended and not self._status_on and not self._no_status:
            self._status_on = True
            self.ctx.state.put("status", {"on": True})
            self._set_status(self.options.status)

    def _clear_status(self) -> None:
        if self._status_on:
            self._status_on = False
            self._set_status("")
            self.ctx.state.put("status", {"on": False})

    def _set_status(self, status: str) -> None:
        """The status line is an extra: where Slack refuses it (not an assistant thread, a missing scope), it is
        turned off for this run and the reply goes on; only a failure worth another attempt goes up."""
        try:
            self._call("assistant.threads.setStatus", channel_id=self.channel_id, thread_ts=self.thread_ts,
                       status=status)  # fmt: skip
        except ChannelError as exc:
            if classify(exc, phase="channel") is Failure.TRANSIENT:
                raise
            log.warning("the status line of turn %s is off: Slack refused it (%s)", self.ctx.turn_id, exc.code or "-")
            self._no_status, self._status_on = True, False
            self.ctx.state.put("status", {"on": False})

    def _slot(self, key: str) -> _Shown:
        shown = self._shown.get(key)
        if shown is None:
            data = self.ctx.state.get(key) or {}
            ts = data.get("ts")
            # A message an earlier attempt left is brought up to date whole (chat.update), never appended to.
            shown = _Shown(ts=ts if isinstance(ts, str) else None, mode=str(data.get("mode", "post")))
            shown.finished = data.get("done") is not None
            self._shown[key] = shown
        return shown

    def _push_reply(self, seg: Segment) -> None:
        assert seg.key is not None
        shown = self._slot(seg.key)
        if shown.finished:
            return
        if shown.ts is None:
            if not seg.visible:
                if seg.ended:
                    self._done(seg, shown)  # nothing to show: recorded, so the delivery posts nothing either
                return
            if self.options.live and self.options.stream and self.thread_ts and not self._finishing:
                self._start_stream(seg, shown)
            if shown.ts is None:
                self._post(seg, shown)
        elif self._clean_stream(shown):
            self._append(seg, shown)
        elif not seg.ended and seg.body() != shown.text:
            self._update(seg, shown)
        if seg.ended:
            self._end(seg, shown)

    @staticmethod
    def _clean_stream(shown: _Shown) -> bool:
        """A stream this renderer started and that shows exactly what was fed so far."""
        return shown.mode == "stream" and shown.started_here and not shown.diverged

    def _start_stream(self, seg: Segment, shown: _Shown) -> None:
        text = seg.stream_text()
        try:
            data = self._call("chat.startStream", channel=self.channel_id, thread_ts=self.thread_ts,
                              markdown_text=text, **self.recipient)  # fmt: skip
        except ChannelError as exc:
            if classify(exc, phase="channel") is Failure.TRANSIENT:
                raise
            return  # no streaming for this app or place (unknown_method, not_allowed...): post instead
        ts = data.get("ts")
        if not isinstance(ts, str):
            return
        shown.ts, shown.mode, shown.text, shown.started_here = ts, "stream", text, True
        self.ctx.state.put(seg.key or "reply", {"ts": ts, "mode": "stream"})
        self._append_tasks(seg, shown)

    def _post(self, seg: Segment, shown: _Shown) -> None:
        body = seg.body()
        data = self._call("chat.postMessage", channel=self.channel_id, text=body, thread_ts=self.thread_ts)
        ts = data.get("ts")
        if isinstance(ts, str):
            shown.ts, shown.mode, shown.text, shown.started_here = ts, "post", body, True
            self.ctx.state.put(seg.key or "reply", {"ts": ts, "mode": "post"})

    def _append(self, seg: Segment, shown: _Shown) -> None:
        text = seg.stream_text()
        if text != shown.text:
            if not text.startswith(shown.text):
                shown.diverged = True  # a retried step said something else: the message is replaced whole
                return
            self._call("chat.appendStream", channel=self.channel_id, ts=shown.ts,
                       markdown_text=text[len(shown.text):])  # fmt: skip
            shown.text = text
        self._append_tasks(seg, shown)

    def _append_tasks(self, seg: Segment, shown: _Shown) -> None:
        changed = [t for t in seg.tasks.values() if shown.tasks.get(t.id) != t.status]
        if changed:
            self._call("chat.appendStream", channel=self.channel_id, ts=shown.ts,
                       chunks=[_task_chunk(t) for t in changed])  # fmt: skip
            shown.tasks.update({t.id: t.status for t in changed})

    def _update(self, seg: Segment, shown: _Shown) -> None:
        self._stop_stream(seg, shown)
        body = seg.body()
        self._call("chat.update", channel=self.channel_id, ts=shown.ts, text=body or " ")
        shown.text, shown.mode = body, "update"

    def _stop_stream(self, seg: Segment, shown: _Shown) -> None:
        if shown.mode != "stream":
            return
        try:
            self._call("chat.stopStream", channel=self.channel_id, ts=shown.ts)
        except ChannelError as exc:
            if classify(exc, phase="channel") is Failure.TRANSIENT:
                raise
            # not streaming any more (stopped before, or closed by Slack): nothing to stop
        shown.mode = "update"
        self.ctx.state.put(seg.key or "reply", {"ts": shown.ts, "mode": "update"})

    def _end(self, seg: Segment, shown: _Shown) -> None:
        if shown.ts is not None:
            if self._clean_stream(shown):
                self._append(seg, shown)
            if self._clean_stream(shown):
                self._stop_stream(seg, shown)  # the stream shows the run as it ended
            elif shown.mode == "stream" or seg.body() != shown.text:
                self._update(seg, shown)  # stops a stream left open, then shows the run whole
        self._done(seg, shown)

    def _done(self, seg: Segment, shown: _Shown) -> None:
        shown.finished = True
        self.ctx.state.put(seg.key or "reply", {"ts": shown.ts, "mode": shown.mode, "done": seg.digest()})

    # --- the prompt and what follows it -----------------------------------------------------------

    def _prompt_thread(self) -> str | None:
        if self.thread_ts:
            return self.thread_ts
        reply = self.ctx.state.get("reply") or {}
        ts = reply.get("ts")
        return ts if isinstance(ts, str) else None

    def _post_prompt(self, seg: Segment) -> None:
        for request in seg.prompts:  # one message each: answered on its own
            self._post_one_prompt(request)

    def _post_one_prompt(self, request: InputRequest) -> None:
        if self.ctx.state.get(f"prompt:{request.id}") is not None:
            return
        blocks = prompt_blocks(request, turn_id=self.ctx.turn_id, session=self.ctx.session,
                               confirm=self.options.approval_confirm)  # fmt: skip
        try:
            data = self._call("chat.postMessage", channel=self.channel_id, text=request.prompt, blocks=blocks,
                              thread_ts=self._prompt_thread())  # fmt: skip
        except ChannelError as exc:
            if classify(exc, phase="channel") is Failure.TRANSIENT:
                raise  # the delivery tries again
            self._prompt_refused(request, exc)
            return
        ts = data.get("ts")
        if isinstance(ts, str):
            self.ctx.state.put(f"prompt:{request.id}", {"ts": ts, "prompt": request.prompt})

    def _prompt_refused(self, request: InputRequest, exc: ChannelError) -> None:
        """Slack refused the prompt's buttons for good (``invalid_blocks``...): the thread is told in plain text, so
        nobody waits on buttons that will never come; the turn stays parked, answerable from the gateway or the
        console. Recorded without a ts: the run after the answer is posted as a message of its own."""
        code = exc.code or "refused"
        log.error("the approval prompt %s of turn %s could not be shown in Slack (%s); the turn waits for an answer "
                  "from the gateway or the console", request.id, self.ctx.turn_id, code)  # fmt: skip
        note = (f"This turn waits for an answer to: {request.prompt[:_NOTE_PROMPT]}\n"
                f"_Its Approve / Deny buttons could not be shown here (Slack refused them: {code}); it can be "
                "answered from the gateway or the console._")  # fmt: skip
        data = self._call("chat.postMessage", channel=self.channel_id, text=note, thread_ts=self._prompt_thread())
        ts = data.get("ts")
        self.ctx.state.put(f"prompt:{request.id}", {"note": ts if isinstance(ts, str) else None,
                                                    "prompt": request.prompt, "refused": code})  # fmt: skip

    def _push_continuation(self, seg: Segment) -> None:
        """The run after an answer, shown in the prompt message (buttons gone); its own message if none was shown."""
        assert seg.key is not None
        shown = self._slot(seg.key)
        if shown.finished:
            return
        self._close_other_prompts(seg.resumed_input)
        prompt = self.ctx.state.get(f"prompt:{seg.resumed_input}") or {}
        ts, prompt_text = prompt.get("ts"), str(prompt.get("prompt", ""))
        body = seg.body() if seg.visible else ""
        if isinstance(ts, str):
            if shown.ts is None or body != shown.text:
                self._call("chat.update", channel=self.channel_id, ts=ts, text=body or prompt_text or " ",
                           blocks=answered_blocks(prompt_text, body))  # fmt: skip
                shown.ts, shown.mode, shown.text = ts, "update", body
        elif shown.ts is None:
            if seg.visible:
                self._post(seg, shown)
        elif body != shown.text:
            self._update(seg, shown)
        if seg.ended:
            self._done(seg, shown)

    def _close_other_prompts(self, resumed: str | None) -> None:
        """The park's other prompts (it waited on several): answered before the one that resumed the turn, shown
        answered now, their buttons gone (the run after the answers is shown under the last one)."""
        runs: list[list[str]] = [[]]  # the requests each run of the turn parked on; the last park is this one's
        for event in self.ctx.history:
            if isinstance(event, TurnStarted):
                runs.append([])
            elif isinstance(event, InputRequested):
                runs[-1].append(event.request.id)
        asked = next((r for r in reversed(runs) if r), [])
        for input_id in dict.fromkeys(asked):
            if input_id == resumed:
                continue
            data = self.ctx.state.get(f"prompt:{input_id}")
            if data is None or data.get("answered") or not isinstance(data.get("ts"), str):
                continue
            text = str(data.get("prompt", ""))
            self._call("chat.update", channel=self.channel_id, ts=data["ts"], text=text or " ",
                       blocks=answered_blocks(text, ""))  # fmt: skip
            self.ctx.state.put(f"prompt:{input_id}", {**data, "answered": True})

    # --- at least once --------------------------------------------------------------------------------

    def finish(self, events: Sequence[TurnEvent], result: TurnResult) -> None:
        """Show every run of the turn as its stored events say, touching only what is not shown yet; then clear the
        status line, whatever happened (a delivery that failed must not leave "is thinking…" on for good)."""
        self._finishing = True
        try:
            self._converge(events)
        except BaseException:
            try:
                self._clear_left_status()
            except Exception as exc:  # the failure to report is the first one
                log.warning("the status line of turn %s could not be cleared (%s)", self.ctx.turn_id,
                            type(exc).__name__)  # fmt: skip
            raise
        self._clear_left_status()

    def _clear_left_status(self) -> None:
        status = self.ctx.state.get("status") or {}
        if status.get("on") and self.thread_ts:
            self._status_on = True
            self._clear_status()

    def _converge(self, events: Sequence[TurnEvent]) -> None:
        segments = fold(events)
        for seg in segments:
            if seg.key is None or not seg.ended:
                continue
            self.segments = [seg]
            self._shown.pop(seg.key, None)
            data = self.ctx.state.get(seg.key) or {}
            shown_ok = data.get("done") == seg.digest()
            prompt_ok = all(self.ctx.state.get(f"prompt:{p.id}") is not None for p in seg.prompts)
            if shown_ok and prompt_ok:
                continue
            if not shown_ok:
                self._slot(seg.key).finished = False  # shown as something else, or not at all: bring it up to date
                if seg.key.startswith("resume:"):
                    self._push_continuation(seg)
                else:
                    self._push_reply(seg)
            if seg.ending == "parked":
                self._post_prompt(seg)
