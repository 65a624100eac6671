"""Telling a follower that events it asked for are gone from the session stream: never skipping them.

Streams are trimmed (``JUNE_STREAM_MAXLEN``, by length or age), and a stream Redis lost is rebuilt
from a store that may have pruned its oldest events. A follower finds out in two ways:

* **a seq jump**: structural events carry the session's ``seq`` (1, 2, 3... without holes in the
  store), so once a follower knows the last seq it holds, a structural entry whose seq is more than
  one past it means the ones between are missing;
* **a trimmed position**: a follower that starts from a stream id no longer in the stream, older than
  the stream's first entry, while the stream has lost entries (``entries-added`` > ``length``), may
  have lost what came after that id. With the seq it holds (``last_seq``, or 0 from the start) the
  first structural entry still there says exactly what is missing; without it the gap is told with
  the first missing seq unknown;
* **a position from an earlier copy of the stream**: its keys expired (``JUNE_STREAM_TTL_S``) or Redis
  lost them, and the stream was rebuilt from a store that pruned its oldest events, so it lost
  nothing by its own count. A follower that does not say which seq it holds and starts from an id at
  or before which the stream holds nothing (or from any id but ``0-0`` of a stream that is not there)
  is told a gap before the first structural entry unless that entry is seq 1: without ``last_seq``
  nothing else can say whether events between are gone. Deltas before it (live, never a gap) may
  come first when the stream is not there yet at the start.

Before its first read a follow sends one pipeline (queued by :func:`queue_start_check`: ``XINFO
STREAM``, and the entries up to its start id when it did not say which seq it holds), and
:func:`judge_start` says which seq it holds and whether its start may be a gap; only then (rare) does
it read the entries after its start, and :meth:`Start.settle` says what is missing. Deltas are never
counted: a trim that took only deltas (live tokens, never re-sent) is not a gap, and a trim noticed
mid-follow is told at the next structural entry.

The rule a reader must not break: **a gap is raised before anything after it is yielded**, and the
follow stops there; the caller reloads from the store and follows again from ``resume_id`` with
``last_seq=next_seq - 1``. The error is the caller's own subclass of
:class:`~june_wire.errors.StreamGapError` (:meth:`Gap.error`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import StreamGapError
from .events import DELTA_TYPES, text

__all__ = ["SCAN", "Gap", "Start", "id_before", "judge_start", "jump", "lost_start", "queue_start_check"]

SCAN = 100
"""Entries read on each side of a start id to find the seqs around it."""

_MAX_SEQ_PART = 2**64 - 1

GapError = TypeVar("GapError", bound=StreamGapError)


def id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def id_before(entry_id: str) -> str:
    """The greatest stream id below ``entry_id``: an XREAD from it returns ``entry_id`` first."""
    ms, seq = id_key(entry_id)
    if seq > 0:
        return f"{ms}-{seq - 1}"
    return f"{ms - 1}-{_MAX_SEQ_PART}" if ms > 0 else "0-0"


def entry_seq(fields: Any) -> int | None:
    """The seq of a structural entry (fields ``type`` and ``data``); None for a delta or an undecodable one."""
    if not fields:
        return None
    decoded = {text(k): v for k, v in dict(fields).items()}
    if text(decoded.get("type", "")) in DELTA_TYPES:
        return None
    try:
        seq = json.loads(decoded["data"]).get("seq")
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and seq > 0 else None


@dataclass(frozen=True, slots=True)
class Gap:
    """Where a follower's events are missing, and how it goes on after them."""

    stream: str
    after_id: str
    """The follower's position: the last entry it got (or the id it started from)."""
    resume_id: str
    """Follow again from here (with ``last_seq=next_seq - 1``) to go on right after the gap."""
    first_missing_seq: int | None
    next_seq: int | None
    trimmed: bool
    """True: the stream no longer holds ``after_id``; False: a seq jump between two entries."""

    def describe(self, reload: str) -> str:
        """One message naming the first missing seq (when known) and how to reload; ``reload`` says where from."""
        first, nxt = self.first_missing_seq, self.next_seq
        if first is None:
            head = f"{self.stream} no longer holds {self.after_id}: the entries after it were trimmed"
            lacking = f"the events you lack before seq {nxt}" if nxt is not None else "the events you lack"
            todo = f"reload {lacking} from {reload} (follow with last_seq, the last seq you hold, to have it exact)"
        else:
            span = (
                f"seq {first} on" if nxt is None else f"seq {first}" if nxt == first + 1 else f"seq {first}-{nxt - 1}"
            )
            cause = f"trimmed after {self.after_id}" if self.trimmed else f"seq {nxt} follows seq {first - 1}"
            head = f"events {span} are missing from {self.stream} ({cause})"
            todo = f"reload them from {reload} with after_seq={first - 1}"
        again = f"last_seq={nxt - 1}" if nxt is not None else "last_seq set to the last seq you then hold"
        return f"{head}; {todo}, then follow again from {self.resume_id} with {again}"

    def error(self, reload: str, kind: type[GapError]) -> GapError:
        """The error to raise, of the caller's class ``kind``: the message says to reload from ``reload``."""
        return kind(
            self.describe(reload), self.stream, self.after_id, self.resume_id, self.first_missing_seq, self.next_seq
        )


