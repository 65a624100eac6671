"""Noticing that Redis lost its data: epoch keys and the rebuild pass (june_worker/events/losses.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from june_worker.engine.store import SessionRef
from june_worker.events import EventKeys, losses
from june_worker.events._redis_url import connect

pytestmark = pytest.mark.integration


def test_a_pass_is_moved_on_or_ended_only_by_a_sweep_that_runs_that_same_pass(redis_url: str) -> None:
    keys = EventKeys(prefix=f"june-it-{uuid.uuid4().hex[:8]}")
    client = connect(redis_url)
    try:
        # Given a pass a loss began, and a second loss (the epoch key gone again) that began another
        first = losses.pending_pass(client, keys)
        assert first is not None and first.began
        client.delete(keys.epoch(0))
        second = losses.pending_pass(client, keys)
        assert second is not None and second.began and second.pass_id != first.pass_id
        # When a sweep still running the first pass moves it on, then ends it
        moved = losses.move_pass(client, keys, first, SessionRef("ops", "s9"))
        ended = losses.finish_pass(client, keys, first)
        # Then neither touches the second pass: it goes on from the start
        assert (moved, ended) == (False, False)
        assert losses.pending_pass(client, keys) == losses.RebuildPass(second.pass_id, None)
    finally:
        client.delete(keys.epoch(0), keys.rebuild_pass())
        client.close()


def test_on_a_cluster_each_primary_keeps_an_epoch_key_of_its_own(redis_cluster_url: str) -> None:
    # Given a three-node cluster
    client: Any = connect(redis_cluster_url)
    try:
        # When the epoch keys are named
        epochs = losses.epoch_keys(client, EventKeys(prefix=f"june-it-{uuid.uuid4().hex[:8]}"))
        # Then there is one on each primary: whichever node loses its data, one of them goes with it
        owners = sorted(client.get_node_from_key(key).name for key in epochs)
        assert owners == sorted(node.name for node in client.get_primaries())
    finally:
        client.close()
