"""Throwaway RabbitMQ servers for the tests, started from the machine's ``rabbitmq-server``.

The machine's own broker (a service, ``/etc/rabbitmq``, its node name, its data) is never
touched: each instance here has its own node name, AMQP port, distribution port, ``epmd`` (on a
port of its own, stopped with the instance), config file, data and log dirs and ``HOME`` (so its
Erlang cookie), all under the test run's temp dir (:mod:`tests._services`), and no plugin
(no management UI). A boot takes about 5 s alone, over a minute on a busy machine
(``tests._budgets.SERVER_START_S``).

``stop()`` is a clean shutdown (SIGTERM: what a confirmed publish wrote to disk survives
``start()``), ``kill()`` a SIGKILL of the node, ``wipe()`` a broker that lost everything (its
data dir is removed before it starts again, empty).

Knobs: ``JUNE_RABBITMQ_SERVER`` (the ``rabbitmq-server`` script of a RabbitMQ install, the
one under ``.../rabbitmq_server-<v>/sbin``, not Debian's wrapper that switches to the
``rabbitmq`` user), ``JUNE_EPMD`` (Erlang's ``epmd``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests import _services
from tests._services import ServiceStartFailed

__all__ = ["RabbitMQServer", "amqp_answers", "find_binaries"]

INSTALL = (
    "install RabbitMQ (Debian/Ubuntu: apt-get install rabbitmq-server; macOS: brew install rabbitmq) so the tests "
    "can start a throwaway broker, or set JUNE_TEST_AMQP_URL to a RabbitMQ that answers"
)


def find_binaries() -> tuple[str, str] | None:
    """``(rabbitmq-server, epmd)``, the script that runs a node as the calling user, and Erlang's epmd."""
    servers = [os.environ.get("JUNE_RABBITMQ_SERVER")]
    servers += sorted(glob.glob("/usr/lib/rabbitmq/lib/rabbitmq_server-*/sbin/rabbitmq-server"), reverse=True)
    servers += ["/usr/lib/rabbitmq/bin/rabbitmq-server", "/opt/homebrew/sbin/rabbitmq-server"]
    servers += ["/usr/local/sbin/rabbitmq-server"]
    epmds = [os.environ.get("JUNE_EPMD"), shutil.which("epmd")]
    epmds += sorted(glob.glob("/usr/lib/erlang/erts-*/bin/epmd"), reverse=True)
    server = next((s for s in servers if s and os.access(s, os.X_OK)), None)
    epmd = next((e for e in epmds if e and os.access(e, os.X_OK)), None)
    return (server, epmd) if server and epmd else None


def amqp_answers(url: str, timeout_s: float = 3.0) -> bool:
    """True when an AMQP broker at ``url`` completes a handshake (and login) within ``timeout_s``."""
    import amqp
    from kombu.utils.url import parse_url

    try:
        parts = parse_url(url)
        conn = amqp.Connection(
            host=f"{parts['hostname'] or '127.0.0.1'}:{parts['port'] or 5672}",
            userid=parts["userid"] or "guest",
            password=parts["password"] or "guest",
            virtual_host=parts["virtual_host"] or "/",
            connect_timeout=timeout_s,
        )
    except Exception:
        return False
    try:
        conn.connect()
        conn.close()
        return True
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            conn.collect()  # the socket of a handshake that failed half way


class RabbitMQServer:
    """One throwaway RabbitMQ node on free loopback ports; see the module docstring."""

    def __init__(self, server: str, epmd: str, workdir: Path) -> None:
        self.server = server
        self.epmd = epmd
        self.workdir = workdir
        self.port = _services._free_port()
        self.dist_port = _services._free_port()
        self.epmd_port = _services._free_port()
        self.node = f"june-test-{os.getpid()}-{workdir.name}@localhost"
        self.logfile = workdir / "rabbitmq.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._epmd: subprocess.Popen[bytes] | None = None
        (workdir / "home").mkdir(exist_ok=True)
        (workdir / "rabbitmq.conf").write_text("log.console = false\nlog.file.level = warning\n")
        (workdir / "enabled_plugins").write_text("[].\n")
        (workdir / "rabbitmq-env.conf").write_text("")  # not the machine's /etc/rabbitmq/rabbitmq-env.conf

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def pid(self) -> int | None:
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    def _env(self) -> dict[str, str]:
        d = self.workdir
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        return {
            **env,
            "HOME": str(d / "home"),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_PID_FILE": str(d / "beam.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-start_epmd false",
        }

    def _start_epmd(self) -> None:
        if self._epmd is not None and self._epmd.poll() is None:
            return
        cmd = [self.epmd, "-port", str(self.epmd_port), "-address", "127.0.0.1"]
        self._epmd = subprocess.Popen(
            cmd, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        (self.workdir / "epmd.pid").write_text(str(self._epmd.pid))

    def start(self) -> None:
        if self.pid is not None:
            return
        self._start_epmd()
        with self.logfile.open("ab") as log:
            self._proc = subprocess.Popen(
                [self.server],
                env=self._env(),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # the node and its helpers in one group: kill() takes them all
            )
        (self.workdir / "rabbitmq.pid").write_text(str(self._proc.pid))
        budget_s = _services._START_TIMEOUT_S
        deadline = time.monotonic() + budget_s
        while not amqp_answers(self.url, timeout_s=1.0):
            code = self._proc.poll()
            if code is not None or time.monotonic() > deadline:
                tail = self.logfile.read_text(errors="replace").strip().splitlines()[-5:]
                self.kill()
                why = f"exited with {code}" if code is not None else f"no AMQP handshake in {budget_s:.0f} s"
                raise ServiceStartFailed(
                    f"throwaway RabbitMQ on port {self.port} did not start ({why}; log: {self.logfile}): "
                    + _services._one_line(tail)
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """A clean shutdown: the node writes what it holds and exits."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap_group()

    def kill(self) -> None:
        """SIGKILL the node and everything it started, as a crash would."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self._reap_group()

    def _reap_group(self) -> None:
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # helpers the node left (erl_child_setup, inet_gethost)

    def restart(self) -> None:
        self.stop()
        self.start()

    def wipe(self) -> None:
        """Stop, remove every queue and message the node kept, start empty: a broker that lost everything."""
        self.stop()
        shutil.rmtree(self.workdir / "mnesia", ignore_errors=True)
        self.start()

    def close(self) -> None:
        """Stop the node and its epmd."""
        self.stop()
        epmd = self._epmd
        if epmd is not None and epmd.poll() is None:
            epmd.kill()
            epmd.wait(5)

    def __repr__(self) -> str:
        return f"RabbitMQServer(url={self.url!r}, pid={self.pid})"
