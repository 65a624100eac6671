"""docs/settings.md is generated from the declared variables: it fails here when it is stale."""

from __future__ import annotations

import pytest

from june_worker.settings_doc import PATH, render
from june_worker.worker.settings import WorkerEnv

pytestmark = pytest.mark.unit


def test_the_committed_settings_table_is_the_one_the_declarations_give() -> None:
    assert PATH.read_text() == render(), "docs/settings.md is stale: run python -m june_worker.settings_doc"


def test_every_worker_variable_is_declared_with_a_description_and_an_expected_value() -> None:
    for name, field in WorkerEnv.variables():
        extra = field.json_schema_extra or {}
        assert field.description and isinstance(extra, dict) and extra.get("expected"), name
        assert f"`{name}`" in render()
