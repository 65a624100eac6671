"""The SQL text the worker sends on every turn stays within what psycopg caches."""

from __future__ import annotations

import itertools

import psycopg._queries
import pytest

from june_worker.stores._pg_commit import _Shape, _sql
from june_worker.stores._sql import PSYCOPG_CACHED_QUERY_MAX, one_line
from june_worker.worker import queue


def test_our_limit_is_psycopgs() -> None:
    # a psycopg upgrade that changes its cache limit must show up here, not as a silent slowdown
    assert psycopg._queries.MAX_CACHED_STATEMENT_LENGTH == PSYCOPG_CACHED_QUERY_MAX


def test_the_intake_and_read_statements_are_short_enough_for_psycopgs_query_cache() -> None:
    assert len(queue._INTAKE.encode()) <= PSYCOPG_CACHED_QUERY_MAX
    assert len(queue._READ.encode()) <= PSYCOPG_CACHED_QUERY_MAX


@pytest.mark.parametrize(("release", "deliver"), [(False, False), (True, False), (False, True)])
def test_every_commit_shape_of_an_ordinary_step_is_short_enough_for_psycopgs_query_cache(
    release: bool, deliver: bool
) -> None:
    # up to two messages, two steps and three events: what a turn's open, model, tool and last steps commit
    for messages, steps, events, suspended, opening in itertools.product(
        range(3), range(3), range(4), ["keep", "set", "clear"], [False, True]
    ):
        shape = _Shape(
            messages,
            steps,
            events,
            status=True,
            suspended=suspended,
            fenced=True,
            expect=suspended == "clear",
            expired=suspended == "clear",
            turn=True,
            not_cancelled=opening,
            turn_error=False,
            cancel=False,
            release=release,
            deliver=deliver,
        )
        assert len(_sql(shape).encode()) <= PSYCOPG_CACHED_QUERY_MAX, shape


def test_one_line_keeps_the_words_and_refuses_what_it_would_change() -> None:
    assert one_line("select 1\n  from  t\n\twhere x = %(x)s") == "select 1 from t where x = %(x)s"
    with pytest.raises(ValueError, match="comment"):
        one_line("select 1 -- a comment\nfrom t")
