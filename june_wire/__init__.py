"""june's wire protocol: what the workers and the producers must agree on, in one place both import.

=================  ==============================================================================
``events``         a stream entry (fields ``type`` and ``data``), the event types that end a turn's
                   stream or are live deltas, decoding entries and XREAD replies
``keys``           every Redis key, stream and channel name (``SessionRef``, ``EventKeys``)
``gaps``           telling a follower that events it asked for are gone, never skipping them
``follow``         the state of one follow of a session stream, and its sync and async loops
``redis_url``      Redis clients from a URL, one Redis or a Redis Cluster (needs ``redis``)
``storable``       what a stored string may hold, and making a foreign one storable
``ids``            turn ids (``t_`` + a ULID, in mint order) and what an agent, session or turn may be named
``errors``         ``StreamGapError``, the base of the workers' and the producers' own
=================  ==============================================================================

The rule a reader must not break: **this package imports nothing of** ``june_worker`` **or**
``producers``, and nothing outside the standard library but ``redis`` in :mod:`.redis_url`, so that
a service that only enqueues turns (``import producers``) loads no engine, store or worker, and the
engine (which imports no infrastructure) may use every module here but :mod:`.redis_url`.
This file imports none of its modules: each is imported by name.
"""

__all__: list[str] = []
