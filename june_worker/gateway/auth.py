"""Bearer tokens → verified principals: who is calling, and which agents they may see.

Tokens are configured as one JSON object (``JUNE_GATEWAY_TOKENS``) and/or a JSON or TOML file
(``JUNE_GATEWAY_TOKENS_FILE``), keyed by the token, or better by its SHA-256 so the file holds
no secret (``sha256:<64 hex digits>``, from ``printf %s "$TOKEN" | sha256sum``)::

    {"sha256:9f86d081...": {"principal": "op-alice", "agents": ["ops"], "claims": {"team": "payments"}},
     "a-long-random-token-for-ci": {"principal": "ci-bot", "agents": "*", "role": "operator"},
     "a-long-random-token-for-acme": {"principal": "acme", "agents": ["ops"], "sessions": ["acme-"]}}

``principal`` is the identity a resume is made ``by`` (never a field the client sends);
``agents`` lists the agents the token may see (``"*"``: all); ``claims`` travel with the
principal to the agent's ``authorize_answer`` hook. ``role`` is ``user`` (the default: the
sessions it opened, see :mod:`.access`) or ``operator`` (every session of its agents);
``sessions`` lists session-id prefixes the principal is confined to (its own namespace). A
plain token must be at least 16 characters. A file may also wrap the table in
``{"tokens": {...}}`` (``[tokens."..."]`` in TOML).

Lookup hashes the presented token and compares it with **every** configured digest with
:func:`hmac.compare_digest`, without stopping at a match: the time taken does not depend on
which token matched or on how much of one did.

The rule a reader must not break: **a token never reaches a log line, an error message or an
event.** Errors about the configuration name the principal, never the token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["Principal", "TokenTable", "bearer_token", "load_tokens", "parse_tokens"]

_DIGEST_RE = re.compile(r"^sha256:([0-9a-fA-F]{64})$")
_TOKEN_RE = re.compile(r"^[\x21-\x7e]{16,4096}$")
_AGENT_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_PREFIX_RE = re.compile(r"^[\x21-\x7e]{1,255}$")
MIN_TOKEN_CHARS = 16
ROLES = ("user", "operator")


@dataclass(frozen=True)
class Principal:
    """A caller the gateway verified: its identity, the agents it may see (None: all), and its claims.

    ``operator``: it sees every session of its agents. ``session_prefixes``: the session ids it
    may address at all (None: any id).
    """

    id: str
    agents: frozenset[str] | None = None
    claims: Mapping[str, Any] = field(default_factory=dict, compare=False)
    operator: bool = False
    session_prefixes: tuple[str, ...] | None = None

    def sees(self, agent: str) -> bool:
        return self.agents is None or agent in self.agents

    def may_address(self, session: str) -> bool:
        """Whether the session id lies in this principal's namespace (any id when it has no prefixes)."""
        return self.session_prefixes is None or session.startswith(self.session_prefixes)

    def to_json(self) -> dict[str, Any]:
        """The principal as the worker takes it (``Principal``: ``id`` plus claims)."""
        return {**self.claims, "id": self.id}


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    principal: Principal


