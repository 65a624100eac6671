"""The one error the wire protocol raises: events a follower asked for are gone from the session stream.

The workers and the producers each raise a subclass of their own error tree
(``june_worker.errors.StreamGapError``, a ``JuneError``; ``producers.errors.StreamGapError``, a
``ProducerError``), made by :meth:`june_wire.gaps.Gap.error`; ``except june_wire.errors.StreamGapError``
catches both. It survives pickling: ``__init__`` passes every argument to ``super().__init__``.
"""

from __future__ import annotations

__all__ = ["StreamGapError"]


class StreamGapError(Exception):
    """Events a follower asked for are no longer in the session stream (trimmed), or its ``seq`` jumped.

    ``first_missing_seq`` is the first seq the follower lacks (None when its position was trimmed and it
    did not say which seq it holds); ``next_seq`` the first seq the stream still holds after the gap
    (None: none yet). Reload the missing events from the store, then follow again from ``resume_id``
    with ``last_seq=next_seq - 1``.
    """

    def __init__(
        self,
        message: str,
        stream: str,
        after_id: str,
        resume_id: str,
        first_missing_seq: int | None,
        next_seq: int | None,
    ) -> None:
        super().__init__(message, stream, after_id, resume_id, first_missing_seq, next_seq)
        self.message = message
        self.stream = stream
        self.after_id = after_id
        self.resume_id = resume_id
        self.first_missing_seq = first_missing_seq
        self.next_seq = next_seq

    def __str__(self) -> str:
        return self.message
