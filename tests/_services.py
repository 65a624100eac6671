"""Where the tests find Postgres, Redis and RabbitMQ, and how they get them when nobody provides them.

The test command gets both services on its own, in this order, per service:

1. ``JUNE_DATABASE_URL`` / ``JUNE_REDIS_URL`` / ``JUNE_TEST_AMQP_URL``, when set and answering
   (checked with a real connection, 3 s timeout);
2. otherwise a **throwaway server** started from local binaries, when the machine has them:
   Postgres is ``initdb`` into a temp dir (as the ``postgres`` OS user via ``runuser`` when we
   run as root) and ``pg_ctl start`` on a free loopback port, fsync off (a killed server still
   keeps every commit it acknowledged: only an OS crash could lose them); Redis is
   ``redis-server --port <free> --save '' --appendonly no``; RabbitMQ is a node of its own
   started from the machine's ``rabbitmq-server`` (:mod:`tests._rabbitmq`, ~5 s alone, over 60 s on a busy
   machine). They start in parallel, in the background, as soon as collection shows a test needs them (see
   ``tests/conftest.py``);
3. otherwise the run fails with ONE line saying what to install. It never skips.

Every start of a throwaway server (shared or private) has :data:`tests._budgets.SERVER_START_S` (180 s by default)
and is **tried twice**: a start that fails or runs out of time is cleaned up (its processes stopped; its dir, with its
log, stays until the run ends) and made again from scratch, in a new dir, on fresh ports. If the second one fails too, :class:`ServiceStartFailed` says so in one
line, with the end of that attempt's log and the first attempt's reason; the tests that need the service fail with
that line and the rest of the run goes on (a missing binary still stops the run: nothing would start it).

Under ``pytest-xdist`` (``make test`` runs two processes) each process is a run of its own here: it starts its
own throwaway servers, or shares the ones the environment names (each integration module makes its own database,
queue names and key prefix, so two runs can share them); the run's end lists each process's servers, marked ``[gw0]``...

The chosen URLs are exported to ``os.environ`` (``JUNE_DATABASE_URL``, ``JUNE_REDIS_URL``,
``JUNE_TEST_AMQP_URL``) so subprocesses started by tests (Celery workers) inherit them.

A Redis Cluster is started on request only (:func:`private_redis_cluster`, the session fixture
``redis_cluster_url``): three ``redis-server --cluster-enabled yes`` nodes on free ports (client and
cluster-bus ports both chosen free), joined by ``redis-cli --cluster create``, never the machine's Redis.

A test that kills or restarts a server uses :func:`private_postgres` / :func:`private_redis` /
:func:`private_rabbitmq` (also fixtures): a separate throwaway instance on its own free port,
with ``.url``, ``.pid``, ``.stop()``, ``.start()``, ``.restart()`` and ``.kill()`` (SIGKILL). The
shared instance is never touched. Private Postgres instances are copies of one ``initdb``
template, so each costs a file copy and a start, not another ``initdb``.

The rule a reader must not break: **every server started here is stopped and its temp dir
removed**, on a normal exit (``pytest_unconfigure``), on an error (``atexit``), on SIGTERM (a
handler that cleans up, then dies as SIGTERM would), and even after a SIGKILL of the test
process: the next run reaps leftovers whose owner process is gone (by pid, after checking the
pid's working directory is the leftover's own dir). Only the process that started a server
stops it (forked children inherit the registry but not the duty).

Knobs: ``JUNE_PG_BIN`` (a directory holding ``initdb`` and ``pg_ctl``), ``JUNE_REDIS_SERVER``
(the ``redis-server`` binary), ``JUNE_RABBITMQ_SERVER`` / ``JUNE_EPMD`` (see :mod:`tests._rabbitmq`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from tests._budgets import SERVER_START_S

if TYPE_CHECKING:
    from tests._rabbitmq import RabbitMQServer

__all__ = [
    "PostgresServer",
    "RedisClusterServer",
    "RedisServer",
    "ServiceStartFailed",
    "ServiceUnavailable",
    "amqp_url",
    "describe",
    "postgres_url",
    "private_postgres",
    "private_rabbitmq",
    "private_redis",
    "private_redis_cluster",
    "redis_url",
    "shutdown",
    "start_in_background",
    "wait_for_services",
]

_PREFIX = "june-test-"
_OWNER_PID = os.getpid()
_START_TIMEOUT_S = SERVER_START_S
_ORPHAN_AGE_S = 120.0

_INSTALL_PG = (
    "install the PostgreSQL server binaries (Debian/Ubuntu: apt-get install postgresql; macOS: brew install "
    "postgresql@15) so the tests can start a throwaway server, or set JUNE_DATABASE_URL to a server that answers"
)
_INSTALL_REDIS = (
    "install redis-server (Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis) so the tests "
    "can start a throwaway server, or set JUNE_REDIS_URL to a server that answers"
)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released): a service that is down."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceUnavailable(RuntimeError):
    """No server for a service the tests need; the message is one line saying what to do."""


class ServiceStartFailed(ServiceUnavailable):
    """A throwaway server did not start (twice); the message is one line with the end of its log."""


def _one_line(lines: list[str]) -> str:
    return " | ".join(line.strip() for line in lines if line.strip())


# --- small helpers ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust kill(0)
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
        time.sleep(0.01)
    return not _alive(pid)


def _children_of(pid: int) -> list[int]:
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(stat).read_text().rpartition(")")[2].split()
            if int(fields[1]) == pid:
                out.append(int(stat.split("/")[2]))
    return out


def _cwd_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path)) or (0,)


def _find_pg_bin() -> Path | None:
    candidates: list[str] = []
    if os.environ.get("JUNE_PG_BIN"):
        candidates.append(os.environ["JUNE_PG_BIN"])
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    for pattern in (
        "/usr/lib/postgresql/*/bin",
        "/usr/pgsql-*/bin",
        "/opt/homebrew/opt/postgresql*/bin",
        "/usr/local/opt/postgresql*/bin",
    ):
        candidates.extend(sorted(glob.glob(pattern), key=_version_key, reverse=True))
    candidates.append("/usr/local/pgsql/bin")
    for c in candidates:
        d = Path(c)
        if all(os.access(d / exe, os.X_OK) for exe in ("initdb", "pg_ctl", "postgres")):
            return d
    return None


def _find_redis_server() -> str | None:
    for c in (os.environ.get("JUNE_REDIS_SERVER"), shutil.which("redis-server"), "/usr/local/bin/redis-server"):
        if c and os.access(c, os.X_OK):
            return c
    return None


def _postgres_answers(url: str) -> bool:
    try:
        import psycopg
    except ImportError:
        return False
    try:
        with psycopg.connect(url, connect_timeout=3, autocommit=True) as conn:
            conn.execute("select 1")
        return True
    except psycopg.Error:
        return False


def _redis_answers(url: str) -> bool:
    try:
        import redis
    except ImportError:
        return False
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# --- the workspace: one temp dir per test process, reaped if its owner died ---------------------------


class _Workspace:
    """``/tmp/june-test-XXXX``: the dirs of every server this process starts, and its owner's pid."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._root: Path | None = None
        self._pg_template: Path | None = None
        self._pg_template_lock = threading.Lock()
        self._counter = 0

    @property
    def root(self) -> Path:
        with self._lock:
            if self._root is None:
                _reap_leftovers()
                root = Path(tempfile.mkdtemp(prefix=_PREFIX))
                root.chmod(0o711)  # the postgres OS user must reach its data dir below
                (root / "owner").write_text(str(os.getpid()))
                self._root = root
            return self._root

    def new_dir(self, kind: str) -> Path:
        root = self.root
        with self._lock:
            self._counter += 1
            d = root / f"{kind}-{self._counter}"
        d.mkdir(mode=0o700)
        return d

    def pg_template(self, bindir: Path) -> Path:
        """An ``initdb``-ed data dir, never started: copied for every private Postgres instance."""
        with self._pg_template_lock:
            if self._pg_template is None:
                parent = self.new_dir("pg-template")
                _chown_to_postgres(parent)
                self._pg_template = _initdb(bindir, parent / "data")
            return self._pg_template

    def remove(self) -> None:
        with self._lock:
            root, self._root = self._root, None
            self._pg_template = None
        if root is not None:
            _rmtree(root)


