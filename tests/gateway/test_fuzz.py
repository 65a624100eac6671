"""A fuzz run of the API from its own OpenAPI schema (schemathesis): no request gets a 5xx.

Each operation is one test: schemathesis generates requests that fit the schema and requests
that break it, a bounded number of each, derandomized (the same examples every run). They go
to a gateway of their own, on the package's real workers, with a token granted only ``ops``
(whose scripted replies are instant) and SSE responses cut after a second, so a generated
request for a session's live stream ends.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from june_worker.gateway import GatewaySettings, Principal, TokenTable, create_app
from tests.integration.conftest import Stack

from .conftest import settings_for
from .kit import ServedApp

TOKEN = f"fuzz-token-{uuid.uuid4().hex}"
EXAMPLES = 30


def _cases() -> list[tuple[str, str, str]]:
    """(method, path, mode) of every operation, from the schema the app builds (no server needed).

    Every operation gets requests that fit the schema, and requests for the agent the token
    sees (they reach the workers); those with parameters or a body also get ones that break it.
    """
    schema = create_app(GatewaySettings(agents=("ops",), insecure_dev=True)).openapi()
    out: list[tuple[str, str, str]] = []
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            out.append((method.upper(), path, "positive"))
            if "{agent}" in path:
                out.append((method.upper(), path, "positive, agent ops"))
            if op.get("parameters") or op.get("requestBody"):
                out.append((method.upper(), path, "negative"))
    return out


@pytest.fixture(scope="module")
def fuzz_url(gw_stack: Stack) -> Iterator[str]:
    tokens = TokenTable.of({TOKEN: Principal("op-fuzz", frozenset({"ops"}))})
    served = ServedApp(create_app(settings_for(gw_stack, tokens, max_stream_s=1.0, wait_s=30.0)), access_log=False)
    try:
        yield served.url
    finally:
        served.stop()


@pytest.mark.parametrize(("method", "path", "mode"), _cases())
def test_no_request_gets_a_server_error(fuzz_url: str, method: str, path: str, mode: str) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")
    operation = schema[path][method]
    headers = {"Authorization": f"Bearer {TOKEN}"}
    generation = GenerationMode.NEGATIVE if mode == "negative" else GenerationMode.POSITIVE
    fixed = {"agent": "ops"} if mode.endswith("agent ops") else None

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=generation, path_parameters=fixed))
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=fuzz_url, headers=headers, timeout=60)
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
        )
        case.validate_response(response, checks=[not_a_server_error])

    run()
