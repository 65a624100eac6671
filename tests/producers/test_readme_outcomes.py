"""The README names every outcome ``june.resume`` can answer, as the producer client types them."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from producers.outcomes import ResumeStatus

ROOT = Path(__file__).parent.parent.parent


def listed(doc: Path, marker: str) -> list[str]:
    """The ``a | b | c`` list of outcomes on the line of ``doc`` that contains ``marker``."""
    (line,) = [line for line in doc.read_text().splitlines() if marker in line]
    (found,) = re.findall(r"((?:[a-z]+ \| )+[a-z]+)\s*$", line)
    return [s.strip() for s in found.split("|")]


def test_the_readme_lists_every_resume_outcome_error_included() -> None:
    outcomes = listed(ROOT / "README.md", "print(outcome.status)")
    assert sorted(outcomes) == sorted(typing.get_args(ResumeStatus))
    assert "error" in outcomes  # the authorize_answer hook raised: nothing applied, retry later


def test_the_producer_guide_lists_the_same_outcomes() -> None:
    assert sorted(listed(ROOT / "docs" / "producers.md", "# outcome.status:")) == sorted(typing.get_args(ResumeStatus))
