"""docs/operations.md, its alert rules and docs/grafana-dashboard.json name the metrics the code exports, and only those."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from june_worker.observe.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "operations.md").read_text()
SOURCES = [
    ROOT / "june_worker" / "observe" / "state.py",
    ROOT / "june_worker" / "gateway" / "metrics.py",
    ROOT / "producers" / "metrics.py",
]
_NAME = re.compile(r"\bjune_[a-z_]+\b")


def _base(name: str) -> str:
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def exported() -> set[str]:
    """The metric families the worker, the state collector and the gateway define."""
    names = {m._name for m in vars(Metrics(enabled=True)).values() if hasattr(m, "_name")}
    for path in SOURCES:
        names |= {
            n for n in re.findall(r'(?:MetricFamily|Counter|Histogram|Gauge)\(\s*"(june_[a-z_]+)"', path.read_text())
        }
    return {_base(n) for n in names}


def documented() -> set[str]:
    table = [line for line in DOC.splitlines() if line.startswith("| `june_")]
    return {_base(line.split("`")[1]) for line in table}


def test_the_metrics_table_lists_exactly_the_metrics_the_code_exports() -> None:
    assert documented() == exported()


def test_the_alert_rules_parse_and_use_documented_metrics_only() -> None:
    block = DOC.split("### Example alert rules", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    rules = yaml.safe_load(block)["groups"][0]["rules"]
    assert {r["alert"] for r in rules} >= {"JuneRelayStuck", "JuneTurnsFailing", "JuneParkedTooLong"}
    used = {_base(n) for r in rules for n in _NAME.findall(r["expr"])}
    assert used and used <= documented()


def test_the_grafana_dashboard_is_json_and_uses_documented_metrics_only() -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {_base(n) for e in exprs for n in _NAME.findall(e)}
    assert len(dashboard["panels"]) >= 10 and used <= documented()
    assert {"june_turns", "june_step_duration_seconds", "june_outbox_relay_lag_seconds"} <= used
