"""Turn ids: ``t_`` + a 26-character Crockford ULID, sorting in the order one process minted them."""

from __future__ import annotations

import re
import threading

import pytest

from producers import _ulid, new_turn_id
from producers._ulid import CROCKFORD, UlidGenerator
from tests._fork import in_forked_children

ULID = re.compile(r"^[0-7][0-9A-HJKMNP-TV-Z]{25}$")


def decode_ms(ulid: str) -> int:
    value = 0
    for char in ulid[:10]:
        value = value * 32 + CROCKFORD.index(char)
    return value


def test_turn_id_is_t_and_a_26_character_crockford_ulid() -> None:
    turn_id = new_turn_id()
    assert turn_id.startswith("t_")
    assert ULID.match(turn_id[2:]), turn_id


def test_ulid_encodes_the_clock_in_its_first_ten_characters() -> None:
    ids = UlidGenerator(clock_ms=lambda: 1_700_000_000_123)
    assert decode_ms(ids()) == 1_700_000_000_123


def test_ids_minted_within_one_millisecond_sort_in_mint_order() -> None:
    ids = UlidGenerator(clock_ms=lambda: 1_700_000_000_000)
    minted = [ids() for _ in range(1000)]
    assert sorted(minted) == minted
    assert len(set(minted)) == len(minted)


def test_ids_stay_ordered_when_the_clock_steps_back() -> None:
    clock = iter([5_000, 5_001, 4_000, 4_000, 5_002])
    ids = UlidGenerator(clock_ms=lambda: next(clock))
    minted = [ids() for _ in range(5)]
    assert sorted(minted) == minted
    assert decode_ms(minted[2]) == 5_001  # held at the last timestamp while the clock is behind
    assert decode_ms(minted[4]) == 5_002


def test_a_full_random_part_moves_to_the_next_millisecond() -> None:
    ids = UlidGenerator(clock_ms=lambda: 7_000, random80=lambda: (1 << 80) - 1)
    first, second = ids(), ids()
    assert second > first
    assert decode_ms(second) == 7_001


def test_ids_minted_by_many_threads_at_once_are_unique() -> None:
    ids = UlidGenerator()
    minted: list[str] = []
    lock = threading.Lock()

    def mint() -> None:
        for _ in range(500):
            value = ids()
            with lock:
                minted.append(value)

    threads = [threading.Thread(target=mint) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(minted)) == 4000


def test_module_level_ids_sort_in_creation_order() -> None:
    minted = [new_turn_id() for _ in range(2000)]
    assert sorted(minted) == minted


def test_forked_children_never_mint_the_same_id_as_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a producer process that minted an id, and a clock that stays in that millisecond
    monkeypatch.setattr(_ulid.ulid, "_clock_ms", lambda: 1_700_000_000_000)
    new_turn_id()
    # When two children forked from it each mint one (a prefork web server's workers, say)
    minted = in_forked_children(new_turn_id)
    # Then their ids differ (each drew a random part of its own, not its parent's plus one)
    assert len(minted) == 2 and all(m.startswith("t_") for m in minted)
    assert minted[0] != minted[1]
