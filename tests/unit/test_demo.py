"""The README's first command: the demo runs in process on SQLite, with no server and no key."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from june_worker.demo import run_demo


async def test_the_demo_places_an_order_parks_a_refund_and_replays_without_duplicates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    out = io.StringIO()
    assert await run_demo(tmp_path / "demo.db", out) == 0
    text = out.getvalue()
    assert "-> create_order" in text and "<- create_order" in text
    assert ".. parked, waiting for a human: Refund $19.50 on order 42?" in text
    assert "The refund on order 42 was approved and sent." in text
    assert "orders table still has 1 row(s) (was 1)" in text
    assert "failed" not in text


async def test_the_demo_shows_each_typed_turn_as_a_message_with_its_text_not_as_proactive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    out = io.StringIO()
    assert await run_demo(tmp_path / "demo.db", out) == 0
    text = out.getvalue()
    assert "proactive" not in text
    assert text.count("] started (api)\n") == 2
    assert "  > Order 3 widgets\n" in text and "  > Please refund order 42\n" in text
    assert "] started (resumed after input approve-refund)" in text
