"""S54 / B166: turn ids the engine mints (``t_`` + ULID) sort in the order they were minted."""

from __future__ import annotations

import threading

import pytest

from june_worker.engine import ids
from june_worker.engine.ids import MonotonicUlid, new_turn_id
from tests._fork import in_forked_children

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def decode(chars: str) -> int:
    value = 0
    for char in chars:
        value = value * 32 + _CROCKFORD.index(char)
    return value


def millis(ulid: str) -> int:
    return decode(ulid.removeprefix("t_")[:10])


def test_s54_ids_minted_one_after_another_sort_in_mint_order() -> None:
    minted = [new_turn_id() for _ in range(1000)]  # most fall in a few milliseconds
    assert sorted(minted) == minted and len(set(minted)) == len(minted)


def test_ids_of_one_millisecond_count_up_from_its_first_random_part() -> None:
    ids = MonotonicUlid(clock_ms=lambda: 1_700_000_000_000, random80=lambda: 41)
    first, second = ids(), ids()
    assert millis(first) == millis(second) == 1_700_000_000_000
    assert second > first and (decode(first[10:]), decode(second[10:])) == (41, 42)


def test_ids_stay_ordered_while_the_clock_is_behind_the_last_id() -> None:
    clock = iter([5_000, 5_001, 4_000, 4_000, 5_002])
    ids = MonotonicUlid(clock_ms=lambda: next(clock))
    minted = [ids() for _ in range(5)]
    assert sorted(minted) == minted
    assert [millis(u) for u in minted] == [5_000, 5_001, 5_001, 5_001, 5_002]


def test_a_full_random_part_carries_into_the_next_millisecond() -> None:
    ids = MonotonicUlid(clock_ms=lambda: 7_000, random80=lambda: (1 << 80) - 1)
    first, second = ids(), ids()
    assert second > first and millis(second) == 7_001


def test_ids_minted_by_many_threads_are_unique_and_each_threads_own_sort_in_order() -> None:
    per_thread: list[list[str]] = [[] for _ in range(8)]

    def mint(out: list[str]) -> None:
        out.extend(new_turn_id() for _ in range(500))

    threads = [threading.Thread(target=mint, args=(out,)) for out in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({i for out in per_thread for i in out}) == 4000
    assert all(sorted(out) == out for out in per_thread)


def test_forked_children_never_mint_the_same_id_as_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a process that minted an id, and a clock that stays in that millisecond
    monkeypatch.setattr(ids._mint, "_clock_ms", lambda: 1_700_000_000_000)
    new_turn_id()
    # When two children forked from it each mint one (as two prefork pool processes would)
    minted = in_forked_children(new_turn_id)
    # Then their ids differ (each drew a random part of its own, not its parent's plus one)
    assert len(minted) == 2 and all(m.startswith("t_") for m in minted)
    assert minted[0] != minted[1]
