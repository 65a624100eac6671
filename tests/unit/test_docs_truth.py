"""The README and docs/ say what the code does: the message fields, the outcomes, which tasks answer, and where
their links and test references point."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from june_worker.worker.payloads import TurnMessage
from producers import ResumeOutcome

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PRODUCERS_MD = (ROOT / "docs" / "producers.md").read_text(encoding="utf-8")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_TEST_REF = re.compile(r"`?(tests/[\w/]+\.py)(?:::(\w+))?")


def test_the_june_turn_row_of_producers_md_names_every_field_of_the_message() -> None:
    row = next(line for line in PRODUCERS_MD.splitlines() if line.startswith("| `june.turn` |"))
    argument = row.split("|")[3]
    assert set(re.findall(r'"(\w+)"', argument.split("`)")[0])) == set(TurnMessage.model_fields)


def test_the_resume_outcome_producers_md_describes_has_every_field_of_the_class() -> None:
    described = re.search(r"`ResumeOutcome\(([^)]*)\)`", PRODUCERS_MD)
    assert described is not None
    fields = {f.name for f in dataclasses.fields(ResumeOutcome) if f.repr}
    assert {n.strip() for n in described.group(1).split(",")} == fields


def test_producers_md_says_which_tasks_store_no_result_instead_of_promising_every_task_answers() -> None:
    tasks = (ROOT / "june_worker" / "worker" / "tasks.py").read_text(encoding="utf-8")
    silent = set(re.findall(r'@app\.task\(name="(june\.\w+)"[^)]*ignore_result=True', tasks)) - {"june.sweep"}
    assert silent == {"june.turn", "june.proactive"}
    sentence = next(s for s in re.split(r"(?<=\.)\s", PRODUCERS_MD.replace("\n", " ")) if "store no result" in s)
    assert all(f"`{task}`" in sentence for task in silent), sentence
    assert "by every task" not in PRODUCERS_MD


def test_every_relative_link_of_the_docs_points_at_a_file_of_the_repository() -> None:
    broken = []
    for doc in DOCS:
        for target in _LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not files
            path = (doc.parent / target).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_every_relative_path_a_doc_names_is_a_file_of_the_repository() -> None:
    outside = [
        f"{doc.relative_to(ROOT)}: {m}"
        for doc in DOCS
        for m in re.findall(r"`(\.\./[^`\s]+)`", doc.read_text(encoding="utf-8"))
        if not ((doc.parent / m).resolve().is_relative_to(ROOT) and (doc.parent / m).exists())
    ]
    assert outside == []


def test_every_test_the_docs_name_exists() -> None:
    missing = []
    for doc in DOCS:
        for path, name in _TEST_REF.findall(doc.read_text(encoding="utf-8")):
            file = ROOT / path
            if not file.exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
            elif name and not re.search(rf"^(async )?def {name}\(", file.read_text(encoding="utf-8"), re.M):
                missing.append(f"{doc.relative_to(ROOT)}: {path}::{name}")
    assert missing == []
