"""``june worker``: Celery's worker command, with a pool size that follows the benchmarks unless you give one."""

from __future__ import annotations

import pytest

from june_worker.cli import MAX_DEFAULT_CONCURRENCY, with_loglevel, worker_args


@pytest.mark.parametrize(("cpus", "expected"), [(1, "1"), (2, "2"), (8, "8"), (16, "8"), (64, "8")])
def test_without_c_the_pool_has_one_process_per_cpu_and_at_most_eight(cpus: int, expected: str) -> None:
    assert MAX_DEFAULT_CONCURRENCY == 8
    assert worker_args(["-Q", "june,june.control"], cpus) == ["worker", "-c", expected, "-Q", "june,june.control"]


@pytest.mark.parametrize("given", [["-c", "32"], ["-c32"], ["--concurrency", "3"], ["--concurrency=3"],
                                   ["--autoscale", "10,2"], ["--autoscale=10,2"]])  # fmt: skip
def test_a_pool_size_you_give_is_passed_on_untouched(given: list[str]) -> None:
    assert worker_args([*given, "-l", "INFO"], 16) == ["worker", *given, "-l", "INFO"]


@pytest.mark.parametrize(
    ("rest", "expected"),
    [
        (["-Q", "june"], ["-Q", "june", "-l", "INFO"]),
        (["-Q", "june", "-l", "WARNING"], ["-Q", "june", "-l", "WARNING"]),
        (["--loglevel", "DEBUG"], ["--loglevel", "DEBUG"]),
        (["--loglevel=ERROR"], ["--loglevel=ERROR"]),
        (["-lDEBUG"], ["-lDEBUG"]),
    ],
)
def test_june_worker_and_beat_log_at_info_unless_given_a_level(rest: list[str], expected: list[str]) -> None:
    # Celery's own default (WARNING) says nothing once a worker is ready: an operator could not tell it started
    assert with_loglevel(rest) == expected
