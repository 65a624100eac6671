"""A producer's turn ids: ``t_`` + a ULID, minted by the one generator of the process (``june_wire.ids``).

How that generator orders its ids is tested in ``tests/unit/test_ids.py``; here, that a producer mints
with it: its ids and the engine's sort together in mint order.
"""

from __future__ import annotations

import re

from june_worker.engine import new_turn_id as engine_turn_id
from producers import new_turn_id

ULID = re.compile(r"^[0-7][0-9A-HJKMNP-TV-Z]{25}$")


def test_turn_id_is_t_and_a_26_character_crockford_ulid() -> None:
    turn_id = new_turn_id()
    assert turn_id.startswith("t_")
    assert ULID.match(turn_id[2:]), turn_id


def test_module_level_ids_sort_in_creation_order() -> None:
    minted = [new_turn_id() for _ in range(2000)]
    assert sorted(minted) == minted


def test_ids_a_producer_and_the_engine_mint_in_one_process_sort_in_mint_order() -> None:
    # Given a process that enqueues turns with a producer and runs others in process (the same millisecond, mostly)
    # When both mint ids, one after the other
    minted = [mint() for _ in range(1000) for mint in (new_turn_id, engine_turn_id)]
    # Then the ids sort as they were minted: one sequence, not two that interleave at random
    assert sorted(minted) == minted and len(set(minted)) == len(minted)
