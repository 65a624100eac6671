"""The pipelined sink packs its commands itself (hiredis), not through redis-py's per-argument encoder: the bytes on
the wire must be the ones redis-py would have sent, and what hiredis cannot pack must still fail redis-py's way."""

from __future__ import annotations

import pytest
import redis

from june_worker.events import _wire


@pytest.fixture
def conn() -> redis.Connection:
    return redis.Redis(host="127.0.0.1").connection_pool.make_connection()  # packing opens no socket


def test_the_sinks_commands_are_packed_byte_for_byte_as_redis_py_packs_them(conn: redis.Connection) -> None:
    assert _wire._hiredis_pack is not None, "hiredis is a dependency of the worker (redis[hiredis])"
    big = '{"text":"' + "é✓" * 5000 + '"}'  # past redis-py's buffer cutoff: it splits its output, hiredis does not
    commands = [
        (
            "EVALSHA",
            "a" * 40,
            2,
            "june:events:{a:s}",
            "june:events:{a:s}:seq",
            "",
            "0",
            "10000",
            "~",
            "",
            "",
            1,
            "x",
            big,
        ),
        ("XADD", "june:events:{a:s}", "MAXLEN", "~", 10_000, "*", "type", "message.delta", "data", "{}"),
        ("XTRIM", "june:events:{a:s}", "MINID", "~", "1700000000000-0"),
    ]
    ours = _wire._pack(conn, commands)
    assert len(ours) == 1
    assert ours[0] == b"".join(conn.pack_commands(commands))


def test_an_argument_hiredis_cannot_pack_is_refused_as_redis_py_refuses_it(conn: redis.Connection) -> None:
    with pytest.raises(redis.DataError, match="bool"):
        _wire._pack(conn, [("SET", "k", True)])
