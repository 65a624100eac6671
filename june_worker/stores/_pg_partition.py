"""Hash-partitioning june's per-session tables by ``(agent, session)``: the conversion, and what it keeps.

``june migrate --partitions N`` (:meth:`~.postgres.PostgresStore.partition`) turns each table keyed
by a session (:data:`SESSION_TABLES`) into a table ``PARTITION BY HASH (agent, session)`` with
``N`` partitions ``<table>_p<i>``: every row of one session lives in one partition of each table,
and a statement that names the session (``where agent = ... and session = ...``, as every
per-turn statement does) touches that partition alone. A deployment can then move partitions
(tablespaces, ``ALTER TABLE ... DETACH PARTITION``), or hand the same key to a sharding extension
(Citus distributes by ``session``; see docs/scaling.md).

How: in one transaction, under ``ACCESS EXCLUSIVE`` locks on every table it converts (workers
wait, and go on once it commits; nothing is lost or half-converted), each table is renamed aside,
re-created from its **live** definition (``LIKE ... INCLUDING ALL``: whatever columns, defaults,
checks and indexes migrations gave it, before or after this one), partitioned, filled with the
old rows, and the old table dropped; the functions and views that depend on a converted table's
row type are dropped first and re-created from their own live definitions afterwards; constraint
and index names are restored, so errors name ``june_messages_pkey`` as before; each partition
gets its table's storage parameters (``fillfactor``); triggers, owners and granted privileges of the
tables, views and functions are carried over. Foreign keys that
point at a converted table (``june_channel_renders`` -> ``june_turns``), or out of one, are dropped
first and made again from their definitions once the tables are in place (Postgres accepts a key
that references a partitioned table's primary key). Not carried over: row-level security policies
and publications.

The rule a reader must not break: **every unique index of a per-session table starts with
``(agent, session)``**: Postgres refuses a unique index of a partitioned table that leaves out
the partition key. A migration that adds a unique index must include both columns.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

__all__ = ["SESSION_TABLES", "partition_count", "partition_tables"]

SESSION_TABLES = (
    "june_sessions",
    "june_turns",
    "june_messages",
    "june_steps",
    "june_events",
    "june_archived_messages",
    "june_archived_steps",
)
"""The tables keyed by a session: each one's primary key starts with ``(agent, session)``."""

MAX_PARTITIONS = 1024

_PARTITIONS = """
select c.relname, p.partstrat, (select count(*) from pg_inherits i where i.inhparent = c.oid)
  from pg_class c left join pg_partitioned_table p on p.partrelid = c.oid
 where c.relnamespace = current_schema()::regnamespace and c.relname = any(%s)
"""

# Functions and views that depend on a table's row type (june_enqueue_turn returns a june_turns row) or
# on the table itself (a view): dropped before the table is replaced, made again from their definitions.
_DEPENDENTS = """
select distinct 'function' as kind, p.oid::regprocedure::text as name, pg_get_functiondef(p.oid) as definition,
       p.proacl::text[] as acl, p.proowner::regrole::text as owner
  from pg_depend d
  join pg_type t on d.refclassid = 'pg_type'::regclass and d.refobjid = t.oid
  join pg_proc p on d.classid = 'pg_proc'::regclass and d.objid = p.oid
 where t.typrelid = any(%(oids)s)
union
select distinct 'view', v.oid::regclass::text, pg_get_viewdef(v.oid), v.relacl::text[], v.relowner::regrole::text
  from pg_depend d
  join pg_rewrite r on d.classid = 'pg_rewrite'::regclass and d.objid = r.oid
  join pg_class v on v.oid = r.ev_class and v.relkind in ('v', 'm')
 where d.refclassid = 'pg_class'::regclass and d.refobjid = any(%(oids)s) and v.oid <> all(%(oids)s)
"""

