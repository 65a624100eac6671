"""What one step costs on each SQL store, next to the cheapest durable write the database can do.

Run: ``.venv/bin/python bench/step_overhead.py [--steps N] [--rounds R]``. Postgres comes from
``JUNE_DATABASE_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``); the bench makes
its own database there (``june_bench_<random>``) and drops it at the end. SQLite uses a file in
a temp dir, removed at the end.

A step is timed through the engine, with the crash hook as a probe (it is called at
``after-model-commit`` and ``after-tool-commit``): a **tool step** is an ``after-tool-commit``
minus the ``after-model-commit`` before it; a **model step** is an ``after-model-commit`` minus
the ``after-tool-commit`` before it. The model is a :class:`ScriptedModel` whose script looks
at the last message only (O(1)); the tool is a trivial sync tool that writes nothing.

The yardstick, **bare**, is a one-row INSERT in autocommit (one round trip, one commit) on the
same database over the same kind of connection (Postgres: a connection of the store's pool;
SQLite: the store's own connection), measured in the same run, interleaved with the steps so
that load on the machine hits both alike. Each figure is printed for a session whose
transcript already holds 10 and 1,000 messages, with the bytes each step stored: if a step
copied the history, the 1,000-message figures would show it.

``--against REV`` is the regression guard: it checks REV out in a temporary ``git worktree``, starts
two bench processes on Postgres, one importing this checkout's ``june_worker`` and one REV's (the
measuring code is this file in both), and alternates them round by round (the order swapped every
round), so that load drifting on the machine hits both sides alike. It prints, per side, the median
over rounds of each round's step median (with the rounds' range), the bytes stored per step, and the
ratio this / REV; the worktree is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg

from june_worker.engine import Agent, Runtime, tool
from june_worker.engine.model import ModelRequest
from june_worker.engine.store import Commit, SessionRef, SessionStore
from june_worker.engine.types import AssistantMessage, Message, ToolMessage, UserMessage
from june_worker.models.scripted import Reply, ScriptedModel
from june_worker.stores import PostgresStore, SQLiteStore

if TYPE_CHECKING:  # (not at run time: --against runs this file on an older june_worker too)
    from june_worker.engine.session import AgentSession

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
HISTORIES = (10, 1000)


# --- the agent: O(1) model, trivial sync tool -----------------------------------------------------------


@tool
def tick(n: int) -> dict[str, int]:
    """Count one up."""
    return {"n": n + 1}


def make_script(steps: int) -> Callable[[ModelRequest], Reply]:
    def script(request: ModelRequest) -> Reply:
        last = request.messages[-1]
        n = last.result["n"] if isinstance(last, ToolMessage) and isinstance(last.result, dict) else 0
        if n >= steps:
            return Reply(text="done")
        return Reply(calls=[{"id": f"c{n}", "name": "tick", "input": {"n": n}}])

    return script


# --- measuring ------------------------------------------------------------------------------------------


@dataclass
class Probe:
    """The crash hook, used as a stopwatch: records when each step's commit returned."""

    marks: list[tuple[str, float]] = field(default_factory=list)

    def __call__(self, point: str, step: str) -> None:
        if point in ("after-model-commit", "after-tool-commit"):
            self.marks.append((point, time.perf_counter()))

    def steps(self) -> tuple[list[float], list[float]]:
        tool_s: list[float] = []
        model_s: list[float] = []
        for (prev, t0), (point, t1) in zip(self.marks, self.marks[1:], strict=False):
            if point == "after-tool-commit" and prev == "after-model-commit":
                tool_s.append(t1 - t0)
            elif point == "after-model-commit" and prev == "after-tool-commit":
                model_s.append(t1 - t0)
        self.marks.clear()
        return tool_s, model_s


def summary(xs: list[float]) -> tuple[float, float]:
    """(median, p99) in milliseconds."""
    s = sorted(xs)
    return statistics.median(s) * 1000, s[min(len(s) - 1, int(len(s) * 0.99))] * 1000


