"""docs/benchmarks.md keeps one current table per measurement (earlier runs, their dates and commits live in git), and
docs/operations.md is a user's guide: the test suite's internals are in docs/contributing.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK_LINES = 500
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")  # hex with a letter and a digit
TEST_INTERNALS = ("ParkingPool", "tests/fleets.py", "tests/rehost.py", "PooledRolloutWorker")


def test_benchmarks_keeps_current_tables_under_500_lines_and_operations_no_test_internals():
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    lines = len(benchmarks.splitlines())
    assert lines < BENCHMARK_LINES, (f"docs/benchmarks.md has {lines} lines (under {BENCHMARK_LINES}): replace a "
                                     "measurement's table with its latest run and leave the history to git")
    stamps = DATE.findall(benchmarks) + COMMIT.findall(benchmarks)
    assert not stamps, f"docs/benchmarks.md names dates or commits {stamps}: git's history of the page keeps them"
    operations = (ROOT / "docs" / "operations.md").read_text()
    internals = [name for name in TEST_INTERNALS if name in operations]
    assert not internals, f"docs/operations.md mentions {internals}: the tests' internals go in docs/contributing.md"
    assert all(name in (ROOT / "docs" / "contributing.md").read_text() for name in TEST_INTERNALS)
