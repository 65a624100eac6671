"""The two documented ways to start the gateway, as processes: ``june gateway`` and uvicorn's ``--factory``."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import ROOT, Stack, wait_for

TOKEN = f"cli-token-{uuid.uuid4().hex}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gateway_env(stack: Stack, tmp_path: Path) -> dict[str, str]:
    tokens = tmp_path / "tokens.toml"
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    tokens.write_text(f'[tokens."sha256:{digest}"]\nprincipal = "op-cli"\nagents = ["ops"]\n')
    env = {k: v for k, v in stack.env.items() if not k.startswith("JUNE_GATEWAY_")}
    return {**env, "JUNE_GATEWAY_TOKENS_FILE": str(tokens), "JUNE_GATEWAY_AGENTS": "ops,dribble"}


class Started:
    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out = log.open("wb")
        self.popen = subprocess.Popen(args, env=env, cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT,
                                      start_new_session=True)  # fmt: skip

    def stop(self) -> int:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        self._out.close()
        return self.popen.returncode


@pytest.fixture
def started() -> Iterator[list[Started]]:
    procs: list[Started] = []
    yield procs
    for p in procs:
        p.stop()


def healthy(url: str, proc: Started) -> bool:
    if proc.popen.poll() is not None:
        raise AssertionError(f"the gateway exited:\n{proc.log.read_text()}")
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("how", ["june gateway", "uvicorn --factory"])
def test_the_gateway_starts_serves_and_stops(gw_stack: Stack, tmp_path: Path, started: list[Started], how: str) -> None:
    port = free_port()
    if how == "june gateway":
        args = [sys.executable, "-m", "june_worker.cli", "gateway", "--port", str(port)]
    else:
        args = [sys.executable, "-m", "uvicorn", "june_worker.gateway.app:create_app", "--factory",
                "--host", "127.0.0.1", "--port", str(port), "--timeout-graceful-shutdown", "5"]  # fmt: skip
    proc = Started(args, gateway_env(gw_stack, tmp_path), tmp_path / "gateway.log")
    started.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url, proc), timeout_s=30, every_s=0.1, what=f"{how} to answer /healthz")
    agents = httpx.get(f"{url}/v1/agents", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert agents == {"principal": "op-cli", "agents": ["ops"], "operator": False}
    assert httpx.get(f"{url}/v1/agents").status_code == 401
    r = httpx.post(f"{url}/v1/agents/ops/sessions/s-{uuid.uuid4().hex[:8]}/turns", json={"text": "hi"},
                   params={"wait": 1}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)  # fmt: skip
    assert r.json()["text"] == "ok: hi"
    assert proc.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert "Application shutdown complete." in proc.log.read_text()
    assert TOKEN not in proc.log.read_text()


def test_june_gateway_exits_2_with_one_line_on_a_configuration_mistake(gw_stack: Stack, tmp_path: Path) -> None:
    env = {k: v for k, v in gateway_env(gw_stack, tmp_path).items() if k != "JUNE_GATEWAY_TOKENS_FILE"}
    env["JUNE_GATEWAY_TOKENS"] = json.dumps({"too-short": {"principal": "p", "agents": "*"}})
    done = subprocess.run([sys.executable, "-m", "june_worker.cli", "gateway"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "june gateway: JUNE_GATEWAY_TOKENS, token #1 (principal p): a token must be 'sha256:<64 hex>' or at least "
        "16 printable characters without spaces"
    ]
    assert "too-short" not in done.stderr


def agents_status(url: str, token: str) -> int:
    return httpx.get(f"{url}/v1/agents", headers={"Authorization": f"Bearer {token}"}, timeout=10).status_code


@pytest.mark.parametrize("how", ["june gateway", "uvicorn --factory"])
def test_sighup_reloads_the_token_table_so_a_revoked_token_is_refused_without_a_restart(
    gw_stack: Stack, tmp_path: Path, started: list[Started], how: str
) -> None:
    # Given a gateway serving the tokens of its file
    port = free_port()
    if how == "june gateway":
        args = [sys.executable, "-m", "june_worker.cli", "gateway", "--port", str(port)]
    else:
        args = [sys.executable, "-m", "uvicorn", "june_worker.gateway.app:create_app", "--factory",
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    env = gateway_env(gw_stack, tmp_path)
    proc = Started(args, env, tmp_path / "gateway.log")
    started.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: healthy(url, proc), timeout_s=30, every_s=0.1, what=f"{how} to answer /healthz")
    assert agents_status(url, TOKEN) == 200
    # When the file revokes that token for another, and the gateway gets SIGHUP
    new_token = f"cli-token-{uuid.uuid4().hex}"
    tokens = Path(env["JUNE_GATEWAY_TOKENS_FILE"])
    tokens.write_text(f'[tokens."{new_token}"]\nprincipal = "op-new"\nagents = ["ops"]\n')
    os.kill(proc.popen.pid, signal.SIGHUP)
    # Then the revoked token is refused and the new one let in, by the same process
    wait_for(lambda: agents_status(url, TOKEN) == 401, timeout_s=30, what="the revoked token to be refused")
    assert agents_status(url, new_token) == 200
    # and a table that does not load keeps the one in use, saying so in its log
    tokens.write_text("this is not [ toml")
    os.kill(proc.popen.pid, signal.SIGHUP)
    wait_for(lambda: "token table not reloaded" in proc.log.read_text(), timeout_s=30, what="the refusal logged")
    assert agents_status(url, new_token) == 200 and proc.popen.poll() is None
    log = proc.log.read_text()
    assert "not valid TOML" in log
    if how == "june gateway":  # logs at INFO (uvicorn --factory leaves june's loggers at WARNING)
        assert "SIGHUP: token table reloaded: 1 token(s)" in log
    assert TOKEN not in log and new_token not in log