class Backend:
    name: str
    store: SessionStore

    def bare(self, n: int) -> list[float]:
        raise NotImplementedError

    def stored_bytes(self, ref: SessionRef) -> int:
        """Bytes of the session's rows (messages, steps, events), as stored."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SQLiteBackend(Backend):
    name = "sqlite"

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="june-bench-")
        self.store = self._sqlite = SQLiteStore(Path(self._dir) / "bench.db")
        self._conn: sqlite3.Connection = self._sqlite._conn  # the store's own connection
        self._conn.execute("create table bench_bare (id integer primary key, v text)")

    def bare(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self._conn.execute("insert into bench_bare (v) values (?)", ("x",))
            out.append(time.perf_counter() - t0)
        return out

    def stored_bytes(self, ref: SessionRef) -> int:
        total = 0
        for table, col in (("june_messages", "body"), ("june_steps", "data"), ("june_events", "body")):
            (b,) = self._conn.execute(
                f"select coalesce(sum(length(cast({col} as blob)) + length(turn_id)), 0) from {table} "
                "where agent = ? and session = ?",
                (ref.agent, ref.session),
            ).fetchone()
            total += b
        return int(total)

    def close(self) -> None:
        self._sqlite.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class PostgresBackend(Backend):
    name = "postgres"

    def __init__(self, url: str) -> None:
        self._admin_url = url
        self._db = f"june_bench_{secrets.token_hex(4)}"
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f'create database "{self._db}"')
        self.url = psycopg.conninfo.make_conninfo(url, dbname=self._db)
        self.store = self._pg = PostgresStore(self.url, min_size=1, max_size=1)
        with self._pg.pool.connection() as conn:
            conn.execute("create table bench_bare (id bigserial primary key, v text)")

    def bare(self, n: int) -> list[float]:
        out = []
        with self._pg.pool.connection() as conn:  # the store's only connection: the same backend process
            for _ in range(n):
                t0 = time.perf_counter()
                conn.execute("insert into bench_bare (v) values (%s)", ("x",))
                out.append(time.perf_counter() - t0)
        return out

    def stored_bytes(self, ref: SessionRef) -> int:
        with self._pg.pool.connection() as conn:
            row = conn.execute(
                """
                select (select coalesce(sum(pg_column_size(m.*)), 0) from june_messages m
                         where agent = %(a)s and session = %(s)s)
                     + (select coalesce(sum(pg_column_size(st.*)), 0) from june_steps st
                         where agent = %(a)s and session = %(s)s)
                     + (select coalesce(sum(pg_column_size(e.*)), 0) from june_events e
                         where agent = %(a)s and session = %(s)s)
                """,
                {"a": ref.agent, "s": ref.session},
            ).fetchone()
        assert row is not None
        return int(row[0])

    def relation_bytes(self) -> int:
        with self._pg.pool.connection() as conn:
            row = conn.execute(
                "select sum(pg_total_relation_size(c.oid)) from pg_class c "
                "where c.relname in ('june_messages', 'june_steps', 'june_events', 'june_sessions', 'june_turns')"
            ).fetchone()
        assert row is not None
        return int(row[0])

    def close(self) -> None:
        self._pg.close()
        with psycopg.connect(self._admin_url, autocommit=True) as admin:
            admin.execute(f'drop database if exists "{self._db}" with (force)')


def preload(store: SessionStore, ref: SessionRef, messages: int) -> None:
    """A transcript of ``messages`` finished user/assistant exchanges, written in a few big commits."""
    history: list[Message] = []
    for i in range(messages // 2):
        turn = f"t_hist{i:05d}"
        history += [
            UserMessage(turn_id=turn, text=f"question {i}: " + "lorem ipsum " * 8),
            AssistantMessage(turn_id=turn, text=f"answer {i}: " + "dolor sit amet " * 12),
        ]
    for start in range(0, len(history), 200):
        batch = history[start : start + 200]
        store.commit(ref, Commit(messages=[(start + j, m) for j, m in enumerate(batch)]))


@dataclass
class Result:
    backend: str
    history: int
    tool: list[float]
    model: list[float]
    bare: list[float]
    bytes_per_step: float
    relation_bytes_per_step: float | None
    rounds: list[tuple[float, float, float]] = field(default_factory=list)
    """Per round: (tool median, model median, bare median), for ratios that load drift cannot skew."""

    def ratio(self, kind: str) -> float:
        """The median over rounds of step median / bare median in the same round."""
        col = 0 if kind == "tool" else 1
        return statistics.median(r[col] / r[2] for r in self.rounds)


async def warmed_sessions(
    backend: Backend, steps: int, *, warm_turns: int
) -> tuple[Probe, Runtime, dict[int, AgentSession]]:
    """A session per history on ``backend``, its history preloaded, each warmed up by ``warm_turns`` turns (the first
    statements on a connection: prepare, caches); the probe's steps so far dropped."""
    probe = Probe()
    agent = Agent(name="bench", model=ScriptedModel(make_script(steps)), tools=[tick])
    runtime = Runtime(agents=[agent], store=backend.store, crash=probe)
    sessions = {}
    for history in HISTORIES:
        session_id = f"h{history}-{secrets.token_hex(3)}"
        preload(backend.store, SessionRef("bench", session_id), history)
        sessions[history] = runtime.session("bench", session_id)
        for _ in range(warm_turns):
            await sessions[history].turn("warm up")
        probe.steps()
    return probe, runtime, sessions


