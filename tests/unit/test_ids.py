"""S54 / B166: turn ids (``t_`` + a 26-character Crockford ULID) sort in the order one process minted them.

One generator mints them all (``june_wire.ids``): the engine's and the producers' ``new_turn_id`` are it.
"""

from __future__ import annotations

import re
import threading

import pytest

from june_wire import ids
from june_wire.ids import CROCKFORD, MonotonicUlid, new_turn_id
from tests._fork import in_forked_children

ULID = re.compile(r"^[0-7][0-9A-HJKMNP-TV-Z]{25}$")


def decode(chars: str) -> int:
    value = 0
    for char in chars:
        value = value * 32 + CROCKFORD.index(char)
    return value


def millis(ulid: str) -> int:
    return decode(ulid.removeprefix("t_")[:10])


def test_turn_id_is_t_and_a_26_character_crockford_ulid() -> None:
    turn_id = new_turn_id()
    assert turn_id.startswith("t_")
    assert ULID.match(turn_id[2:]), turn_id


def test_ulid_encodes_the_clock_in_its_first_ten_characters() -> None:
    mint = MonotonicUlid(clock_ms=lambda: 1_700_000_000_123)
    assert millis(mint()) == 1_700_000_000_123


def test_s54_ids_minted_one_after_another_sort_in_mint_order() -> None:
    minted = [new_turn_id() for _ in range(2000)]  # most fall in a few milliseconds
    assert sorted(minted) == minted and len(set(minted)) == len(minted)


def test_ids_minted_within_one_millisecond_sort_in_mint_order() -> None:
    mint = MonotonicUlid(clock_ms=lambda: 1_700_000_000_000)
    minted = [mint() for _ in range(1000)]
    assert sorted(minted) == minted
    assert len(set(minted)) == len(minted)


def test_ids_of_one_millisecond_count_up_from_its_first_random_part() -> None:
    mint = MonotonicUlid(clock_ms=lambda: 1_700_000_000_000, random80=lambda: 41)
    first, second = mint(), mint()
    assert millis(first) == millis(second) == 1_700_000_000_000
    assert second > first and (decode(first[10:]), decode(second[10:])) == (41, 42)


def test_ids_stay_ordered_while_the_clock_is_behind_the_last_id() -> None:
    clock = iter([5_000, 5_001, 4_000, 4_000, 5_002])
    mint = MonotonicUlid(clock_ms=lambda: next(clock))
    minted = [mint() for _ in range(5)]
    assert sorted(minted) == minted
    assert [millis(u) for u in minted] == [5_000, 5_001, 5_001, 5_001, 5_002]  # held at the last timestamp


def test_a_full_random_part_carries_into_the_next_millisecond() -> None:
    mint = MonotonicUlid(clock_ms=lambda: 7_000, random80=lambda: (1 << 80) - 1)
    first, second = mint(), mint()
    assert second > first and millis(second) == 7_001


def test_a_clock_past_a_ulids_48_bit_timestamp_is_refused_naming_it() -> None:
    mint = MonotonicUlid(clock_ms=lambda: 1 << 48)
    with pytest.raises(ValueError, match="48-bit timestamp"):
        mint()


def test_ids_minted_by_many_threads_at_once_are_unique() -> None:
    mint = MonotonicUlid()
    minted: list[str] = []
    lock = threading.Lock()

    def run() -> None:
        for _ in range(500):
            value = mint()
            with lock:
                minted.append(value)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(minted)) == 4000


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
    monkeypatch.setattr(ids.ulid, "_clock_ms", lambda: 1_700_000_000_000)
    new_turn_id()
    # When two children forked from it each mint one (two prefork pool processes, a web server's workers)
    minted = in_forked_children(new_turn_id)
    # Then their ids differ (each drew a random part of its own, not its parent's plus one)
    assert len(minted) == 2 and all(m.startswith("t_") for m in minted)
    assert minted[0] != minted[1]


def test_a_session_id_ending_in_a_line_break_is_refused_by_the_runtime_naming_it() -> None:
    # Given a runtime (the worker refuses such a session id in a message: its rule is matched whole)
    from june_worker import Agent, Runtime
    from june_worker.models import ScriptedModel
    from june_worker.stores import MemoryStore

    runtime = Runtime([Agent(name="ops", model=ScriptedModel([]))], MemoryStore())
    # When a session is asked for with an id that is printable ASCII but for a trailing line break
    # Then it is refused, naming it, as one with a space is
    with pytest.raises(ValueError, match=r"invalid session key 's1\\n'"):
        runtime.session("ops", "s1\n")
    with pytest.raises(ValueError, match="invalid session key 's 1'"):
        runtime.session("ops", "s 1")