def _rmtree(path: Path) -> None:
    """Remove ``path``; again if a server that was just stopped still dropped a file in it."""
    for _ in range(20):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.05)


def _initdb(bindir: Path, datadir: Path) -> Path:
    cmd = [
        str(bindir / "initdb"),
        "-D",
        str(datadir),
        "-U",
        "postgres",
        "--auth=trust",
        "--no-sync",
        "--encoding=UTF8",
        "--locale=C",
    ]
    try:
        done = subprocess.run(_as_postgres(cmd), capture_output=True, text=True, timeout=_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ServiceStartFailed(f"initdb ({bindir}) did not finish in {_START_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        tail = _one_line((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise ServiceStartFailed(f"initdb failed ({bindir}): {tail}")
    return datadir


def _running_as_root() -> bool:
    return os.geteuid() == 0


def _as_postgres(cmd: list[str]) -> list[str]:
    if not _running_as_root():
        return cmd
    runuser = shutil.which("runuser") or ("/usr/sbin/runuser" if os.access("/usr/sbin/runuser", os.X_OK) else None)
    if runuser is None:
        raise ServiceUnavailable(
            "running as root, Postgres must run as the 'postgres' user but there is no runuser; "
            "install util-linux or set JUNE_DATABASE_URL"
        )
    return [runuser, "-u", "postgres", "--", *cmd]


def _chown_to_postgres(path: Path) -> None:
    if not _running_as_root():
        return
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        raise ServiceUnavailable(
            "running as root but there is no 'postgres' OS user to run a throwaway Postgres as; "
            "create one (useradd --system postgres) or set JUNE_DATABASE_URL"
        ) from None
    os.chown(path, pw.pw_uid, pw.pw_gid)


def _reap_leftovers() -> None:
    """Stop servers and remove dirs left by test processes that died without cleaning up (SIGKILL)."""
    for root in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"):
        try:
            owner: int | None = int((root / "owner").read_text())
        except (OSError, ValueError):
            owner = None  # half made or half removed: leftover once it is old enough
        try:
            if owner is None and time.time() - root.stat().st_mtime < _ORPHAN_AGE_S:
                continue
        except OSError:
            continue
        if owner is not None and _alive(owner):
            continue
        for child in root.iterdir():
            for pid in _leftover_pids(child):
                if _alive(pid) and _cwd_of(pid) in (str(child), str(child / "data")):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
                    _wait_gone(pid, 5)
        _rmtree(root)


def _leftover_pids(d: Path) -> list[int]:
    pids = []
    for name in ("data/postmaster.pid", "redis.pid", "rabbitmq.pid", "beam.pid", "epmd.pid"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            pids.append(int((d / name).read_text().split()[0]))
    return pids


_workspace = _Workspace()


# --- servers ------------------------------------------------------------------------------------------


class PostgresServer:
    """A throwaway Postgres: a copy of the ``initdb`` template, run with ``pg_ctl`` on a free loopback port."""

    def __init__(self, bindir: Path, parent: Path, port: int | None = None) -> None:
        self.bindir = bindir
        self.parent = parent
        self.datadir = parent / "data"
        self.logfile = parent / "postgres.log"
        self.port = port or _free_port()
        self._started_once = False

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while it runs (from ``postmaster.pid``)."""
        try:
            pid = int((self.datadir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if _alive(pid) else None

    def _pg_ctl(self, *args: str, timeout_s: float = _START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / "pg_ctl"), "-D", str(self.datadir), *args]
        return subprocess.run(_as_postgres(cmd), capture_output=True, text=True, timeout=timeout_s + 5)

    def start(self) -> None:
        options = " ".join(
            [
                f"-p {self.port}",
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.parent}",
                # fsync off only: a killed server keeps every commit it acknowledged (the kernel
                # has the pages), which is what crash tests check; an OS crash is not a test case.
                "-c fsync=off",
                "-c max_connections=200",
                "-c shared_buffers=64MB",
                "-c log_min_messages=warning",
            ]
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            wait_s = max(1, int(deadline - time.monotonic()))
            try:
                done = self._pg_ctl(
                    "start", "-w", "-t", str(wait_s), "-s", "-l", str(self.logfile), "-o", options, timeout_s=wait_s
                )
            except subprocess.TimeoutExpired:
                said = f"pg_ctl start did not return in {wait_s} s"
            else:
                if done.returncode == 0:
                    self._started_once = True
                    return
                if not self._started_once and any("could not bind" in line for line in self._log_tail()):
                    self.port = _free_port()  # lost the race for the free port; the URL is not out yet
                    continue
                said = _one_line((done.stderr or done.stdout).strip().splitlines()[-2:])
            # After a SIGKILL the old backends may still hold shared memory for a moment.
            if time.monotonic() > deadline:
                self.kill()  # pg_ctl gave up waiting; the postmaster may still be on its way up
                raise ServiceStartFailed(
                    f"throwaway Postgres on port {self.port} did not start in {_START_TIMEOUT_S:.0f} s ({said}; "
                    f"log: {self.logfile}): {_one_line(self._log_tail())}"
                )
            time.sleep(0.1)

    def _log_tail(self) -> list[str]:
        with contextlib.suppress(OSError):
            return self.logfile.read_text(errors="replace").strip().splitlines()[-3:]
        return []

    def stop(self, mode: str = "fast") -> None:
        """Stop it (``fast``: sessions are closed; ``immediate``: no shutdown checkpoint)."""
        pid = self.pid
        if pid is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._pg_ctl("stop", "-w", "-t", "10", "-s", "-m", mode, timeout_s=10)
        if not _wait_gone(pid, 2):
            self.kill()

    def kill(self) -> None:
        """SIGKILL the postmaster and its backends, as a crash of the server's host would."""
        pid = self.pid
        if pid is None:
            return
        family = [pid, *_children_of(pid)]
        for p in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        if all(_wait_gone(p, 5) for p in family):
            # A zombie postmaster (nobody reaps it here) would still pass Postgres' kill(pid, 0) check.
            for stale in (self.datadir / "postmaster.pid", self.parent / f".s.PGSQL.{self.port}.lock"):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()

    def restart(self) -> None:
        self.stop()
        self.start()

    def __repr__(self) -> str:
        return f"PostgresServer(url={self.url!r}, pid={self.pid})"


class RedisServer:
    """A throwaway ``redis-server`` on a free loopback port; no persistence, or AOF (``appendfsync everysec``)."""

    def __init__(
        self,
        binary: str,
        workdir: Path,
        port: int | None = None,
        *,
        persistent: bool = False,
        cluster_port: int | None = None,
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.persistent = persistent
        self.port = port or _free_port()
        self.cluster_port = cluster_port  # a node of a Redis Cluster: its cluster bus port
        self.logfile = workdir / "redis.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    def start(self) -> None:
        if self.pid is not None:
            return
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.persistent else "no",
            "--appendfsync",
            "everysec",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.logfile),
            "--daemonize",
            "no",
        ]
        if self.cluster_port is not None:
            cmd += ["--cluster-enabled", "yes", "--cluster-port", str(self.cluster_port)]
            cmd += ["--cluster-config-file", str(self.workdir / "nodes.conf"), "--cluster-node-timeout", "5000"]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=self.workdir)
        (self.workdir / "redis.pid").write_text(str(self._proc.pid))
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _redis_ping(self.port):
            code = self._proc.poll()
            if code is not None or time.monotonic() > deadline:
                tail = (
                    self.logfile.read_text(errors="replace").strip().splitlines()[-3:] if self.logfile.exists() else []
                )
                self.kill()
                why = f"exited with {code}" if code is not None else f"no PONG in {_START_TIMEOUT_S:.0f} s"
                raise ServiceStartFailed(
                    f"throwaway Redis on port {self.port} did not start ({why}; log: {self.logfile}): {_one_line(tail)}"
                )
            time.sleep(0.01)

    def stop(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def kill(self) -> None:
        """SIGKILL it, as a crash would."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(5)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __repr__(self) -> str:
        return f"RedisServer(url={self.url!r}, pid={self.pid})"


class RedisClusterServer:
    """Three throwaway ``redis-server --cluster-enabled yes`` nodes on free loopback ports, joined into one
    Redis Cluster by ``redis-cli --cluster create`` (no replicas): each node owns a third of the slots."""

    def __init__(self, nodes: list[RedisServer]) -> None:
        self.nodes = nodes

    @property
    def url(self) -> str:
        """``redis+cluster://`` and every node, as june-worker takes a cluster (``JUNE_REDIS_URL``)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def pid(self) -> int | None:
        return self.nodes[0].pid

    def create(self, redis_cli: str) -> None:
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        try:
            done = subprocess.run(
                [redis_cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=_START_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise ServiceStartFailed(f"redis-cli --cluster create did not return in {_START_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            said = _one_line((done.stderr or done.stdout).strip()[-300:].splitlines())
            raise ServiceStartFailed(f"redis-cli --cluster create failed: {said}")
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not all(_cluster_ok(n.port, len(self.nodes)) for n in self.nodes):
            if time.monotonic() > deadline:
                raise ServiceStartFailed(
                    f"the Redis Cluster on {addresses} did not come up in {_START_TIMEOUT_S:.0f} s (cluster_state not ok)"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __repr__(self) -> str:
        return f"RedisClusterServer(url={self.url!r})"


def _cluster_ok(port: int, size: int) -> bool:
    """The node says the cluster is ok and knows all ``size`` nodes (so every node routes every slot)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"CLUSTER INFO\r\n")
            data = b""
            while b"cluster_stats_messages" not in data and len(data) < 4096:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return False
    text = data.decode(errors="replace")
    return "cluster_state:ok" in text and f"cluster_known_nodes:{size}" in text


# --- the registry: everything started here is stopped at exit ------------------------------------------

_servers: list[PostgresServer | RedisServer | RabbitMQServer] = []
_servers_lock = threading.Lock()


def _register(server: PostgresServer | RedisServer | RabbitMQServer) -> None:
    with _servers_lock:
        _servers.append(server)


def _unregister(server: PostgresServer | RedisServer | RabbitMQServer) -> None:
    with _servers_lock:
        with contextlib.suppress(ValueError):
            _servers.remove(server)


def _stop_quietly(server: PostgresServer | RedisServer | RabbitMQServer) -> None:
    with contextlib.suppress(Exception):
        if isinstance(server, PostgresServer):
            server.stop(mode="immediate")  # throwaway data: no shutdown checkpoint needed
        elif isinstance(server, RedisServer):
            server.stop()
        else:
            server.close()  # the node and its epmd


def shutdown() -> None:
    """Stop every server this process started and remove the temp dirs. Idempotent."""
    if os.getpid() != _OWNER_PID:
        return  # a forked child: the servers are its parent's
    with _servers_lock:
        servers = list(_servers)
        _servers.clear()
    # Plain threads: at interpreter exit an executor refuses new work.
    threads = [threading.Thread(target=_stop_quietly, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    _workspace.remove()


atexit.register(shutdown)
_previous_sigterm: Any = None


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    shutdown()
    signal.signal(signal.SIGTERM, _previous_sigterm if callable(_previous_sigterm) else signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_handler() -> None:
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread() or _previous_sigterm is not None:
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is _on_sigterm:
        return
    _previous_sigterm = current if current is not None else signal.SIG_DFL
    signal.signal(signal.SIGTERM, _on_sigterm)


Server = TypeVar("Server", "PostgresServer", "RedisServer", "RabbitMQServer")


def _start_twice(make: Callable[[], Server]) -> Server:
    """``make()`` a server (registered, not started) and start it; when that fails, stop what it left running and do
    both once more (a new dir, new ports). Raises :class:`ServiceStartFailed`: the second attempt's reason with the end of
    its log, and the first attempt's reason."""
    failures: list[str] = []
    for _ in range(2):
        server: Server | None = None
        try:
            server = make()
            server.start()
            return server
        except ServiceStartFailed as exc:
            failures.append(str(exc))
        except (OSError, subprocess.SubprocessError) as exc:  # one line, not a traceback per test
            failures.append(f"could not start a throwaway server: {exc!r}")
        if server is not None:  # its dir stays, for its log, until the run's workspace is removed
            _unregister(server)
            _stop_quietly(server)
    raise ServiceStartFailed(f"{failures[-1]} [tried twice; the first attempt: {failures[0]}]")


def _start_postgres(*, private: bool) -> PostgresServer:
    """The shared instance runs on its own ``initdb``; a private one on a copy of the template (cheaper)."""
    bindir = _find_pg_bin()
    if bindir is None:
        raise ServiceUnavailable(f"no PostgreSQL for the tests: {_INSTALL_PG}")

    def make() -> PostgresServer:
        parent = _workspace.new_dir("pg")
        _chown_to_postgres(parent)
        server = PostgresServer(bindir, parent)
        _register(server)  # from here on, a failure cleans it up (_start_twice) and an exit stops it
        if private:
            template = _workspace.pg_template(bindir)
            cmd = _as_postgres(["cp", "-a", str(template), str(parent / "data")])
            done = subprocess.run(cmd, capture_output=True, timeout=_START_TIMEOUT_S)
            if done.returncode != 0:
                raise ServiceStartFailed(
                    f"could not copy the Postgres template: {_one_line(done.stderr.decode(errors='replace').splitlines())}"
                )
        else:
            _initdb(bindir, parent / "data")
        return server

    return _start_twice(make)


def _start_redis(*, persistent: bool = False) -> RedisServer:
    binary = _find_redis_server()
    if binary is None:
        raise ServiceUnavailable(f"no Redis for the tests: {_INSTALL_REDIS}")

    def make() -> RedisServer:
        server = RedisServer(binary, _workspace.new_dir("redis"), persistent=persistent)
        _register(server)
        return server

    return _start_twice(make)


def _start_redis_cluster(nodes: list[RedisServer], size: int = 3) -> RedisClusterServer:
    """Start ``size`` cluster nodes (each appended to ``nodes`` as soon as it runs, for the caller to stop) and
    join them into one cluster."""
    binary = _find_redis_server()
    if binary is None:
        raise ServiceUnavailable(f"no Redis for the tests: {_INSTALL_REDIS}")
    redis_cli = str(Path(binary).with_name("redis-cli"))
    if not os.access(redis_cli, os.X_OK):
        redis_cli = shutil.which("redis-cli") or ""
    if not redis_cli:
        raise ServiceUnavailable(f"no redis-cli next to {binary} to create a Redis Cluster: {_INSTALL_REDIS}")

    def make() -> RedisServer:
        node = RedisServer(binary, _workspace.new_dir("redis-cluster"), cluster_port=_free_port())
        _register(node)
        return node

    for _ in range(size):
        nodes.append(_start_twice(make))
    cluster = RedisClusterServer(nodes)
    cluster.create(redis_cli)
    return cluster


def _start_rabbitmq() -> RabbitMQServer:
    from tests import _rabbitmq

    found = _rabbitmq.find_binaries()
    if found is None:
        raise ServiceUnavailable(f"no RabbitMQ for the tests: {_rabbitmq.INSTALL}")

    def make() -> RabbitMQServer:
        server = _rabbitmq.RabbitMQServer(*found, _workspace.new_dir("rabbitmq"))
        _register(server)
        return server

    return _start_twice(make)


def _amqp_answers(url: str) -> bool:
    from tests import _rabbitmq

    return _rabbitmq.amqp_answers(url)


# --- the shared services --------------------------------------------------------------------------------


class _Service:
    """One shared service: the env URL if it answers, else a throwaway server; resolved once, in the background."""

    def __init__(
        self,
        env: str,
        answers: Callable[[str], bool],
        start: Callable[[], PostgresServer | RedisServer | RabbitMQServer],
    ) -> None:
        self.env = env
        self._answers = answers
        self._start = start
        self._lock = threading.Lock()
        self._future: Future[str] | None = None
        self.source = ""

    def _resolve(self) -> str:
        given = os.environ.get(self.env)
        if given and self._answers(given):
            self.source = f"{self.env}={given}"
            return given
        try:
            server = self._start()
        except ServiceUnavailable as exc:
            if given:
                raise type(exc)(f"{exc} ({self.env}={given} did not answer)") from None
            raise
        except (OSError, subprocess.SubprocessError) as exc:  # one line, not a traceback per test
            raise ServiceStartFailed(f"could not start a throwaway server for {self.env}: {exc}") from exc
        self.source = f"throwaway server (pid {server.pid}) at {server.url}" + (
            f"; {self.env}={given} did not answer" if given else ""
        )
        os.environ[self.env] = server.url  # subprocesses (Celery workers) inherit it
        return server.url

    def start(self, executor: ThreadPoolExecutor) -> None:
        with self._lock:
            if self._future is None:
                self._future = executor.submit(self._resolve)

    @property
    def future(self) -> Future[str] | None:
        with self._lock:
            return self._future

    def url(self, executor: ThreadPoolExecutor) -> str:
        self.start(executor)
        assert self._future is not None
        return self._future.result()


_executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="june-services")
_postgres = _Service("JUNE_DATABASE_URL", _postgres_answers, lambda: _start_postgres(private=False))
_redis = _Service("JUNE_REDIS_URL", _redis_answers, _start_redis)
_amqp = _Service("JUNE_TEST_AMQP_URL", _amqp_answers, _start_rabbitmq)


def start_in_background(
    *, postgres: bool = True, redis: bool = True, amqp: bool = False, private_postgres: bool = False
) -> None:
    """Begin resolving the services now (in parallel, without waiting); the URL functions then just wait."""
    _install_sigterm_handler()
    if postgres:
        _postgres.start(_executor)
    if redis:
        _redis.start(_executor)
    if amqp:
        _amqp.start(_executor)
    if private_postgres:
        bindir = _find_pg_bin()
        if bindir is not None:
            _executor.submit(_workspace.pg_template, bindir)  # errors resurface when a test asks


def wait_for_services(*, postgres: bool = False, redis: bool = False, amqp: bool = False) -> None:
    """Wait until those of the services named that have begun to start are up or have failed (raises nothing: the URL
    functions raise). A test that needs them waits here before its timer starts (``tests/conftest.py``): a server's
    start has budgets of its own, and may need more than a test's."""
    wanted = [s for s, yes in ((_postgres, postgres), (_redis, redis), (_amqp, amqp)) if yes]
    futures = [f for f in (s.future for s in wanted) if f is not None]
    if futures:
        concurrent.futures.wait(futures)


def postgres_url() -> str:
    """A Postgres URL that answers, also exported as ``JUNE_DATABASE_URL``; raises :class:`ServiceUnavailable`."""
    _install_sigterm_handler()
    return _postgres.url(_executor)


def redis_url() -> str:
    """A Redis URL that answers, also exported as ``JUNE_REDIS_URL``; raises :class:`ServiceUnavailable`."""
    _install_sigterm_handler()
    return _redis.url(_executor)


def amqp_url() -> str:
    """A RabbitMQ URL that answers, also exported as ``JUNE_TEST_AMQP_URL``; raises :class:`ServiceUnavailable`."""
    _install_sigterm_handler()
    return _amqp.url(_executor)


def describe() -> list[str]:
    """Where each resolved service came from, for the end-of-run summary."""
    services = (("postgres", _postgres), ("redis", _redis), ("rabbitmq", _amqp))
    return [f"{name}: {s.source}" for name, s in services if s.source]


@contextlib.contextmanager
def private_postgres() -> Iterator[PostgresServer]:
    """A Postgres of the test's own, on a free port: kill it, restart it; it is gone afterwards."""
    _install_sigterm_handler()
    server = _start_postgres(private=True)
    try:
        yield server
    finally:
        _unregister(server)
        _stop_quietly(server)
        _rmtree(server.parent)


@contextlib.contextmanager
def private_redis(*, persistent: bool = False) -> Iterator[RedisServer]:
    """A Redis of the test's own, on a free port: kill it, restart it; it is gone afterwards.

    ``persistent``: with AOF (``appendonly yes``, ``appendfsync everysec``), as docker-compose.yml runs it.
    """
    _install_sigterm_handler()
    server = _start_redis(persistent=persistent)
    try:
        yield server
    finally:
        _unregister(server)
        _stop_quietly(server)
        _rmtree(server.workdir)


@contextlib.contextmanager
def private_redis_cluster() -> Iterator[RedisClusterServer]:
    """A three-node Redis Cluster of the caller's own (``redis+cluster://`` URL), never the machine's Redis; gone
    afterwards."""
    _install_sigterm_handler()
    nodes: list[RedisServer] = []
    try:
        yield _start_redis_cluster(nodes)
    finally:
        for node in nodes:
            _unregister(node)
            _stop_quietly(node)
            _rmtree(node.workdir)


@contextlib.contextmanager
def private_rabbitmq() -> Iterator[RabbitMQServer]:
    """A RabbitMQ node of the test's own, on free ports: stop, kill, restart or wipe it; it is gone afterwards."""
    _install_sigterm_handler()
    server = _start_rabbitmq()
    try:
        yield server
    finally:
        _unregister(server)
        _stop_quietly(server)
        _rmtree(server.workdir)


def _main() -> None:  # pragma: no cover - a manual check: python -m tests._services
    t0 = time.perf_counter()
    start_in_background()
    print(postgres_url(), redis_url(), f"{time.perf_counter() - t0:.2f}s", file=sys.stderr)
    print("\n".join(describe()), file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    _main()