async def run_backend(backend: Backend, steps: int, rounds: int) -> list[Result]:
    """Both histories on one backend, their turns interleaved so that drift in load hits both alike."""
    probe, runtime, sessions = await warmed_sessions(backend, steps, warm_turns=1)
    got = {h: Result(backend.name, h, [], [], [], 0.0, None) for h in HISTORIES}
    size0 = {h: backend.stored_bytes(s.ref) for h, s in sessions.items()}
    rel = {h: 0 for h in HISTORIES}
    for _ in range(rounds):
        for history, session in sessions.items():
            r = got[history]
            bare = backend.bare(steps)
            rel0 = backend.relation_bytes() if isinstance(backend, PostgresBackend) else 0
            await session.turn("go")
            if isinstance(backend, PostgresBackend):
                rel[history] += backend.relation_bytes() - rel0
            t, m = probe.steps()
            r.tool += t
            r.model += m
            r.bare += bare
            r.rounds.append((statistics.median(t), statistics.median(m), statistics.median(bare)))
    for history, session in sessions.items():
        r = got[history]
        n = len(r.tool) + len(r.model)
        r.bytes_per_step = (backend.stored_bytes(session.ref) - size0[history]) / n
        if isinstance(backend, PostgresBackend):
            r.relation_bytes_per_step = rel[history] / n
    await runtime.aclose()
    return list(got.values())


@contextmanager
def backends(url: str) -> Iterator[list[Backend]]:
    made: list[Backend] = []
    try:
        made.append(SQLiteBackend())
        made.append(PostgresBackend(url))
        yield made
    finally:
        for b in made:
            b.close()


def report(results: list[Result]) -> None:
    print(
        f"{'store':9} {'history':>7}  {'step':5} {'median ms':>9} {'p99 ms':>8} "
        f"{'bare med':>8} {'bare p99':>8} {'ratio':>6} {'bytes/step':>10}"
    )
    for r in results:
        bare_med, bare_p99 = summary(r.bare)
        for kind, xs in (("tool", r.tool), ("model", r.model)):
            med, p99 = summary(xs)
            print(
                f"{r.backend:9} {r.history:>7}  {kind:5} {med:9.3f} {p99:8.3f} "
                f"{bare_med:8.3f} {bare_p99:8.3f} {r.ratio(kind):6.2f} {r.bytes_per_step:10.0f}"
            )
    print("(ratio: median over rounds of the step median / the bare median measured in the same round)")
    print()
    for name in sorted({r.backend for r in results}):
        by_history = {r.history: r for r in results if r.backend == name}
        small, large = by_history[min(HISTORIES)], by_history[max(HISTORIES)]
        for kind in ("tool", "model"):
            change = 100 * (large.ratio(kind) - small.ratio(kind)) / small.ratio(kind)
            print(f"{name:9} {kind:5} step at {max(HISTORIES)} vs {min(HISTORIES)} messages (by ratio): {change:+.1f}%")
        rel = [r.relation_bytes_per_step for r in by_history.values() if r.relation_bytes_per_step is not None]
        if rel:
            print(
                f"{name:9} tables+indexes grew per step (pg_total_relation_size): "
                + ", ".join(f"{x:.0f} B" for x in rel)
            )


# --- the regression guard: this checkout against an older one, alternating -------------------------------


async def serve(url: str, steps: int) -> None:
    """One side of ``--against``: Postgres sessions warmed up, then a round per ``round`` line on stdin.

    Each reply is one JSON line on stdout. Runs the same code whichever ``june_worker`` it imports.
    """
    backend = PostgresBackend(url)
    try:
        probe, runtime, sessions = await warmed_sessions(backend, steps, warm_turns=2)
        size0 = {h: backend.stored_bytes(s.ref) for h, s in sessions.items()}
        n_steps = dict.fromkeys(HISTORIES, 0)
        loop = asyncio.get_running_loop()
        print(json.dumps({"ready": True}), flush=True)
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if line == "round":
                out: dict[str, object] = {}
                for history, session in sessions.items():
                    bare = backend.bare(steps)
                    await session.turn("go")
                    t, m = probe.steps()
                    n_steps[history] += len(t) + len(m)
                    out[str(history)] = {
                        "tool": statistics.median(t),
                        "model": statistics.median(m),
                        "bare": statistics.median(bare),
                    }
                print(json.dumps(out), flush=True)
            elif line == "bytes":
                per = {
                    str(h): (backend.stored_bytes(s.ref) - size0[h]) / max(1, n_steps[h]) for h, s in sessions.items()
                }
                print(json.dumps(per), flush=True)
            else:
                break
        await runtime.aclose()
    finally:
        backend.close()