@dataclass(frozen=True)
class TokenTable:
    """The configured tokens, as SHA-256 digests; :meth:`lookup` is constant-time in the token."""

    entries: tuple[_Entry, ...] = ()

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"TokenTable({len(self.entries)} tokens)"

    def lookup(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode()).digest()
        found: Principal | None = None
        for entry in self.entries:
            if hmac.compare_digest(entry.digest, digest):
                found = entry.principal  # no break: every entry is compared, match or not
        return found

    @classmethod
    def of(cls, tokens: Mapping[str, Principal]) -> TokenTable:
        """A table from plain tokens (tests, embedding); see :func:`parse_tokens` for the config format."""
        return cls(tuple(_Entry(hashlib.sha256(t.encode()).digest(), p) for t, p in tokens.items()))


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None when there is no such header."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _principal(spec: Any, where: str) -> Principal:
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{where}: expected an object with 'principal' and 'agents'")
    unknown = set(spec) - {"principal", "agents", "claims", "role", "sessions"}
    if unknown:
        raise ConfigError(
            f"{where}: unknown fields {sorted(unknown)}; expected principal, agents, claims, role, sessions"
        )
    pid = spec.get("principal")
    if not isinstance(pid, str) or not 0 < len(pid.strip()) <= 256:
        raise ConfigError(f"{where}: 'principal' must be a non-empty string of at most 256 characters")
    agents_spec = spec.get("agents")
    agents: frozenset[str] | None
    if agents_spec == "*":
        agents = None
    elif isinstance(agents_spec, list) and all(isinstance(a, str) and _AGENT_RE.match(a) for a in agents_spec):
        agents = frozenset(agents_spec)
    else:
        raise ConfigError(f"{where} (principal {pid}): 'agents' must be \"*\" or a list of agent names")
    claims = spec.get("claims", {})
    if not isinstance(claims, Mapping) or "id" in claims:
        raise ConfigError(f"{where} (principal {pid}): 'claims' must be an object without an 'id'")
    role = spec.get("role", "user")
    if role not in ROLES:
        raise ConfigError(f'{where} (principal {pid}): \'role\' must be "user" or "operator", not {role!r}')
    prefixes_spec = spec.get("sessions")
    prefixes: tuple[str, ...] | None = None
    if prefixes_spec is not None:
        if not (
            isinstance(prefixes_spec, list)
            and prefixes_spec
            and all(isinstance(p, str) and _PREFIX_RE.match(p) for p in prefixes_spec)
        ):
            raise ConfigError(
                f"{where} (principal {pid}): 'sessions' must be a non-empty list of session-id prefixes "
                "(printable ASCII, no spaces)"
            )
        prefixes = tuple(prefixes_spec)
    return Principal(id=pid, agents=agents, claims=dict(claims), operator=role == "operator", session_prefixes=prefixes)


def parse_tokens(table: Any, source: str) -> dict[bytes, Principal]:
    """Digest → principal from one configured object; ``source`` names it in errors (never a token)."""
    if isinstance(table, Mapping) and set(table) == {"tokens"} and isinstance(table["tokens"], Mapping):
        table = table["tokens"]
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: expected an object mapping tokens to {{principal, agents}}")
    out: dict[bytes, Principal] = {}
    for n, (key, spec) in enumerate(table.items(), start=1):
        where = f"{source}, token #{n}"
        principal = _principal(spec, where)
        match = _DIGEST_RE.match(key) if isinstance(key, str) else None
        if match:
            digest = bytes.fromhex(match.group(1))
        elif isinstance(key, str) and _TOKEN_RE.match(key) and not key.lower().startswith("sha256:"):
            digest = hashlib.sha256(key.encode()).digest()
        else:
            raise ConfigError(
                f"{where} (principal {principal.id}): a token must be 'sha256:<64 hex>' or at least "
                f"{MIN_TOKEN_CHARS} printable characters without spaces"
            )
        if digest in out:
            raise ConfigError(f"{where} (principal {principal.id}): the same token is configured twice")
        out[digest] = principal
    return out


def load_tokens(env_json: str | None, path: str | None) -> TokenTable:
    """Tokens from ``JUNE_GATEWAY_TOKENS`` (JSON) and ``JUNE_GATEWAY_TOKENS_FILE`` (JSON, or TOML by suffix)."""
    merged: dict[bytes, Principal] = {}
    sources: list[tuple[Any, str]] = []
    if env_json is not None and env_json.strip():
        try:
            sources.append((json.loads(env_json), "JUNE_GATEWAY_TOKENS"))
        except ValueError as exc:
            # The message of a JSON error quotes no input, so no token leaks through it.
            raise ConfigError(f"JUNE_GATEWAY_TOKENS is not valid JSON (line {getattr(exc, 'lineno', '?')})") from None
    if path is not None and path.strip():
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"JUNE_GATEWAY_TOKENS_FILE {path}: cannot read it ({exc.strerror})") from None
        try:
            data = tomllib.loads(text) if file.suffix.lower() == ".toml" else json.loads(text)
        except (ValueError, tomllib.TOMLDecodeError):
            kind = "TOML" if file.suffix.lower() == ".toml" else "JSON"
            raise ConfigError(f"JUNE_GATEWAY_TOKENS_FILE {path}: not valid {kind}") from None
        sources.append((data, f"JUNE_GATEWAY_TOKENS_FILE {path}"))
    for data, source in sources:
        for digest, principal in parse_tokens(data, source).items():
            if digest in merged:
                raise ConfigError(f"{source}: a token of principal {principal.id} is configured twice")
            merged[digest] = principal
    return TokenTable(tuple(_Entry(d, p) for d, p in merged.items()))