def jump(stream: str, after_id: str, entry_id: str, last_seq: int, seq: int) -> Gap:
    """The gap before structural entry ``entry_id`` (seq ``seq``) when the follower holds up to ``last_seq``."""
    return Gap(stream, after_id, id_before(entry_id), last_seq + 1, seq, trimmed=False)


def lost_start(stream: str, after_id: str, entry_id: str, seq: int) -> Gap | None:
    """The gap before structural entry ``entry_id`` (seq ``seq``), the first one a follower whose start id belongs
    to no copy of the stream here (:attr:`Start.lost`) meets; None when it is seq 1: nothing can be missing."""
    return None if seq <= 1 else Gap(stream, after_id, id_before(entry_id), None, seq, trimmed=True)


def queue_start_check(pipe: Any, stream: str, last_id: str, last_seq: int | None) -> None:
    """Queue what :func:`judge_start` reads: XINFO STREAM, and the entries up to ``last_id`` when the seq the
    follower holds is not known."""
    pipe.xinfo_stream(stream)
    if last_seq is None and last_id != "0-0":
        pipe.xrevrange(stream, max=last_id, min="-", count=SCAN)


def _first_seq(entries: Any) -> int | None:
    for _entry_id, fields in entries or []:
        seq = entry_seq(fields)
        if seq is not None:
            return seq
    return None


@dataclass(frozen=True, slots=True)
class Start:
    """What the start check found: the seq the follower holds, and whether events after its start may be gone."""

    stream: str
    last_id: str
    anchor: int | None
    """The last structural seq the follower holds; None: not known until its first structural entry."""
    suspect: bool
    """Events after the start id may be gone (it is older than the stream's first entry, and the stream lost
    entries or the follower's seq is not known): read the entries after it (``XRANGE stream (<last_id> + COUNT
    SCAN``) and :meth:`settle` with them."""
    last_generated: str
    lost: bool = False
    """The follower's seq is not known and the stream is not there (or never held an entry): its start id is
    from an earlier copy of it. The first structural entry to come is checked with :func:`lost_start`."""

    def settle(self, after: Any) -> tuple[int | None, Gap | None]:
        """The seq held and the gap at the start, given the entries after it (read only when ``suspect``)."""
        after = [] if isinstance(after, Exception) else list(after or [])
        next_seq = _first_seq(after)
        if self.anchor is not None and next_seq is not None and next_seq <= self.anchor + 1:
            return self.anchor, None  # only deltas were trimmed after the start: nothing structural is missing
        if self.anchor is None and next_seq == 1:
            return 0, None  # the stream holds the session from its first event on: nothing structural is missing
        resume_id = id_before(text(after[0][0])) if after else self.last_generated
        first_missing = None if self.anchor is None else self.anchor + 1
        return self.anchor, Gap(self.stream, self.last_id, resume_id, first_missing, next_seq, trimmed=True)


def judge_start(stream: str, last_id: str, last_seq: int | None, replies: list[Any]) -> Start:
    """Read the replies of :func:`queue_start_check` (XINFO's is an error when there is no stream)."""
    info = replies[0] if isinstance(replies[0], dict) else None
    before = list(replies[1] or []) if len(replies) > 1 and not isinstance(replies[1], Exception) else []
    held = bool(before) and text(before[0][0]) == last_id
    first = info.get("first-entry") if info else None
    first_id = text(first[0]) if first else None
    last_generated = text(info.get("last-generated-id", "0-0")) if info else "0-0"
    added, length = (info.get("entries-added"), info.get("length")) if info else (None, None)
    lost_any = info is not None and (added is None or int(added) > int(length or 0))  # None: Redis < 7, assume so

    anchor = last_seq
    if anchor is None:
        anchor = 0 if last_id == "0-0" else _first_seq(before)
        if anchor is None and held and not lost_any and len(before) < SCAN:
            anchor = 0  # the whole stream up to the start is there, and none of it is structural
    oldest = first_id if first_id is not None else last_generated
    before_oldest = (
        id_key(last_id) < id_key(oldest)  # else inside the stream: trimming takes the oldest entries first
        and not (first_id is not None and last_id == id_before(first_id))  # right before its first entry
    )
    # Without the seq held, a start id at or before which the stream holds nothing may be from an earlier copy of
    # the stream (rebuilt from a pruned store: nothing lost by its own count), so it is suspect all the same.
    unanchored = anchor is None and last_id != "0-0" and not before
    suspect = before_oldest and (lost_any or unanchored)
    lost = unanchored and id_key(last_generated) == (0, 0)  # no stream (or one never written): check what comes
    return Start(stream, last_id, anchor, suspect, last_generated, lost)