class Side:
    """A ``--serve`` process importing ``june_worker`` from ``tree``."""

    def __init__(self, label: str, tree: Path, url: str, steps: int) -> None:
        self.label = label
        env = dict(os.environ, PYTHONPATH=str(tree), JUNE_DATABASE_URL=url)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", "--steps", str(steps)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ask_ready()
        self.rounds: list[dict[str, dict[str, float]]] = []

    def _read(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.label} bench process ended (exit {self.proc.wait()})")
            if line.startswith("{"):  # anything else a library printed is not a reply
                reply: dict[str, object] = json.loads(line)
                return reply

    def ask_ready(self) -> None:
        self._read()

    def ask(self, command: str) -> dict[str, object]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def worktree_at(rev: str) -> Iterator[Path]:
    """REV checked out (detached) in a temporary git worktree, removed on exit."""
    repo = Path(__file__).resolve().parent.parent
    base = Path(tempfile.mkdtemp(prefix="june-against-"))
    tree = base / "tree"
    subprocess.run(
        ["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), rev], check=True, capture_output=True
    )
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], capture_output=True)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def against(rev: str, url: str, steps: int, rounds: int) -> None:
    repo = Path(__file__).resolve().parent.parent
    sha = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    here = f"this ({head}{'+changes' if dirty else ''})"
    print(f"# against {rev} ({sha}): {rounds} rounds, each side one turn of {steps} tool round trips per history")
    with worktree_at(rev) as tree:
        sides: list[Side] = []
        try:
            sides.append(Side(here, repo, url, steps))
            sides.append(Side(sha, tree, url, steps))
            for i in range(rounds):
                for side in sides if i % 2 == 0 else sides[::-1]:
                    side.rounds.append(side.ask("round"))  # type: ignore[arg-type]
            stored = [side.ask("bytes") for side in sides]
        finally:
            for side in sides:
                side.close()
    report_against(sides, stored)


def report_against(sides: list[Side], stored: list[dict[str, object]]) -> None:
    this, rev = sides
    print(
        f"{'history':>7}  {'step':5} {'side':22} {'median ms':>9} {'rounds, min-max':>15} {'ratio to bare':>13} "
        f"{'bytes/step':>10}"
    )
    for history in (str(h) for h in HISTORIES):
        for kind in ("tool", "model"):
            meds = {}
            for side, got in zip(sides, stored, strict=True):
                xs = [r[history][kind] * 1000 for r in side.rounds]
                to_bare = statistics.median(r[history][kind] / r[history]["bare"] for r in side.rounds)
                meds[side.label] = statistics.median(xs)
                print(
                    f"{history:>7}  {kind:5} {side.label:22} {meds[side.label]:9.3f} {min(xs):7.3f}-{max(xs):7.3f} "
                    f"{to_bare:13.2f} {float(got[history]):10.0f}"  # type: ignore[arg-type]
                )
            pairs = [a[history][kind] / b[history][kind] for a, b in zip(this.rounds, rev.rounds, strict=True)]
            print(
                f"{history:>7}  {kind:5} {'ratio this / ' + rev.label:22} {meds[this.label] / meds[rev.label]:9.3f} "
                f"{min(pairs):7.3f}-{max(pairs):7.3f}   (per round: {statistics.median(pairs):.3f})"
            )
    bare = {s.label: statistics.median(r[h]["bare"] * 1000 for r in s.rounds for h in r) for s in sides}
    print("bare one-row commit, median of rounds (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in bare.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="tool round trips per turn")
    parser.add_argument("--rounds", type=int, default=15, help="turns per configuration")
    parser.add_argument("--against", metavar="REV", help="alternate with REV (a git worktree) on Postgres")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    url = os.environ.get("JUNE_DATABASE_URL", DEFAULT_URL)
    if args.serve:
        asyncio.run(serve(url, args.steps))
        return
    if args.against:
        against(args.against, url, args.steps, args.rounds)
        return
    print(
        f"# step_overhead  {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {os.cpu_count()} cores  "
        f"python {platform.python_version()}  {args.rounds} turns x {args.steps} tool round trips per config"
    )
    results: list[Result] = []
    with backends(url) as made:
        for backend in made:
            if isinstance(backend, PostgresBackend):
                with psycopg.connect(backend.url) as c:
                    settings = c.execute(
                        "select version(), current_setting('fsync'), current_setting('synchronous_commit')"
                    ).fetchone()
                assert settings is not None
                print(
                    f"# postgres: {settings[0].split(' on ')[0]}, fsync={settings[1]}, synchronous_commit={settings[2]}"
                )
            results += asyncio.run(run_backend(backend, args.steps, args.rounds))
    report(results)


if __name__ == "__main__":
    main()
