"""The suite's own budgets (tests/conftest.py, tests/_budgets.py): what a busy machine slows down gets time of its
own, and a server that does not start fails the tests that need it instead of ending the run.

Fails on main (c104bc8): a test that set up a module's workers had only its own timeout for them, and a server that
did not start in 60 s stopped the whole run (pytest.exit).
"""

from __future__ import annotations

import pytest

from tests import _services
from tests._budgets import SHARED_SETUP_S
from tests.conftest import _handles_shared_fixtures, _or_exit


def _own_timeout(config: pytest.Config) -> float:
    return float(config.getoption("timeout", None) or config.getini("timeout"))


@pytest.fixture(scope="module")
def used_by_one_test() -> object:
    return object()


@pytest.fixture(scope="module")
def shared_by_the_module() -> object:
    return object()


def test_the_test_that_sets_up_a_fixture_of_its_module_gets_time_for_it(
    used_by_one_test: object, request: pytest.FixtureRequest
) -> None:
    # Given a test that uses a module-scoped fixture no test before it set up
    # Then its timeout is its own plus the allowance for shared set-ups
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None and marker.args[0] == _own_timeout(request.config) + SHARED_SETUP_S


def test_a_test_whose_shared_fixtures_are_set_up_and_stay_keeps_its_own_timeout(
    shared_by_the_module: object, request: pytest.FixtureRequest
) -> None:
    # Given a test of a module whose module-scoped fixture is set up, and a next test in the same module
    # Then it gets no allowance: it neither sets up nor tears down anything shared
    assert not _handles_shared_fixtures(request.node, nextitem=request.node)


def test_a_server_that_did_not_start_fails_the_test_and_not_the_run() -> None:
    # Given a server that did not start
    def start() -> str:
        raise _services.ServiceStartFailed("throwaway Redis on port 1 did not start (exited with 1; log: x): boom")

    # When a fixture asks for it; Then the test fails with that line (pytest.exit would end the run)
    with pytest.raises(pytest.fail.Exception, match="did not start"):
        _or_exit(start)


def test_a_service_nothing_can_provide_ends_the_run() -> None:
    # Given no binary and no URL for a service
    def start() -> str:
        raise _services.ServiceUnavailable("no Redis for the tests: install redis-server")

    # When a fixture asks for it; Then the run ends with that line
    with pytest.raises(pytest.exit.Exception, match="install redis-server"):
        _or_exit(start)