# Foreign keys into or out of the tables being converted: ``LIKE`` does not copy them, and a referenced table cannot
# be dropped while they stand.
_FOREIGN_KEYS = """
select conrelid::regclass::text, conname, pg_get_constraintdef(oid)
  from pg_constraint
 where contype = 'f' and (confrelid = any(%(oids)s) or conrelid = any(%(oids)s))
"""

# The names of a table's indexes (and the constraints they back), in a stable order, to give the new ones the old names.
_INDEXES = """
select i.relname, coalesce(c.conname, ''), pg_get_indexdef(i.oid)
  from pg_index x
  join pg_class i on i.oid = x.indexrelid
  left join pg_constraint c on c.conindid = i.oid and c.conrelid = x.indrelid
 where x.indrelid = %s::regclass
"""


# A table's own triggers (not the ones Postgres makes for foreign keys), as CREATE TRIGGER statements.
_TRIGGERS = "select pg_get_triggerdef(oid) from pg_trigger where tgrelid = %s::regclass and not tgisinternal"


def partition_count(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """How many hash partitions each per-session table has (0: not partitioned)."""
    rows = conn.execute(_PARTITIONS, (list(SESSION_TABLES),)).fetchall()
    return {name: (int(n) if strategy == "h" else 0) for name, strategy, n in rows}


def partition_tables(conn: psycopg.Connection[Any], partitions: int) -> bool:
    """Convert every per-session table to ``partitions`` hash partitions, in one transaction; False when they all
    have that many already. Raises ValueError when ``partitions`` is out of range or the tables are partitioned
    another way (re-partitioning is not done here: it would rewrite every row again; see docs/scaling.md)."""
    if not 2 <= partitions <= MAX_PARTITIONS:
        raise ValueError(f"partitions must be between 2 and {MAX_PARTITIONS}, not {partitions}")
    with conn.transaction():
        current = partition_count(conn)
        missing = [t for t in SESSION_TABLES if t not in current]
        if missing:
            raise ValueError(f"the schema is not migrated: no table {', '.join(missing)}")
        if all(n == partitions for n in current.values()):
            return False
        if any(n not in (0, partitions) for n in current.values()):
            raise ValueError(
                f"the per-session tables are partitioned already ({current}); converting them to {partitions} "
                "partitions is not supported here"
            )
        todo = [t for t in SESSION_TABLES if current[t] == 0]
        conn.execute(
            sql.SQL("lock table {} in access exclusive mode").format(sql.SQL(", ").join(map(sql.Identifier, todo)))
        )
        oids = [conn.execute("select %s::regclass::oid", (t,)).fetchone()[0] for t in todo]  # type: ignore[index]
        dependents = conn.execute(_DEPENDENTS, {"oids": oids}).fetchall()
        foreign_keys = conn.execute(_FOREIGN_KEYS, {"oids": oids}).fetchall()
        for owner_table, name, _ in foreign_keys:
            conn.execute(
                sql.SQL("alter table {} drop constraint {}").format(sql.SQL(owner_table), sql.Identifier(name))
            )
        for kind, name, *_ in dependents:
            conn.execute(sql.SQL("drop {} {}").format(sql.SQL(kind), sql.SQL(name)))  # a regprocedure / regclass text
        for table in todo:
            _convert(conn, table, partitions)
        for kind, name, definition, acl, owner in dependents:
            if kind == "function":
                conn.execute(definition)
            else:
                conn.execute(sql.SQL("create view {} as {}").format(sql.SQL(name), sql.SQL(definition)))
            _restore_access(conn, kind, sql.SQL(name), acl, owner)
        for owner_table, name, definition in foreign_keys:  # a regclass text, as the table is named now
            conn.execute(
                sql.SQL("alter table {} add constraint {} {}").format(
                    sql.SQL(owner_table), sql.Identifier(name), sql.SQL(definition)
                )
            )
    return True


def _convert(conn: psycopg.Connection[Any], table: str, partitions: int) -> None:
    old = f"{table}__unpartitioned"
    names = conn.execute(_INDEXES, (table,)).fetchall()
    found = conn.execute(
        "select reloptions, relacl::text[], relowner::regrole::text from pg_class where oid = %s::regclass", (table,)
    ).fetchone()
    assert found is not None
    reloptions, acl, owner = list(found[0] or []), found[1], found[2]
    triggers = [d for (d,) in conn.execute(_TRIGGERS, (table,)).fetchall()]
    conn.execute(sql.SQL("alter table {} rename to {}").format(sql.Identifier(table), sql.Identifier(old)))
    conn.execute(
        sql.SQL("create table {} (like {} including all) partition by hash (agent, session)").format(
            sql.Identifier(table), sql.Identifier(old)
        )
    )
    storage = sql.SQL(" with ({})").format(sql.SQL(", ").join(map(sql.SQL, reloptions))) if reloptions else sql.SQL("")
    for i in range(partitions):
        conn.execute(
            sql.SQL("create table {} partition of {} for values with (modulus {}, remainder {}){}").format(
                sql.Identifier(f"{table}_p{i}"), sql.Identifier(table), sql.Literal(partitions), sql.Literal(i), storage
            )
        )
    conn.execute(sql.SQL("insert into {} select * from {}").format(sql.Identifier(table), sql.Identifier(old)))
    conn.execute(sql.SQL("drop table {}").format(sql.Identifier(old)))
    for definition in triggers:  # after the copy: the rows were written once already
        conn.execute(definition)
    _restore_access(conn, "table", sql.Identifier(table), acl, owner)
    _restore_names(conn, table, names)


def _restore_access(
    conn: psycopg.Connection[Any], kind: str, name: sql.Composable, acl: list[str] | None, owner: str
) -> None:
    """Give a re-created table, view or function the owner and the privileges its predecessor had (``acl``, as
    ``aclitem`` texts; None: the defaults, which the new one has too)."""
    conn.execute(sql.SQL("alter {} {} owner to {}").format(sql.SQL(kind), name, sql.Identifier(owner)))
    if acl is None:
        return
    on = sql.SQL("function" if kind == "function" else "table")  # GRANT ... ON TABLE names views too
    conn.execute(sql.SQL("revoke all on {} {} from public").format(on, name))
    rows = conn.execute(
        "select case when a.grantee = 0 then 'public' else a.grantee::regrole::text end, a.privilege_type, "
        "a.is_grantable from aclexplode(%s::aclitem[]) a where a.grantee = 0 or a.grantee::regrole::text <> %s",
        (acl, owner),
    ).fetchall()
    for grantee, privilege, grantable in rows:
        conn.execute(
            sql.SQL("grant {} on {} {} to {}{}").format(
                sql.SQL(privilege),
                on,
                name,
                sql.SQL("public") if grantee == "public" else sql.Identifier(grantee),
                sql.SQL(" with grant option") if grantable else sql.SQL(""),
            )
        )


def _restore_names(conn: psycopg.Connection[Any], table: str, old: list[tuple[str, str, str]]) -> None:
    """Give the new parent's indexes and constraints the names the old table's had (matched by definition)."""
    new = conn.execute(_INDEXES, (table,)).fetchall()

    def shape(definition: str, name: str) -> str:  # the index definition without its own name
        return definition.replace(f"INDEX {name} ON", "INDEX ON", 1).replace(" ONLY ", " ")

    by_shape = {shape(d, n): (n, c) for n, c, d in new}
    for name, constraint, definition in old:
        found = by_shape.get(shape(definition, name).replace(f"{table}__unpartitioned", table))
        if found is None:
            continue
        new_name, new_constraint = found
        if constraint and new_constraint and new_constraint != constraint:
            conn.execute(
                sql.SQL("alter table {} rename constraint {} to {}").format(
                    sql.Identifier(table), sql.Identifier(new_constraint), sql.Identifier(constraint)
                )
            )
        elif new_name != name:
            conn.execute(sql.SQL("alter index {} rename to {}").format(sql.Identifier(new_name), sql.Identifier(name)))
